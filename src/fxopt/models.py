"""Resolve a MODEL spec to a model and example inputs.

A spec is ``zoo:NAME[?key=value&...]``, ``path/to/file.py:CALLABLE`` or
``package.module:CALLABLE``; the callable returns an ``nn.Module`` or
``(nn.Module, example_inputs)``. Shapes like ``1x3x224x224`` give float32 random inputs.

    >>> from fxopt.models import load, parse_shape
    >>> parse_shape("1x3x8x8")
    (1, 3, 8, 8)
    >>> load("zoo:mlp").name
    'mlp'
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fxopt.errors import UserInputError


@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    example_inputs: tuple | None


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x3x224x224' → (1, 3, 224, 224)."""
    parts = text.lower().replace("×", "x").split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise UserInputError(
            f"bad input shape '{text}': expected dimensions joined by 'x', e.g. 1x3x224x224"
        ) from None
    if not shape or any(d <= 0 for d in shape):
        raise UserInputError(f"bad input shape '{text}': every dimension must be positive")
    return shape


def load(spec: str, input_shapes: Sequence[str] = ()) -> LoadedModel:
    """Load the model a spec names; ``input_shapes`` override its example inputs."""
    if spec.startswith("zoo:"):
        loaded = _from_zoo(spec[4:])
    elif ":" in spec:
        loaded = _from_callable(spec)
    else:
        raise UserInputError(
            f"bad MODEL '{spec}': use zoo:NAME, path/to/file.py:CALLABLE or package.module:CALLABLE"
        )
    if input_shapes:
        generator = torch.Generator().manual_seed(0)
        loaded.example_inputs = tuple(_random_input(s, generator) for s in input_shapes)
    if loaded.example_inputs is None:
        raise UserInputError(
            f"{spec} returns a model without example inputs: give --input SHAPE "
            "(e.g. --input 1x3x224x224) or return (model, example_inputs)"
        )
    return loaded


def _random_input(text: str, generator: torch.Generator) -> torch.Tensor:
    shape = parse_shape(text)
    size = math.prod(shape) * 4  # float32
    try:
        return torch.randn(shape, generator=generator)
    except RuntimeError as error:  # the allocator's message has C++ frames in it
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserInputError(
            f"input shape '{text}' needs {size / 2**30:.1f} GiB, which cannot be allocated "
            f"({first[:80]})"
        ) from None


def _from_zoo(text: str) -> LoadedModel:
    from fxopt import zoo

    name, options = zoo.parse_spec(text)
    entry = zoo.create(name, **options)
    return LoadedModel(entry.name, entry.model, tuple(entry.example_inputs))


def _import_file(path: Path, location: str):
    """Import a model file as ``python path`` would run it: its folder on ``sys.path`` (and
    left there: the factory or the model's forward may import siblings lazily), and the
    module in ``sys.modules`` while it runs (``@dataclass`` looks its module up there)."""
    name = f"_fxopt_model_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        sys.modules.pop(name, None)
        raise UserInputError(
            f"importing {location} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def load_attribute(spec: str, what: str = "model"):
    """The object ``spec`` names: ``path/to/file.py:NAME`` or ``package.module:NAME``
    (UserInputError naming ``what`` when the file, module or name is missing)."""
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise UserInputError(f"bad {what} '{spec}': use path/to/file.py:NAME or module:NAME")
    if location.endswith(".py") or "/" in location:
        path = Path(location)
        if not path.is_file():
            raise UserInputError(f"{what} file not found: {location}")
        module = _import_file(path, location)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise UserInputError(f"cannot import module '{location}': {error}") from error
    found = getattr(module, attribute, None)
    if found is None:
        raise UserInputError(f"{location} has no attribute '{attribute}'")
    return found


def _from_callable(spec: str) -> LoadedModel:
    attribute = spec.rpartition(":")[2]
    factory = load_attribute(spec)
    try:
        made = factory() if callable(factory) and not isinstance(factory, nn.Module) else factory
    except Exception as error:
        raise UserInputError(f"{spec} raised {type(error).__name__}: {error}") from error
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        model, inputs = made
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        return LoadedModel(attribute, model, inputs)
    if isinstance(made, nn.Module):
        return LoadedModel(attribute, made, None)
    raise UserInputError(
        f"{spec} returned {type(made).__name__}; expected an nn.Module or "
        "(nn.Module, example_inputs)"
    )
