"""Graph kinds: what the PassManager needs to know about a type of graph to run passes on it.

fxopt rewrites two kinds of graph: ``torch.fx`` GraphModules (the optimize passes, the
Circle converter's ATen passes, the remat rewrites) and the lowered Circle graph (the
Circle-level steps). The manager's work around a pass is the same for both: copy the
input, check named invariants, time the pass, dump the graph as text, finish the graph at
the end. Only those verbs differ, and a :class:`GraphKind` holds them, so one manager
runs every rewrite in fxopt.

    >>> import torch
    >>> from fxopt.passes.kinds import FX
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> FX.check(gm, "well-formed")   # raises InvariantError when broken
    >>> "call_function[target=torch.nn.functional.relu]" in FX.text(gm)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

from torch import fx

from fxopt.errors import InvariantError
from fxopt.ir import ops, shared, spec
from fxopt.ir.copying import shared_copy


def _nothing(graph: object, *rest: object) -> None:
    return None


@dataclass(frozen=True)
class GraphKind:
    """The verbs the PassManager needs for one graph type.

    ``invariants`` maps a name to a :class:`fxopt.ir.spec.Invariant` whose
    ``find_problems`` takes a graph of this kind. ``implied`` lists invariants a given
    graph must keep through any pipeline (an ATen graph stays ATen).
    """

    name: str
    graph_type: type
    invariants: Mapping[str, spec.Invariant]
    copy: Callable[[object], object]
    text: Callable[[object], str]
    finish: Callable[[object], None] = _nothing
    scope: Callable[[object], AbstractContextManager] = field(default=lambda graph: nullcontext())
    invalidate: Callable[[object, tuple[str, ...]], None] = _nothing
    implied: Callable[[object], tuple[str, ...]] = field(default=lambda graph: ())

    def check(self, graph: object, *names: str) -> None:
        """Raise InvariantError for the first named invariant ``graph`` breaks."""
        for name in names:
            problems = self.invariant(name).find_problems(graph)
            if problems:
                raise InvariantError(name, problems)

    def invariant(self, name: str) -> spec.Invariant:
        """The invariant ``name``; KeyError lists the known ones."""
        try:
            return self.invariants[name]
        except KeyError:
            known = ", ".join(self.invariants)
            raise KeyError(
                f"unknown invariant '{name}' for {self.name} graphs; known: {known}"
            ) from None

    def accepts(self, graph: object) -> bool:
        return isinstance(graph, self.graph_type)

    def __repr__(self) -> str:
        return f"<graph kind {self.name}>"


def _fx_implied(gm: fx.GraphModule) -> tuple[str, ...]:
    # A graph captured by torch.export must stay one of ATen ops: a pass that spells its
    # rewrite at the torch level fails at the boundary, naming itself.
    return ("aten-level",) if ops.level_of(gm.graph) == "aten" else ()


FX = GraphKind(
    name="fx",
    graph_type=fx.GraphModule,
    invariants=spec.INVARIANTS,
    # The copy shares the weights: a pass replaces a tensor it changes, never writes it.
    copy=shared_copy,
    text=lambda gm: str(gm.graph),
    finish=lambda gm: gm.recompile(),  # codegen once, at the end: the slowest step
    scope=lambda gm: shared.scope(gm.graph),
    invalidate=lambda gm, keep: shared.invalidate(gm.graph, keep),
    implied=_fx_implied,
)


def common(kinds: Iterable[GraphKind], default: GraphKind = FX) -> GraphKind:
    """The one kind all of ``kinds`` share; ValueError when they mix kinds."""
    found = {kind.name: kind for kind in kinds}
    if len(found) > 1:
        raise ValueError(
            "a pipeline runs passes on one kind of graph, got passes for "
            + " and ".join(sorted(found))
        )
    return next(iter(found.values()), default)
