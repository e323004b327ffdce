"""Attributes of a GraphModule by dotted path: read them, and find free names for new ones.

>>> import torch
>>> from fxopt.ir import attributes
>>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 3)))
>>> tuple(attributes.get(gm, "0.weight").shape)
(3, 2)
>>> attributes.free_name(gm, "0")
'0_1'
"""

from __future__ import annotations

import torch
from torch import fx

_MISSING = object()


def get(root: torch.nn.Module, target: str, default: object = _MISSING) -> object:
    """``root.<target>`` for a dotted ``target``; ``default`` (when given) if missing."""
    value: object = root
    for part in target.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise AttributeError(f"{type(root).__name__} has no attribute '{target}'")
            return default
    return value


def constant(root: torch.nn.Module, value: object) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads, or None for anything else."""
    if not isinstance(value, fx.Node) or value.op != "get_attr":
        return None
    found = get(root, str(value.target), None)
    return found if isinstance(found, torch.Tensor) else None


def free_name(root: torch.nn.Module, base: str, *, numbered: bool = False) -> str:
    """A name no attribute of ``root`` has: ``base``, else ``base_1``, ``base_2``...
    (``base_0``, ``base_1``... with ``numbered``)."""
    index = 0 if numbered else None
    while True:
        name = base if index is None else f"{base}_{index}"
        if not hasattr(root, name):
            return name
        index = 1 if index is None else index + 1
