"""The model zoo: standard architectures with random weights and example inputs.

Every model is written here (no downloads, no torchvision or transformers), is traceable by
both ``torch.fx.symbolic_trace`` and ``torch.export.export``, and is built small by default
so that the whole zoo runs in seconds on a CPU.

>>> from fxopt import zoo; m = zoo.create("resnet18", image=32)
>>> m.model(*m.example_inputs).shape
torch.Size([1, 1000])
>>> name, opts = zoo.parse_spec("bert?config=tiny&seq=8")
>>> [x.shape for x in zoo.create(name, **opts).example_inputs]
[torch.Size([2, 8]), torch.Size([2, 8])]

Models come back in eval mode. Weights depend only on the ``seed`` option (default 0), and
building a model leaves the caller's global RNG untouched.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote

import torch
from torch import nn

from fxopt.errors import UserInputError
from fxopt.zoo import bert, cnn, gpt, llama, mlp, mobilenet, redundant, resnet

__all__ = ["ZooModel", "create", "describe", "names", "options", "parse_spec"]

OptionValue = int | float | str
Builder = Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]


@dataclass
class ZooModel:
    """A model of the zoo, ready to run: ``model(*example_inputs)``."""

    name: str
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    description: str
    #: The options the model was built with, defaults filled in (seed included).
    options: dict[str, OptionValue] = field(default_factory=dict)


@dataclass(frozen=True)
class _Entry:
    # A builder's keyword-only parameters and their defaults are the model's options; the
    # default's type is the option's type.
    build: Builder
    description: str


_REGISTRY: dict[str, _Entry] = {
    "mlp": _Entry(mlp.build, "SimpleMLP: Linear 784→256→256→10 with ReLU"),
    "cnn_bn": _Entry(
        cnn.build, "small CNN: 2× (Conv2d, BatchNorm2d, ReLU, MaxPool2d), then a Linear"
    ),
    "resnet18": _Entry(resnet.build_resnet18, "ResNet-18: basic blocks [2, 2, 2, 2], 11.7M params"),
    "resnet50": _Entry(resnet.build_resnet50, "ResNet-50: bottlenecks [3, 4, 6, 3], 25.6M params"),
    "resnet152": _Entry(
        resnet.build_resnet152, "ResNet-152: bottlenecks [3, 8, 36, 3], 60.2M params"
    ),
    "mobilenet_v2": _Entry(
        mobilenet.build, "MobileNetV2: inverted residuals, depthwise convs, ReLU6, width multiplier"
    ),
    "bert": _Entry(
        bert.build,
        "BERT encoder: embeddings + post-LN self-attention with padding mask, GELU FFN, pooler",
    ),
    "gpt": _Entry(
        gpt.build, "GPT-2-style decoder: pre-LN causal self-attention, GELU MLP, tied LM head"
    ),
    "llama": _Entry(
        llama.build,
        "Llama-shaped decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (family: "
        "llama, qwen2, gemma; step: prefill, or decode on a static KV cache)",
    ),
    "redundant": _Entry(
        redundant.build, "duplicated work for CSE: relu(x) ×2, conv(x) ×2, encoder(v) ×2"
    ),
}

_COMMON_OPTIONS: dict[str, OptionValue] = {"seed": 0}


def names() -> list[str]:
    """The names of the zoo's models, sorted.

    >>> from fxopt import zoo; "resnet50" in zoo.names()
    True
    """
    return sorted(_REGISTRY)


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserInputError(
            f"unknown zoo model '{name}'; valid names: {', '.join(names())}"
        ) from None


def describe(name: str) -> str:
    """One line saying what the model ``name`` is.

    >>> from fxopt import zoo; zoo.describe("resnet18")
    'ResNet-18: basic blocks [2, 2, 2, 2], 11.7M params'
    """
    return _entry(name).description


def options(name: str) -> dict[str, OptionValue]:
    """The options that :func:`create` accepts for ``name``, with their defaults.

    >>> from fxopt import zoo; zoo.options("resnet50")
    {'batch': 1, 'image': 64, 'classes': 1000, 'seed': 0}
    """
    return _declared_options(name)


def _declared_options(name: str) -> dict[str, OptionValue]:
    params = inspect.signature(_entry(name).build).parameters.values()
    declared = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {**declared, **_COMMON_OPTIONS}


def _coerce(name: str, option: str, value: object, default: OptionValue) -> OptionValue:
    kind = type(default)
    expected = f"option '{option}' of zoo model '{name}' must be {kind.__name__}"
    # Values from a spec string arrive as str; values from Python arrive typed.
    if isinstance(value, str) and kind is not str:
        try:
            value = kind(value.strip())
        except ValueError:
            raise UserInputError(f"{expected}, got '{value}'") from None
    elif kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UserInputError(f"{expected}, got {value!r} ({type(value).__name__})")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserInputError(f"{expected} and finite, got {value}")
    return value


def create(name: str, **options: object) -> ZooModel:
    """Build the zoo model ``name`` in eval mode, with deterministic weights and example inputs.

    Options (see :func:`options`) may be given typed or as strings, as they come from a spec
    like ``"resnet50?image=64&batch=2"``; strings are converted to the option's type.

    >>> from fxopt import zoo; m = zoo.create("resnet18", image=32)
    >>> m.example_inputs[0].shape, m.model.training
    (torch.Size([1, 3, 32, 32]), False)
    >>> zoo.create("gpt", seq="8", layers="1").options
    {'config': 'tiny', 'batch': 2, 'seq': 8, 'layers': 1, 'seed': 0}

    Raises:
        UserInputError: an unknown model or option, or an option value of the wrong type.
    """
    entry = _entry(name)
    declared = _declared_options(name)
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise UserInputError(
            f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
            f"for zoo model '{name}'; valid options: {', '.join(declared)}"
        )
    resolved = {
        option: _coerce(name, option, options[option], default) if option in options else default
        for option, default in declared.items()
    }
    seed = resolved.pop("seed")
    if seed < 0:
        raise UserInputError(f"option 'seed' must be >= 0, got {seed}")
    # fork_rng restores the caller's CPU RNG on exit; seeding only the CPU generator avoids
    # touching (or initializing) any accelerator.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model, example_inputs = entry.build(**resolved)
    resolved["seed"] = seed
    shown = ", ".join(f"{k}={v}" for k, v in resolved.items())
    return ZooModel(
        name=name,
        model=model.eval(),
        example_inputs=tuple(example_inputs),
        description=f"{entry.description} ({shown})",
        options=resolved,
    )


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split a model spec ``"name?key=value&key=value"`` into the name and its raw options.

    The values stay strings: :func:`create` converts them. A leading ``"zoo:"`` is ignored.

    >>> from fxopt import zoo; zoo.parse_spec("resnet50?image=64&batch=2")
    ('resnet50', {'image': '64', 'batch': '2'})

    Raises:
        UserInputError: an empty name, an option without ``=``, or an option given twice.
    """
    text = spec.strip().removeprefix("zoo:")
    name, _, query = text.partition("?")
    name = name.strip()
    if not name:
        raise UserInputError(f"model spec '{spec}' has no model name")
    parsed: dict[str, str] = {}
    for item in query.split("&"):
        if not item.strip():
            continue  # tolerate "a=1&&b=2" and a trailing "&"
        key, sep, value = item.partition("=")
        key = unquote(key.strip())
        if not sep or not key:
            raise UserInputError(f"model spec '{spec}': expected key=value, got '{item}'")
        if key in parsed:
            raise UserInputError(f"model spec '{spec}': option '{key}' is given twice")
        parsed[key] = unquote(value.strip())
    return name, parsed
