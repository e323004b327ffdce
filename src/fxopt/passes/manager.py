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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import fx

from fxopt.errors import FxoptError, PassError, UserInputError
from fxopt.passes import kinds
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
    #: rewrite exact for finite inputs only → sites (fast_math; see Pass.inexact_rewrites)
    inexact: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "name": self.name,
            "round": self.round,
            "changed": self.changed,
            "time_ms": round(self.time_ms, 3),
            "stats": dict(self.stats),
            "skipped": [{"node": s.node, "reason": s.reason} for s in self.skipped],
        }
        if self.inexact:
            out["inexact"] = dict(self.inexact)
        return out


@dataclass
class PipelineResult:
    module: fx.GraphModule
    records: list[PassRecord]
    rounds: int
    #: pass name → the graph as text right after that pass last ran (see ``dump_after``).
    dumps: dict[str, str] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return any(r.changed for r in self.records)

    @property
    def inexact(self) -> dict[str, int]:
        """Rewrites applied that are exact for finite inputs only (fast_math) → sites."""
        found: dict[str, int] = {}
        for record in self.records:
            for rewrite, count in record.inexact.items():
                found[rewrite] = found.get(rewrite, 0) + count
        return found

    @property
    def applied(self) -> list[str]:
        """Names of the passes applied, in order (one entry per application)."""
        return [r.name for r in self.records]

    @property
    def skipped(self) -> tuple[Skip, ...]:
        """Every site a pass looked at and left alone, with its reason (``--explain``)."""
        return tuple(skip for r in self.records for skip in r.skipped)


class PassManager(Pass):
    """Run ``passes`` in order; repeat up to ``max_rounds`` times while anything changes.

    A pass is not run again while the graph is as it left it (see ``Pass.idempotent``).
    Each pass is checked for its declared ``requires`` invariants and timed; when it
    changed the graph, the graph is checked against ``invariants`` and the pass's
    ``verify`` is called. The boundaries are checked too: the input against ``requires``
    and ``invariants``, the result against ``ensures``. A graph captured by
    ``torch.export`` must stay one of ATen ops (the ``aten-level`` invariant is added for
    it): a pass that spells its rewrite at the torch level fails there, naming itself. Any
    failure raises :class:`PassError` naming the pass and the passes before it. With
    ``copy=True`` (default) the manager works on a copy, so the caller's graph is untouched
    even when a pass fails halfway; the graph is finished (an fx module recompiled) once at
    the end (``recompile=False`` leaves that to the caller, e.g. to time the passes alone).

    The passes all rewrite one kind of graph (:mod:`fxopt.passes.kinds`: fx modules, or the
    lowered Circle graph); the manager takes that kind from them. ``dump_after`` names
    passes whose output graph is kept as text in ``PipelineResult.dumps``.

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
        invariants: Sequence[str] | None = None,
        requires: Sequence[str] = (),
        ensures: Sequence[str] = (),
        copy: bool = True,
        recompile: bool = True,
        name: str = "pipeline",
        description: str | None = None,
        graph_kind: kinds.GraphKind | None = None,
        dump_after: Iterable[str] = (),
    ):
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise UserInputError(f"max_rounds must be an integer of at least 1, got {max_rounds!r}")
        self.passes: list[Pass] = [resolve(p) for p in passes]
        self.graph_kind = kinds.common(  # type: ignore[misc]  (a pipeline's own kind)
            [p.graph_kind for p in self.passes], default=graph_kind or kinds.FX
        )
        if graph_kind is not None and graph_kind is not self.graph_kind:
            raise ValueError(f"pipeline '{name}' is for {graph_kind.name} graphs, its passes not")
        self.max_rounds = max_rounds
        self.invariants = ("well-formed",) if invariants is None else tuple(invariants)
        self.requires = tuple(requires)  # type: ignore[misc]
        self.ensures = tuple(ensures)
        for invariant in (*self.invariants, *self.requires, *self.ensures):
            self.graph_kind.invariant(invariant)  # unknown names fail here, not mid-pipeline
        self.copy = copy
        self.recompile = recompile
        self.name = name  # type: ignore[misc]  (an instance's name: pipelines are many)
        if description is not None:
            self.description = description  # type: ignore[misc]
        self.dump_after = frozenset(dump_after)
        self.adds_parameters = any(p.adds_parameters for p in self.passes)  # type: ignore[misc]
        self.freezes_parameters = any(p.freezes_parameters for p in self.passes)

    def pass_names(self) -> list[str]:
        """Every pass name in the pipeline, nested pipelines opened, in order."""
        names = []
        for pass_ in self.passes:
            names.append(pass_.name)
            if isinstance(pass_, PassManager):
                names.extend(pass_.pass_names())
        return names

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        """Run in place as one pass of an outer pipeline (no copy, no recompile)."""
        return _summary(self._nested(gm, self.dump_after))

    def _nested(self, gm: fx.GraphModule, dump_after: frozenset[str]) -> PipelineResult:
        inner = PassManager(
            self.passes,
            max_rounds=self.max_rounds,
            invariants=self.invariants,
            requires=self.requires,
            ensures=self.ensures,
            copy=False,
            recompile=False,
            name=self.name,
            graph_kind=self.graph_kind,
            dump_after=dump_after,
        )
        return inner.run(gm)

    def run(self, gm: fx.GraphModule) -> PipelineResult:
        kind = self.graph_kind
        if not kind.accepts(gm):
            raise PassError(
                self.name,
                f"takes a {kind.name} graph ({kind.graph_type.__name__}), got {type(gm).__name__}",
            )
        if self.copy:
            gm = kind.copy(gm)
        invariants = self.invariants + tuple(
            name for name in kind.implied(gm) if name not in self.invariants
        )
        self._check_boundary(gm, "(input)", "given to", (*self.requires, *invariants))
        result = PipelineResult(gm, [], 0)
        with kind.scope(gm):
            self._run_rounds(result, invariants)
        self._check_boundary(gm, "(output)", "made by", self.ensures)
        if self.recompile:
            kind.finish(gm)
        return result

    def _check_boundary(self, gm: object, where: str, verb: str, names: Sequence[str]) -> None:
        try:
            self.graph_kind.check(gm, *names)
        except Exception as error:
            raise PassError(
                where, f"the graph {verb} pipeline '{self.name}' is wrong: {error}"
            ) from error

    def _run_rounds(self, result: PipelineResult, invariants: tuple[str, ...]) -> None:
        """Rounds until nothing changes (at most ``max_rounds``), skipping settled passes.

        Passes share the op table's answers and the alias analysis while no pass changes
        the graph (each reports ``changed`` honestly; see fxopt.ir.shared). A pass is
        skipped while no pass changed the graph since it last ran, if that run found
        nothing to do, or if the pass is idempotent (its verify() proves a second run on its
        own output finds nothing). Passes are deterministic functions of the graph and its
        module. ``version`` counts the changes so far. A pass also stays settled across a
        change by a pass it names in ``not_enabled_by``.
        """
        version = 0
        settled_at: dict[int, int] = {}  # index in self.passes -> version it settled at
        for round_index in range(self.max_rounds):
            result.rounds = round_index + 1
            changed = False
            for index, pass_ in enumerate(self.passes):
                if settled_at.get(index) == version:
                    continue
                record = self._run_one(pass_, result, round_index, invariants)
                if record.changed:
                    version += 1
                    for other, settled in settled_at.items():
                        if (
                            settled == version - 1
                            and pass_.name in self.passes[other].not_enabled_by
                        ):
                            settled_at[other] = version
                if pass_.idempotent or not record.changed:
                    settled_at[index] = version
                changed |= record.changed
            if not changed:
                break

    def _run_one(
        self,
        pass_: Pass,
        pipeline: PipelineResult,
        round_index: int,
        invariants: tuple[str, ...],
    ) -> PassRecord:
        gm = pipeline.module
        before = [r.name for r in pipeline.records]
        try:
            self.graph_kind.check(gm, *pass_.requires)
            start = time.perf_counter()
            if isinstance(pass_, PassManager):
                inner = pass_._nested(gm, self.dump_after)
                pipeline.dumps.update(inner.dumps)
                result = _summary(inner)
            else:
                result = pass_(gm)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if result.changed:
                # An unchanged graph still satisfies what it satisfied before the pass, and
                # its analysis found nothing to do: lint and postconditions hold as they were.
                self.graph_kind.check(gm, *invariants)
                returned = pass_.verify(gm)
                if returned is not None:
                    raise TypeError(
                        f"verify returned {returned!r}; a verify raises AssertionError when a "
                        "postcondition fails and returns None"
                    )
        except Exception as error:
            if isinstance(error, PassError):
                raise
            nodes = getattr(error, "nodes", None) or _node_names_in(error, gm)
            kind = (
                ""
                if isinstance(error, (FxoptError, AssertionError))
                else (f"{type(error).__name__}: ")
            )
            raise PassError(
                pass_.name, f"{kind}{error}", passes_before=before, nodes=nodes
            ) from error
        if pass_.name in self.dump_after:
            pipeline.dumps[pass_.name] = self.graph_kind.text(gm)
        record = PassRecord(
            pass_.name,
            round_index,
            result.changed,
            elapsed_ms,
            result.stats,
            result.skipped,
            pass_,
            dict(result.inexact),
        )
        pipeline.records.append(record)
        return record


def _summary(inner: PipelineResult) -> PassResult:
    """A nested pipeline's run as one pass's result."""
    stats = {"runs": len(inner.records), "changed": sum(r.changed for r in inner.records)}
    return PassResult(inner.changed, stats, inner.skipped)


def _node_names_in(error: BaseException, gm: fx.GraphModule) -> list[str]:
    """Names of graph nodes quoted in an error message (best effort, for context)."""
    if not isinstance(gm, fx.GraphModule):
        return []
    text = str(error)
    words = {w.strip("'\"`,.:()[]") for w in text.split()}
    return [n.name for n in gm.graph.nodes if n.name in words][:8]
