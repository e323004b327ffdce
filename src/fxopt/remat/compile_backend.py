"""Remat inside ``torch.compile``: a backend whose partitioner plans and rewrites the joint
graph AOTAutograd hands it, then splits it into the forward and backward graphs.

    >>> import torch
    >>> from fxopt.remat import backend
    >>> model = torch.nn.Sequential(*[m for _ in range(4)
    ...                               for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())])
    >>> plans = []
    >>> compiled = torch.compile(model, backend=backend(0.9, plans=plans, profile_runs=1),
    ...                          dynamic=False)
    >>> compiled(torch.randn(64, 32)).sum().backward()
    >>> plans[0].peak <= plans[0].budget_bytes, len(plans[0].recompute) > 0
    (True, True)

The partitioner (:class:`Partition`) runs ``compile_step``'s stages on the joint graph
AOTAutograd hands it (tag phases, RNG snapshots, profile, plan, recompute; each rewrite a
pass run by the PassManager), then ``default_partition``. Why it sets buffer writes aside,
how the graphs of one compile share a budget, and how DDP's pieces are planned together:
docs/remat_design.md.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._subclasses.fake_tensor import is_fake

from fxopt.errors import UnsupportedOpError, UserInputError
from fxopt.ir import ops
from fxopt.passes.manager import PassManager
from fxopt.remat.capture import prepare, tag_phases
from fxopt.remat.chain import choose, options, process_peak
from fxopt.remat.dead_draws import RemoveDeadDraws
from fxopt.remat.input_writes import DetachInputWrites, InputWrites, RestoreInputWrites
from fxopt.remat.joint_cse import JointCSE
from fxopt.remat.planners import PLANNERS, BudgetError, RematPlan, budget_bytes, make_plan, plan
from fxopt.remat.profile import profile_within
from fxopt.remat.rewrite import recompute
from fxopt.remat.simulate import Simulation, simulate
from fxopt.remat.table import Table
from fxopt.remat.tags import BACKWARD, FORWARD, phase

#: What compiles the partitioned forward and backward graphs.
COMPILERS = ("eager", "inductor")


def backend(
    memory_budget: float | int = 0.5,
    planner: str = "greedy",
    *,
    compiler: str = "eager",
    strict: bool = False,
    profile_runs: int = 2,
    time_limit_s: float = 20.0,
    plans: list | None = None,
    blocks: int = 0,
) -> Callable:
    """A ``torch.compile`` backend that rewrites the training graph to fit the budget.

    ``memory_budget``: a fraction in (0, 1] of each graph's baseline peak activation
    memory, or an int number of bytes. ``compiler``: one of :data:`COMPILERS`. ``strict``:
    raise :class:`~fxopt.remat.BudgetError` when the budget cannot be met (default: warn
    once and use the best plan). Pass a list as ``plans`` to collect the RematPlan of every
    graph compiled. ``blocks``: the graphs are this many consecutive blocks of one model,
    each compiled on its own (:func:`~fxopt.remat.compile_blocks` sets it): they share
    one budget per process and are planned together, like DDP's pieces (:class:`GraphChain`);
    -1 when how many is not known in advance (the chain is complete when its first graph
    runs again, on the next step).
    """
    if planner not in PLANNERS:
        raise UserInputError(f"unknown planner '{planner}'; valid planners: {', '.join(PLANNERS)}")
    if compiler not in COMPILERS:
        raise UserInputError(
            f"unknown compiler '{compiler}'; valid compilers: {', '.join(COMPILERS)}"
        )
    budget_bytes(memory_budget, 1)  # range check before any compile
    partition = Partition(
        memory_budget,
        planner,
        strict=strict,
        profile_runs=profile_runs,
        time_limit_s=time_limit_s,
        plans=plans,
        blocks=bool(blocks),
        expected_blocks=blocks if blocks > 0 else None,
    )
    if compiler == "inductor":
        partition.fused_pointwise = True
        return _PieceAware(_inductor(partition), partition)
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    # aot_eager's compiler: the boxed calling convention lets each graph free an input
    # after its last use (a plain GraphModule keeps every saved value to the end).
    inner = aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )
    return _PieceAware(inner, partition)


class _PieceAware:
    """The backend, telling the partition whether the graph it is about to plan is a piece
    DDPOptimizer cut or a block of ``compile_blocks`` (docs/remat_design.md, "Pieces of a
    DDP graph")."""

    def __init__(self, inner: Callable, partition: Partition):
        self._inner, self._partition = inner, partition

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence, **kwargs):
        partition = self._partition
        reason = getattr(gm, "compile_subgraph_reason", None)
        ddp_piece = "DDPOptimizer" in str(getattr(reason, "reason", ""))
        partition.piece = partition.blocks or ddp_piece
        # Dynamo's example inputs are the real ones (the parameters themselves): the
        # profile runs on them, not on random copies (a copy of every weight).
        partition.real_inputs = list(example_inputs)
        try:
            return self._call(gm, example_inputs, **kwargs)
        finally:
            partition.real_inputs = None

    def _call(self, gm: fx.GraphModule, example_inputs: Sequence, **kwargs):
        partition = self._partition
        if not partition.piece:
            return self._inner(gm, example_inputs, **kwargs)
        key = _compile_key(partition.blocks)
        chain = partition.chains.get(key)
        if chain is None:
            until_repeat = partition.blocks and partition.expected_blocks is None
            chain = partition.chains[key] = GraphChain(
                self, partition.expected_blocks, until_repeat=until_repeat
            )
        member = ChainMember(gm, list(example_inputs), kwargs)
        partition.member = member
        try:
            compiled = self._inner(gm, example_inputs, **kwargs)
        finally:
            partition.member = None
        if member.table is None:  # nothing planned (a graph without a backward)
            return compiled
        member.runner = _Swappable(compiled, chain)
        chain.members.append(member)
        return member.runner

    def recompile(self, member: ChainMember, forced: RematPlan) -> Callable:
        """``member``'s graph compiled again, with ``forced`` as its plan."""
        self._partition.forced = forced
        try:
            return self._inner(member.gm, member.example_inputs, **member.kwargs)
        finally:
            self._partition.forced = None

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


@dataclass
class Partition:
    """AOTAutograd's ``partition_fn``: plan, rewrite, then ``default_partition``."""

    memory_budget: float | int
    planner: str
    strict: bool = False
    profile_runs: int = 2
    time_limit_s: float = 20.0
    plans: list | None = None
    #: Cost a pointwise op's recompute as a fusing compiler runs it (Inductor).
    fused_pointwise: bool = False
    #: Dynamo compile -> what its graphs so far hold (see ProcessBudget).
    ledgers: dict = field(default_factory=dict, repr=False)
    #: The graph being planned is a piece of a DDP graph (set by the backend per graph).
    piece: bool = False
    #: Every graph is a block of one compile_blocks call (see ``backend``), and how many
    #: (None: not known; the chain is complete when its first graph runs again).
    blocks: bool = False
    expected_blocks: int | None = None
    #: Chain key -> the graphs of one chain (see GraphChain), the member being compiled, and
    #: the plan a recompile applies instead of planning.
    chains: dict = field(default_factory=dict, repr=False)
    member: ChainMember | None = None
    forced: RematPlan | None = None
    #: The real inputs of the graph being compiled (set by the backend for the call).
    real_inputs: list | None = field(default=None, repr=False)

    def __call__(
        self, joint: fx.GraphModule, joint_inputs: Sequence, **kwargs
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import default_partition
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        kwargs.pop("compiler", None)  # Inductor names itself; default_partition takes no such key
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        _eliminate_common_subexpressions(joint)
        outs = list(joint.graph.output_node().args[0])
        writes = InputWrites()
        _run(joint, DetachInputWrites(writes), recompile=False)  # tag_phases recompiles
        tag_phases(joint, [*outs[:num_fwd_outputs], *writes.sources])
        for node in joint.graph.nodes:
            if "partitioner_tag" in node.meta and phase(node) in (FORWARD, BACKWARD):
                node.meta["partitioner_tag"] = f"is_{phase(node)}"
        prepare(joint)  # snapshots are forward nodes: default_partition saves used ones
        if self.forced is not None:  # a chain's joint choice, on the same graph traced again
            recompute(joint, _partitionable(joint, self.forced.recompute))
            _run(joint, RestoreInputWrites(writes))
            return _without_dead_draws(*default_partition(joint, joint_inputs, **kwargs))
        # The hook runs under AOTAutograd's fake mode; the profile needs real tensors.
        with unset_fake_temporarily():
            inputs = _profile_inputs(joint, self.real_inputs)
            table = profile_within(
                joint,
                inputs,
                self.memory_budget,
                runs=self.profile_runs,
                excluded_outputs=range(num_fwd_outputs, len(outs)),
            )
        floor = None
        if self.fused_pointwise:
            table = fused_pointwise_costs(table, joint)
            floor = fused_floor(table, joint)
        chosen = self.plan(table, floor)
        recompute(joint, _partitionable(joint, chosen.recompute))
        _run(joint, RestoreInputWrites(writes))
        if self.member is not None:
            self.member.table, self.member.plan = table, chosen
        if self.plans is not None:
            if self.member is not None:
                self.member.plans, self.member.plan_index = self.plans, len(self.plans)
            self.plans.append(chosen)
        return _without_dead_draws(*default_partition(joint, joint_inputs, **kwargs))

    def plan(self, table: Table, floor: Simulation | None = None) -> RematPlan:
        """The plan for this graph's share of the budget; the best one reached (and a
        warning) when none fits, unless ``strict``. Under a fusing compiler ``floor``
        (:func:`fused_floor`) is the plan of a graph planned alone when it fits."""
        key = _compile_key(self.blocks)
        ledger = ProcessBudget(self.memory_budget)
        if key is not None:
            ledger = self.ledgers.setdefault(key, ledger)
        baseline = simulate(table)
        limit = ledger.limit(baseline)
        chosen = None
        if self.piece:  # plan what it saves; keep that unless it raises the piece's peak
            chosen = self._fitted(*with_later_pieces(table, limit, baseline), ledger, table)
            if chosen.peak > baseline.peak:
                chosen = None
        if chosen is None and floor is not None and floor.peak <= limit:
            recomputed = frozenset(floor.recomputed)
            chosen = make_plan(table, self.planner, limit, recomputed, floor, fused_floor=True)
        if chosen is None:
            chosen = self._fitted(table, limit, ledger, table)
        ledger.add(baseline, chosen)
        return chosen

    def _fitted(self, planned: Table, limit: int, ledger: ProcessBudget, table: Table) -> RematPlan:
        """The plan ``planned`` fits into ``limit`` (or the best reached, with a warning,
        unless ``strict``), with the figures of ``table``, the graph itself."""
        try:
            found = plan(planned, limit, self.planner, time_limit_s=self.time_limit_s)
            if planned is table:
                return found
            recomputed, budget_met = [table.index(name) for name in found.recompute], True
        except BudgetError as error:
            if self.piece:  # a chain's graph: the plan of the whole chain decides (GraphChain)
                reached = error.reached or simulate(planned)
                recomputed, budget_met = reached.recomputed, False
                return make_plan(
                    table,
                    self.planner,
                    limit,
                    frozenset(recomputed),
                    simulate(table, recomputed),
                    budget_met=budget_met,
                )
            if self.strict:
                raise
            warnings.warn(
                f"fxopt remat: {ledger.describe()}{error} -- using the best plan found, "
                f"{error.best_fraction:.2f} of the baseline (strict=True raises instead)",
                stacklevel=2,
            )
            recomputed, budget_met = (error.reached or simulate(planned)).recomputed, False
        sim = simulate(table, recomputed)
        return make_plan(
            table, self.planner, limit, frozenset(recomputed), sim, budget_met=budget_met
        )


@dataclass
class ChainMember:
    """One graph of a chain: what compiled it, what its profile and plan were, and the
    runner the compiled code sits in."""

    gm: fx.GraphModule
    example_inputs: list
    kwargs: dict
    table: Table | None = None
    plan: RematPlan | None = None
    runner: _Swappable | None = None
    plans: list | None = None  # the caller's list of plans, and this graph's place in it
    plan_index: int | None = None


@dataclass
class GraphChain:
    """The graphs of one chain (DDPOptimizer's pieces of one compile, or one round of
    ``compile_blocks``' block compiles), planned together once all are compiled.

    Each graph is first compiled with a plan of its own (see :class:`ProcessBudget`): it
    runs with that plan while the chain is incomplete. At the first call of any of them
    once the chain is complete (DDP: the first step, as DDPOptimizer compiles every piece
    before running any; ``compile_blocks``: the second step, once every block has run),
    :mod:`fxopt.remat.chain` chooses one plan per graph against the process peak, and each
    graph whose plan changed is compiled again with it and swapped into its runner. A
    failure there keeps the graphs' own plans, with a warning.
    """

    backend: _PieceAware
    #: Graphs in a complete chain. None: DDP's pieces are complete when one first runs;
    #: blocks (``until_repeat``) when the first graph runs again, on the next step.
    expected: int | None = None
    until_repeat: bool = False
    members: list[ChainMember] = field(default_factory=list)
    done: bool = False

    def ready(self, runner: _Swappable | None = None) -> bool:
        """Whether to plan the chain before ``runner``'s call."""
        if self.done:
            return False
        if self.expected is not None:
            return len(self.members) >= self.expected
        if self.until_repeat:
            first = self.members[0].runner if self.members else None
            return first is not None and runner is first and first.calls > 1
        return True

    def plan_together(self) -> None:
        self.done = True
        partition = self.backend._partition
        members = self.members
        per_graph = [options(m.table, partition.planner) for m in members]
        baseline = process_peak([graph[0] for graph in per_graph])
        budget = budget_bytes(partition.memory_budget, baseline)
        choice = choose(per_graph, budget)
        if not choice.fits:
            message = (
                f"fxopt remat: the {len(members)} graphs of this chain (DDP pieces or "
                f"blocks) reach {choice.peak / max(1, baseline):.2f} of their baseline "
                f"process peak at best, over the budget of {budget / max(1, baseline):.2f}"
            )
            if partition.strict:
                raise BudgetError(
                    message,
                    best_fraction=choice.peak / max(1, baseline),
                    floor_fraction=choice.peak / max(1, baseline),
                )
            warnings.warn(
                f"{message} -- using the lowest (strict=True raises instead)", stacklevel=3
            )
        details = {
            "chain_graphs": len(members),
            "chain_peak": choice.peak,
            "chain_baseline_peak": baseline,
            "chain_budget": budget,
        }
        for member, graph, pick in zip(members, per_graph, choice.picks, strict=True):
            recomputed = graph[pick].recompute
            sim = simulate(member.table, recomputed)
            joint = make_plan(
                member.table,
                partition.planner,
                budget,
                recomputed,
                sim,
                budget_met=choice.fits,
                **details,
            )
            if set(joint.recompute) != set(member.plan.recompute):
                try:
                    member.runner.fn = self.backend.recompile(member, joint)
                except Exception as error:  # the graphs' own plans still compute the same
                    warnings.warn(
                        f"fxopt remat: planning the chain's graphs together failed "
                        f"({type(error).__name__}: {error}); each keeps its own plan",
                        stacklevel=3,
                    )
                    return
            member.plan = joint
            if member.plans is not None:
                member.plans[member.plan_index] = joint


class _Swappable:
    """A chain member's compiled code, behind a runner whose code the chain may replace
    (before the member's first call once the chain is complete)."""

    def __init__(self, fn: Callable, chain: GraphChain):
        self.fn, self.chain = fn, chain
        self.calls = 0  # real calls so far (DDPOptimizer's fake-tensor calls not counted)
        # Dynamo and DDPOptimizer call it as they would call fn itself.
        self._boxed_call = getattr(fn, "_boxed_call", False)

    def __call__(self, *args):
        if not _fake_call(args):
            self.calls += 1
            if self.chain.ready(self):
                self.chain.plan_together()
        return self.fn(*args)


def _fake_call(args: Sequence) -> bool:
    """Whether a call runs on fake tensors (DDPOptimizer runs each compiled piece so, to
    get the next piece's inputs, while it compiles the chain)."""
    from torch._subclasses.fake_tensor import FakeTensor

    flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
    return any(isinstance(a, FakeTensor) for a in flat)


@dataclass
class ProcessBudget:
    """One process's budget, shared by the graphs of one Dynamo compile (DDPOptimizer's
    pieces), which run forward in compile order and backward in reverse.

    While graph *k* runs, what graphs 1..k-1 saved is alive too, so the process peaks at
    max over k of (saved by the graphs before k + graph k's own peak). The budget is a
    fraction of that peak for the baseline graphs so far (or the bytes given); graph *k*'s
    own peak may use what of it the planned graphs before it left.

        >>> from types import SimpleNamespace as S
        >>> ledger = ProcessBudget(0.5)
        >>> ledger.limit(S(peak=100, saved=80))  # the first graph: half its peak
        50
        >>> ledger.add(S(peak=100, saved=80), S(saved=70))  # it kept more than half
        >>> ledger.limit(S(peak=100, saved=80))  # the next must make up for it
        20
    """

    memory_budget: float | int
    graphs: int = 0
    baseline_peak: int = 0  # the baseline process peak over the graphs so far
    baseline_saved: int = 0  # what the baseline graphs so far save
    planned_saved: int = 0  # what the planned graphs so far save

    def limit(self, baseline) -> int:
        """Graph *k*'s own peak limit, given its baseline simulation."""
        peak = max(self.baseline_peak, self.baseline_saved + baseline.peak)
        return max(0, budget_bytes(self.memory_budget, peak) - self.planned_saved)

    def add(self, baseline, chosen) -> None:
        self.baseline_peak = max(self.baseline_peak, self.baseline_saved + baseline.peak)
        self.baseline_saved += baseline.saved
        self.planned_saved += chosen.saved
        self.graphs += 1

    def describe(self) -> str:
        """What the graphs before this one left, for a warning ('' for the first)."""
        if not self.graphs:
            return ""
        return (
            f"graph {self.graphs + 1} of this compile, after {self.graphs} that save "
            f"{self.planned_saved / max(1, self.baseline_saved):.2f} of their baseline: "
        )


def with_later_pieces(table: Table, limit: int, baseline) -> tuple[Table, int]:
    """``table`` and a limit with which a planner lowers what a DDP piece saves.

    A piece's saved activations stay alive while every later piece runs forward and
    backward, so what a piece saves, not its own peak (its backward's working set, often
    a floor no plan goes under), is what it adds to the process's peak. The first
    backward row gets a plan-independent temporary as large as the piece's whole peak,
    so the boundary is the peak of every plan and a planner, which lowers the peak, lowers
    what is saved; the limit there is the piece's share of its saved bytes (``limit`` x
    saved / peak) on top of what the boundary holds besides them.
    """
    rows = list(table.rows)
    at = table.boundary
    if at >= len(rows) or baseline.peak <= 0:
        return table, limit
    rows[at] = dataclasses.replace(rows[at], temp_bytes=rows[at].temp_bytes + baseline.peak)
    share = limit * baseline.saved // baseline.peak
    besides = baseline.timeline[at] - baseline.saved  # the first backward op's own bytes
    return Table(tuple(rows), table.storage_bytes, table.excluded), (
        baseline.peak + besides + share
    )


def _compile_key(blocks: bool = False) -> object:
    """The Dynamo compile this graph belongs to (None outside one); for the blocks of one
    ``compile_blocks`` call, which are compiles of frames of their own, the round of
    compiles: the n-th compile of every block's frame shares the key n."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None:
        return None
    if blocks:
        return ("blocks", compile_id.frame_compile_id, compile_id.compiled_autograd_id)
    return (compile_id.frame_id, compile_id.frame_compile_id, compile_id.compiled_autograd_id)


#: What recomputing a pointwise op costs under a fusing compiler, as a fraction of its
#: measured (unfused, eager) time: Inductor folds the copy into the kernel of its backward
#: consumer, where it costs reading its inputs instead of a kernel of its own.
FUSED_POINTWISE_COST = 0.1


def fused_pointwise_costs(table: Table, gm: fx.GraphModule) -> Table:
    """``table`` with each pointwise row's time scaled by :data:`FUSED_POINTWISE_COST`, so
    a planner prefers recomputing the cheap elementwise tail of a block (BatchNorm's
    normalize, activations) to recomputing convolutions and matmuls."""
    pointwise = _pointwise_names(gm)
    rows = tuple(
        dataclasses.replace(row, time_s=row.time_s * FUSED_POINTWISE_COST)
        if row.name in pointwise
        else row
        for row in table.rows
    )
    return Table(rows, table.storage_bytes, table.excluded)


def fused_floor(table: Table, gm: fx.GraphModule) -> Simulation | None:
    """Every recomputable pointwise op recomputed: the plan torch's min-cut partitioner
    makes for Inductor whatever its budget (None when there is no such op).

    Under a fusing compiler a recomputed pointwise op joins the backward kernel that
    reads it, which then reads the op's inputs instead of its saved output. Measured on
    the BatchNorm CNN of ``benchmarks/remat_compile.py``, three compiles each: at budget
    0.7 this plan peaked at 0.585 of eager's activation memory, as min-cut's does, at
    1.020× min-cut's step time, where the greedy plan held 0.635 at 1.019×. So when it
    meets the budget, it is the plan (:meth:`Partition.plan`).
    """
    pointwise = _pointwise_names(gm)
    chosen = [i for i, row in enumerate(table.rows) if row.recomputable and row.name in pointwise]
    return simulate(table, chosen) if chosen else None


def _pointwise_names(gm: fx.GraphModule) -> set[str]:
    """The nodes a fusing compiler folds into the kernel that reads them."""
    return {n.name for n in gm.graph.nodes if ops.is_pointwise(n)}


def _without_dead_draws(
    forward: fx.GraphModule, backward: fx.GraphModule
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The partition with the random ops nothing in the backward reads removed, and what
    only they read (:class:`~fxopt.remat.dead_draws.RemoveDeadDraws`)."""
    if _run(backward, RemoveDeadDraws(), recompile=False).changed:
        backward.recompile()
    return forward, backward


def _run(gm: fx.GraphModule, pass_, *, recompile: bool = True):
    """``pass_`` run in place on ``gm`` by the PassManager (checked; recompiled unless
    ``recompile=False``)."""
    return PassManager([pass_], copy=False, recompile=recompile, name="remat-backend").run(gm)


def _partitionable(gm: fx.GraphModule, names: Sequence[str]) -> list[str]:
    """``names`` without the getitems whose multi-output op is not recomputed too.

    ``default_partition`` saves a multi-output op's getitems, never the op itself, so a
    backward getitem cannot read a forward op. Recomputing such a getitem alone changes
    no memory (it is a view of the op's output, which stays alive either way), so keeping
    it in the forward leaves the plan's peak as simulated.
    """
    chosen = set(names)
    nodes = {n.name: n for n in gm.graph.nodes}
    return [
        name
        for name in names
        if not (
            nodes[name].target is operator.getitem
            and isinstance(nodes[name].args[0], fx.Node)
            and nodes[name].args[0].name not in chosen
        )
    ]


def _inductor(partition: Partition) -> Callable:
    """Inductor's ``compile_fx`` with ``partition`` as its partitioner."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    class InductorPartition(CustomPartitionerFn):
        def __call__(self, gm, joint_inputs, **kwargs):
            return partition(gm, joint_inputs, **kwargs)

        def uuid(self):
            return None  # no caching (see compile below)

        def __reduce__(self):
            # Inductor pickles its config for cache keys even with caching off.
            return (str, ("fxopt.remat.backend partition",))

    def compile(gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        # No caches: a hit would reuse another compile's plan (another budget, another
        # profile) without calling the partitioner.
        with (
            config.patch(custom_partitioner_fn=InductorPartition(), fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            return compile_fx(gm, example_inputs)

    return compile


def _eliminate_common_subexpressions(joint: fx.GraphModule) -> None:
    """Merge the joint graph's repeated computations, as torch's min-cut partitioner does
    first (:class:`~fxopt.remat.joint_cse.JointCSE`)."""
    _run(joint, JointCSE())


def _profile_inputs(joint: fx.GraphModule, real: Sequence | None) -> list:
    """Values for the joint graph's placeholders: its primals are the compiled graph's
    inputs in order (the model's own parameters among them), used as they are where they
    match; the rest (the tangents) are made like their fake values."""
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    primals = [n for n in placeholders if str(n.target).startswith("primals")]
    given = list(real or ())
    paired = dict(zip(primals, given)) if len(primals) == len(given) else {}
    values = []
    for node in placeholders:
        value = paired.get(node)
        values.append(value if _matches(value, node.meta.get("val")) else _example(node))
    return values


def _matches(value: object, fake: object) -> bool:
    if not isinstance(value, torch.Tensor) or not isinstance(fake, torch.Tensor):
        return False
    if is_fake(value):  # DDPOptimizer compiles its pieces on fake inputs first
        return False
    return (
        value.shape == fake.shape
        and value.dtype == fake.dtype
        and value.device == fake.device
        and value.stride() == fake.stride()
    )


def _example(node: fx.Node) -> object:
    """A real tensor like the placeholder's fake value: the profile needs to run the graph.

    Integer inputs are zeros, a valid index for embeddings and class targets alike.
    """
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    # A dynamic dim (Dynamo marks the batch dynamic at its second size) takes the size of
    # the call being compiled: the plan is made there and holds for the others.
    shape = [d if isinstance(d, int) else _hint(d, node) for d in val.shape]
    if val.dtype.is_floating_point or val.dtype.is_complex:
        return torch.randn(shape, dtype=val.dtype, device=val.device)
    return torch.zeros(shape, dtype=val.dtype, device=val.device)


def _hint(size: torch.SymInt, node: fx.Node) -> int:
    hint = size.node.hint
    if hint is None:
        raise UnsupportedOpError(
            f"remat cannot profile input '{node.name}': its size {size} has no value to "
            "profile with; use torch.compile(..., dynamic=False)"
        )
    return int(hint)
