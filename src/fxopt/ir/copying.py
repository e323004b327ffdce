"""Deep copies of modules: fxopt never rewrites an object the caller still holds."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

from torch import fx, nn

from fxopt.ir import ops


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy, silencing the pytree deprecation warning that copying the codegen of
    ``torch.export``'s GraphModules triggers (torch 2.13).

    Every module holds a dozen hook tables, nearly always empty, which ``deepcopy``
    rebuilds one by one through ``__reduce_ex__``: they go into its memo as new empty
    tables up front (what ``deepcopy`` would make of them; a table shared by two modules
    stays shared). A third of the copy's time on a 100k-node model.

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> copied = clone_module(model)
        >>> copied[0].weight is model[0].weight, copied[0]._forward_hooks is model[0]._forward_hooks
        (False, False)
    """
    memo: dict[int, object] = {}
    for submodule in module.modules():
        for value in submodule.__dict__.values():
            if type(value) in _TABLES and not value and not getattr(value, "__dict__", None):
                memo[id(value)] = type(value)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module, memo)


#: Container types whose empty instances clone_module makes anew: plain, without state.
_TABLES = (dict, OrderedDict, set, list)


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


def may_change_state(module: nn.Module) -> bool:
    """Whether calling ``module`` could change it: any module but a GraphModule whose
    every call is a known op that writes nothing and keeps no state (by
    :mod:`fxopt.ir.ops`; a module with hooks is not known); the user's own modules and
    in-place ops could.

        >>> import torch
        >>> may_change_state(fx.symbolic_trace(torch.nn.Linear(2, 2)))
        False
        >>> may_change_state(fx.symbolic_trace(torch.nn.Sequential(torch.nn.BatchNorm1d(2))))
        True
    """
    if not isinstance(module, fx.GraphModule):
        return True
    return ops.any_call(module, lambda op: not op.known or op.stateful or op.inplace or op.random)


def for_running(module: nn.Module) -> nn.Module:
    """``module`` itself when no call can change it (:func:`may_change_state`), else a
    deep copy: what fxopt calls to check or time a module without changing the object it
    keeps or hands back. On a 100k-node model a deep copy takes about 15 s (the modules'
    dictionaries and the generated code), and verification calls several models."""
    return clone_module(module) if may_change_state(module) else module
