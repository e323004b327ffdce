"""Analyses shared by the passes of one pipeline run while the graph stays unchanged.

Every pass needs the op table's answer for every node and the alias analysis; built per
pass, they were most of what a pipeline cost on a large graph (seven alias analyses for
one ``speed`` run on 100k nodes). torch.fx cannot tell us when a graph changed (setting
``node.args`` fires no hook), so sharing is scoped: inside :func:`scope` the
:class:`~fxopt.passes.PassManager` vouches for the graph, and a pass that reports
``changed`` drops what was shared (:func:`invalidate`, called by ``Pass.__call__``).
Outside a scope, :func:`get` computes afresh on every call: a caller who edits the graph
by hand between two passes never sees a stale answer.

    >>> import torch
    >>> from fxopt.ir import shared
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> with shared.scope(gm.graph):
    ...     shared.get(gm, "nodes", lambda g: len(g.graph.nodes)) is shared.get(
    ...         gm, "nodes", lambda g: object()
    ...     )
    True
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from torch import fx

T = TypeVar("T")

# graph -> {analysis key: result}, only for graphs inside a scope.
_SCOPED: weakref.WeakKeyDictionary[fx.Graph, dict[str, object]] = weakref.WeakKeyDictionary()
# graph -> memo that outlives invalidation: its entries check their own validity.
_MEMOS: weakref.WeakKeyDictionary[fx.Graph, dict[str, dict]] = weakref.WeakKeyDictionary()


@contextmanager
def scope(graph: fx.Graph) -> Iterator[None]:
    """Share analyses of ``graph`` until the scope ends (scopes nest)."""
    outer = _SCOPED.get(graph)
    _SCOPED[graph] = {}
    if outer is None:
        _MEMOS[graph] = {}
    try:
        yield
    finally:
        if outer is None:
            _SCOPED.pop(graph, None)
            _MEMOS.pop(graph, None)
        else:
            _SCOPED[graph] = {}  # the inner scope may have changed the graph


def get(gm: fx.GraphModule, key: str, compute: Callable[[fx.GraphModule], T]) -> T:
    """``compute(gm)``, shared with other callers in the same scope until invalidated."""
    results = _SCOPED.get(gm.graph)
    if results is None:
        return compute(gm)
    if key not in results:
        results[key] = compute(gm)
    return results[key]  # type: ignore[return-value]


def peek(gm: fx.GraphModule, key: str) -> object | None:
    """What is shared under ``key`` now, or None: never computes (for a pass that
    updates an analysis it may keep, but need not build one to do so)."""
    results = _SCOPED.get(gm.graph)
    return None if results is None else results.get(key)


def invalidate(graph: fx.Graph, keep: Iterable[str] = ()) -> None:
    """Forget what was shared about ``graph``: it has changed.

    ``keep`` names results that the change left sound (e.g. the alias analysis after dead
    nodes were erased: see ``PassResult.keeps``).
    """
    results = _SCOPED.get(graph)
    if results is not None:
        kept = {key: results[key] for key in keep if key in results}
        results.clear()
        results.update(kept)


def memo(graph: fx.Graph, key: str) -> dict | None:
    """A dict kept for the whole scope, even across changes (None outside a scope).

    For facts about single nodes that can check themselves, e.g. "this node's op, as long
    as its target and arguments are the very objects they were".
    """
    memos = _MEMOS.get(graph)
    if memos is None:
        return None
    return memos.setdefault(key, {})
