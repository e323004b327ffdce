"""The pass contract. Read this first.

A pass is three steps, kept apart so each can be tested and reported on its own:

* ``analyze(gm) -> Plan``: read-only. Finds every site the pass would rewrite and, for
  every site it will *not* rewrite, the reason (shown by ``fxopt optimize --explain``).
* ``transform(gm, plan) -> PassResult``: applies the plan and never searches again. It
  returns ``changed`` honestly (False when the plan was empty) and a few counters.
* ``verify(gm)``: checks the pass's own postconditions and raises when they fail.

The :class:`~fxopt.passes.PassManager` owns everything around that: timing, ``lint()``,
invariant checks, ``recompile()``, and turning any failure into a :class:`PassError` that
names the pass. A pass does not lint or recompile (a pass that must *run* the module
mid-pipeline calls ``gm.recompile()`` itself).

    >>> import torch
    >>> from fxopt.passes import Pass, PassResult, Plan
    >>> class CountNodes(Pass[Plan]):
    ...     name = "count-nodes"
    ...     description = "count nodes; rewrites nothing"
    ...     def analyze(self, gm):
    ...         return Plan()
    ...     def transform(self, gm, plan):
    ...         return PassResult(changed=False, stats={"nodes": len(gm.graph.nodes)})
    >>> CountNodes()(torch.fx.symbolic_trace(torch.nn.ReLU())).stats
    {'nodes': 3}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from torch import fx

from fxopt.passes.kinds import FX, GraphKind


@dataclass(frozen=True)
class Skip:
    """A site a pass looked at and left alone, with the reason."""

    node: str
    reason: str

    def __str__(self) -> str:
        return f"{self.node}: {self.reason}"


@dataclass(frozen=True)
class Plan:
    """What a pass will do. Subclasses add their sites; ``skipped`` is shared."""

    skipped: tuple[Skip, ...] = ()


@dataclass
class PassResult:
    """What a pass did: ``changed`` is honest, ``stats`` are small counters for reports.

    ``keeps`` names the shared analyses (fxopt.ir.shared keys) still sound after the
    change, because the change cannot affect them or the pass updated them; the next pass
    then need not rebuild them. Claim one only when a fresh analysis could be at most less
    conservative, never different in what it allows.
    """

    changed: bool
    stats: dict[str, int | float | str] = field(default_factory=dict)
    skipped: tuple[Skip, ...] = ()
    keeps: tuple[str, ...] = ()
    #: The rewrites applied that are exact only for finite inputs (one of the pass's
    #: ``inexact_rewrites``, which it applies only when built with ``fast_math=True``) →
    #: how many sites; reports list them.
    inexact: dict[str, int] = field(default_factory=dict)


PlanT = TypeVar("PlanT", bound=Plan)


class Pass(Generic[PlanT]):
    """Base class of every fxopt pass. Subclasses set ``name`` and ``description``."""

    #: Stable kebab-case id used by the CLI, the registry, logs and reports.
    name: ClassVar[str] = ""
    #: One line for ``fxopt passes``.
    description: ClassVar[str] = ""
    #: Invariants (fxopt.ir.spec names) the input graph must satisfy.
    requires: ClassVar[tuple[str, ...]] = ()
    #: True when the pass may create parameters (verification then allows new ones).
    adds_parameters: ClassVar[bool] = False
    #: True when the pass treats parameters as constants (folds them into new values):
    #: inference only. A model in training mode is never given such a pass.
    freezes_parameters: bool = False
    #: True when running the pass on its own output changes nothing; its ``verify``
    #: should check exactly that. The PassManager then skips it until another pass changes
    #: the graph, instead of re-running its analysis just to find nothing.
    idempotent: ClassVar[bool] = False
    #: Names of passes whose changes never give this pass new work (cse after dce: erasing
    #: unused pure nodes creates no new duplicates). The PassManager then does not rerun
    #: this pass after a change made by one of them alone.
    not_enabled_by: ClassVar[tuple[str, ...]] = ()
    #: The kind of graph the pass rewrites (fx GraphModules unless it says otherwise).
    graph_kind: ClassVar[GraphKind] = FX
    #: Rewrites the pass makes only when built with ``fast_math=True``, because they are
    #: exact for finite inputs alone (``x + 0 → x`` turns -0.0 into +0.0; a fused ReLU
    #: maps NaN to 0): rewrite → why it is not exact. A pass with any takes ``fast_math``
    #: as a constructor argument; by default it leaves those sites, with that reason.
    inexact_rewrites: ClassVar[dict[str, str]] = {}

    def analyze(self, gm: fx.GraphModule) -> PlanT:
        raise NotImplementedError(f"{type(self).__name__}.analyze")

    def transform(self, gm: fx.GraphModule, plan: PlanT) -> PassResult:
        raise NotImplementedError(f"{type(self).__name__}.transform")

    def verify(self, gm: fx.GraphModule) -> None:
        """Check this pass's postconditions on ``gm``; raise AssertionError if broken."""

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        """Analyze and transform ``gm`` in place (no lint, no recompile: see PassManager)."""
        plan = self.analyze(gm)
        result = self.transform(gm, plan)
        if not isinstance(result, PassResult):
            graph = isinstance(result, (fx.GraphModule, fx.Graph))
            what = "its graph" if graph else f"a {type(result).__name__}"
            raise TypeError(
                f"{self.name or type(self).__name__}.transform returned {what}; a pass "
                "changes the graph it is given in place and returns a PassResult(changed, stats)"
            )
        if result.changed:
            self.graph_kind.invalidate(gm, result.keeps)
        if not result.skipped:
            result.skipped = tuple(getattr(plan, "skipped", ()))
        return result

    def __repr__(self) -> str:
        return f"<pass {self.name}>"
