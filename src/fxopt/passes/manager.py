"""PassManager: runs passes in order, to a bounded fixed point, and never leaves a
half-rewritten graph behind.

    >>> import torch
    >>> from fxopt.passes import PassManager
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + torch.relu(x))
    >>> result = PassManager(["cse", "dce"]).run(gm)
    >>> [r.name for r in result.records if r.changed]
    ['cse']
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx

from fxopt.errors import FxoptError, PassError
from fxopt.ir import ops, shared, spec
from fxopt.ir.copying import clone_module
from fxopt.passes.base import Pass, PassResult, Skip
from fxopt.passes.registry import PassLike, resolve


@dataclass
class PassRecord:
    """One application of one pass."""

    name: str
    round: int
    changed: bool
    time_ms: float
    stats: dict = field(default_factory=dict)
    skipped: tuple[Skip, ...] = ()
    pass_: Pass | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "round": self.round,
            "changed": self.changed,
            "time_ms": round(self.time_ms, 3),
            "stats": dict(self.stats),
            "skipped": [{"node": s.node, "reason": s.reason} for s in self.skipped],
        }


@dataclass
class PipelineResult:
    module: fx.GraphModule
    records: list[PassRecord]
    rounds: int

    @property
    def changed(self) -> bool:
        return any(r.changed for r in self.records)

    @property
    def applied(self) -> list[str]:
        """Names of the passes applied, in order (one entry per application)."""
        return [r.name for r in self.records]


class PassManager(Pass):
    """Run ``passes`` in order; repeat up to ``max_rounds`` times while anything changes.

    A pass is not run again while the graph is as it left it (see ``Pass.idempotent``).
    Each pass is checked for its declared ``requires`` invariants and timed; when it
    changed the graph, the graph is linted (and any extra ``invariants`` checked) and the
    pass's ``verify`` is called. The input is checked against ``invariants`` once, first.
    A graph captured by ``torch.export`` must stay one of ATen ops (the ``aten-level``
    invariant is added for it): a pass that spells its rewrite at the torch level fails
    there, naming itself. Any failure raises :class:`PassError` naming the pass and the
    passes before it. With ``copy=True`` (default) the manager works on a deep copy, so
    the caller's module is untouched even when a pass fails halfway; the module is
    recompiled once at the end (``recompile=False`` leaves that to the caller, e.g. to
    time the passes alone).

    A PassManager is itself a pass: a pipeline can hold another (``name`` names it in
    records and errors), which then runs in place on the outer pipeline's graph.

        >>> import torch
        >>> from fxopt.passes import PassManager
        >>> cleanup = PassManager(["cse", "dce"], name="cleanup")
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) + torch.relu(x))
        >>> [r.name for r in PassManager([cleanup]).run(gm).records]
        ['cleanup']
    """

    description = "a pipeline of passes"

    def __init__(
        self,
        passes: Sequence[PassLike],
        *,
        max_rounds: int = 1,
        invariants: Sequence[str] = ("well-formed",),
        copy: bool = True,
        recompile: bool = True,
        name: str = "pipeline",
    ):
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
        self.passes: list[Pass] = [resolve(p) for p in passes]
        self.max_rounds = max_rounds
        self.invariants = tuple(invariants)
        for invariant in self.invariants:
            spec.get(invariant)  # unknown names fail here, not mid-pipeline
        self.copy = copy
        self.recompile = recompile
        self.name = name  # type: ignore[misc]  (an instance's name: pipelines are many)
        self.adds_parameters = any(p.adds_parameters for p in self.passes)  # type: ignore[misc]
        self.freezes_parameters = any(p.freezes_parameters for p in self.passes)

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        """Run in place as one pass of an outer pipeline (no copy, no recompile)."""
        inner = PassManager(
            self.passes,
            max_rounds=self.max_rounds,
            invariants=self.invariants,
            copy=False,
            recompile=False,
            name=self.name,
        ).run(gm)
        stats = {"runs": len(inner.records), "changed": sum(r.changed for r in inner.records)}
        skipped = tuple(skip for r in inner.records for skip in r.skipped)
        return PassResult(inner.changed, stats, skipped)

    def run(self, gm: fx.GraphModule) -> PipelineResult:
        if self.copy:
            gm = clone_module(gm)
        records: list[PassRecord] = []
        rounds = 0
        invariants = self.invariants
        if ops.level_of(gm.graph) == "aten" and "aten-level" not in invariants:
            invariants += ("aten-level",)
        try:
            spec.check(gm, *invariants)
        except Exception as error:
            raise PassError(
                "(input)", f"the graph given to the pipeline is broken: {error}"
            ) from error
        # Passes share the op table's answers and the alias analysis while no pass changes
        # the graph (each reports `changed` honestly; see fxopt.ir.shared).
        # A pass is skipped while no pass changed the graph since it last ran, if that run
        # found nothing to do, or if the pass is idempotent (its verify() proves a second
        # run on its own output finds nothing). Passes are deterministic functions of the
        # graph and its module. `version` counts the changes so far. A pass also stays
        # settled across a change by a pass it names in `not_enabled_by`.
        version = 0
        settled_at: dict[int, int] = {}  # index in self.passes -> version it settled at
        with shared.scope(gm.graph):
            for round_index in range(self.max_rounds):
                rounds = round_index + 1
                changed = False
                for index, pass_ in enumerate(self.passes):
                    if settled_at.get(index) == version:
                        continue
                    before = [r.name for r in records]
                    record = self._run_one(pass_, gm, round_index, before, invariants)
                    records.append(record)
                    if record.changed:
                        version += 1
                        # Passes this change cannot give work stay settled across it.
                        for other, settled in settled_at.items():
                            if settled == version - 1 and (
                                pass_.name in self.passes[other].not_enabled_by
                            ):
                                settled_at[other] = version
                    if pass_.idempotent or not record.changed:
                        settled_at[index] = version
                    changed |= record.changed
                if not changed:
                    break
        if self.recompile:  # once, at the end: codegen is the slowest step on big graphs
            gm.recompile()
        return PipelineResult(gm, records, rounds)

    def _run_one(
        self,
        pass_: Pass,
        gm: fx.GraphModule,
        round_index: int,
        before: list[str],
        invariants: tuple[str, ...],
    ) -> PassRecord:
        try:
            spec.check(gm, *pass_.requires)
            start = time.perf_counter()
            result = pass_(gm)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if result.changed:
                # An unchanged graph still satisfies what it satisfied before the pass, and
                # its analysis found nothing to do: lint and postconditions hold as they were.
                spec.check(gm, *invariants)
                if pass_.verify(gm) is False:  # a verify written to return a bool
                    raise AssertionError("its verify() returned False")
        except Exception as error:
            nodes = getattr(error, "nodes", None) or _node_names_in(error, gm)
            if isinstance(error, PassError):
                raise
            kind = (
                ""
                if isinstance(error, (FxoptError, AssertionError))
                else (f"{type(error).__name__}: ")
            )
            raise PassError(
                pass_.name, f"{kind}{error}", passes_before=before, nodes=nodes
            ) from error
        return PassRecord(
            pass_.name,
            round_index,
            result.changed,
            elapsed_ms,
            result.stats,
            result.skipped,
            pass_,
        )


def _node_names_in(error: BaseException, gm: fx.GraphModule) -> list[str]:
    """Names of graph nodes quoted in an error message (best effort, for context)."""
    text = str(error)
    words = {w.strip("'\"`,.:()[]") for w in text.split()}
    return [n.name for n in gm.graph.nodes if n.name in words][:8]
