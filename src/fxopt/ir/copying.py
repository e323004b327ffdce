"""Deep copies of modules: fxopt never rewrites an object the caller still holds."""

from __future__ import annotations

import copy
import warnings

from torch import fx, nn


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy, silencing the pytree deprecation warning that copying the codegen of
    ``torch.export``'s GraphModules triggers (torch 2.13)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph that shares ``gm``'s submodules,
    parameters and buffers: for editing the graph alone (taking a guard out) without
    copying the weights, which for a large model is most of a deep copy's time and memory.

        >>> import torch
        >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> other = graph_copy(gm)
        >>> other.weight is gm.weight, other.graph is gm.graph
        (True, False)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out
