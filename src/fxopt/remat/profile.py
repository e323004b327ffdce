"""Profile a joint training graph into a cost :class:`~fxopt.remat.table.Table` (pure:
the graph and its inputs are not changed).

A small node-by-node interpreter runs the graph ``runs`` times under ``no_grad`` and a
forked RNG (the captured graph is functional, so nothing it reads is written) and records,
per node:

* **runtime**: the median over the runs of the node's own wall time;
* **storages**: which tensor storages the node's value references, and which of them it
  allocated. Storages are identified at run time by their data pointer, so a view, a
  ``getitem`` of a multi-output op or a ``t()`` of a weight is seen to share memory
  exactly as it does when the graph runs; a storage that existed before the run (a
  parameter, an input) is free.
* **recomputable**: a forward node may be recomputed only if the op table
  (:mod:`fxopt.ir.ops`) says it is known, pure and not stateful, and alias analysis
  (:mod:`fxopt.ir.alias`) says none of its inputs is written in place between the node
  and the end of the graph (a recomputation would read the new value). A random op is
  recomputable when capture gave it an RNG-state snapshot (:mod:`fxopt.remat.rng`): its
  row then reads the snapshot, so planners keep the snapshot alive until the replay.

Liveness (last forward use, first backward use, recompute sources) is read off the table;
the static memory timeline is :func:`fxopt.remat.simulate.simulate` with nothing recomputed.

    >>> import torch, torch.nn.functional as F
    >>> from fxopt.remat.capture import capture_joint
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(3, 4)
    >>> joint = capture_joint(model, lambda m, x: m(x).square().mean(), (x,))
    >>> table = profile(joint.gm, joint_inputs(joint, model, (x,)), runs=1,
    ...                 excluded_outputs=range(joint.loss_index + 1, 5))
    >>> relu = table.index("relu")
    >>> table.rows[relu].recomputable, table.storage_bytes[table.rows[relu].owns[0]]
    (True, 96)
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map

from fxopt import op_failures
from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.memory import release_free_memory
from fxopt.remat import rng
from fxopt.remat.capture import Joint
from fxopt.remat.simulate import simulate
from fxopt.remat.table import INPUT, OUTPUT, Row, Table
from fxopt.remat.tags import BACKWARD, FORWARD, MUST_SAVE, phase


def joint_inputs(joint: Joint, model: nn.Module, inputs: Sequence) -> list:
    """The flat argument list of ``joint.gm``: parameters, buffers, then inputs."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    return [params[n] for n in joint.params] + [buffers[n] for n in joint.buffers] + list(inputs)


def profile(
    gm: fx.GraphModule,
    inputs: Sequence,
    *,
    runs: int = 3,
    excluded_outputs: Iterable[int] = (),
    schedule: fx.GraphModule | None = None,
) -> Table:
    """Run ``gm`` node by node ``runs`` times and build its cost table.

    ``excluded_outputs`` are positions in the output tuple (parameter gradients) whose
    storages are not activation memory. ``schedule``, a copy of ``gm`` rewritten to
    recompute some forward nodes in its backward (:func:`lean_schedule`), is run instead
    of ``gm``: every node of ``gm`` runs in it under its own name and is measured there,
    and the run holds no more activation memory than that plan does, rather than all of
    ``gm``'s (what would make planning a step cost more memory than the step).
    """
    run_gm = schedule if schedule is not None else gm
    run_nodes = list(run_gm.graph.nodes)
    times: list[list[float]] = [[] for _ in run_nodes]
    storages = _Storages(run_gm, run_nodes, inputs, set(excluded_outputs))
    signatures: list[object] = [None] * len(run_nodes)
    alias = AliasAnalysis(run_gm)
    # Run 0 records storages, op signatures and, under the profiler, each op's
    # temporaries; its timings (inflated by the profiler) are used only when runs == 0.
    excluded = set(excluded_outputs)
    with torch.random.fork_rng(devices=_devices(inputs)), torch.no_grad():
        with _Temporaries(run_nodes) as temps:
            _run(
                run_gm,
                run_nodes,
                inputs,
                times,
                storages,
                temps.mark,
                signatures,
                excluded=excluded,
            )
        temporaries = temps.result(storages.excluded_pointers())
    # What the run freed stays resident in the allocator's heap (0.54x the weights after a
    # GPT-2 profile, measured): give it back before the step that the profile plans.
    release_free_memory()
    if runs > 0:
        # One timed run. Nodes with the same op signature (a model's repeated blocks) pool
        # their samples; a signature seen fewer than `runs` times is timed again in place.
        times = [[] for _ in run_nodes]
        count = Counter(signatures)
        repeats = {
            i: runs - count[signature]
            for i, signature in enumerate(signatures)
            if count[signature] < runs and alias.info[run_nodes[i]].mergeable
        }
        with torch.random.fork_rng(devices=_devices(inputs)), torch.no_grad():
            _run(run_gm, run_nodes, inputs, times, repeats=repeats, excluded=excluded)
        times = _pooled(times, signatures)
        release_free_memory()
    # The measurements of gm's nodes, in gm's order; a recompute copy's storages count as
    # its original's (a backward view of a copy reads what the original would hold).
    at = {node.name: j for j, node in enumerate(run_nodes)}
    same = _copies_to_originals(run_nodes, at, storages.owns)
    nodes = list(gm.graph.nodes)
    sizes = list(storages.sizes)
    # A node the schedule dropped (an RNG snapshot no replay of its reads) did not run:
    # its storages are its traced value's, its time nothing.
    missing = {n.name: tuple(_new_storages(sizes, n)) for n in nodes if n.name not in at}

    def storages_of(table: list[tuple[int, ...]], node: fx.Node) -> tuple[int, ...]:
        if node.name in missing:
            return missing[node.name]
        return tuple(dict.fromkeys(same.get(s, s) for s in table[at[node.name]]))

    def seconds(node: fx.Node) -> float:
        samples = times[at[node.name]] if node.name in at else ()
        return statistics.median(samples) if samples else 0.0

    measured = _Measured(
        time_s=[seconds(n) for n in nodes],
        refs=[storages_of(storages.refs, n) for n in nodes],
        owns=[storages_of(storages.owns, n) for n in nodes],
        sizes=sizes,
        excluded=storages.excluded,
        temp_bytes=[temporaries[at[n.name]] if n.name in at else 0 for n in nodes],
    )
    return _table(gm, nodes, measured, AliasAnalysis(gm) if schedule is not None else alias)


def estimate(gm: fx.GraphModule, *, excluded_outputs: Iterable[int] = ()) -> Table:
    """The cost table of ``gm`` read off its nodes' traced fake values (``meta["val"]``),
    nothing run: storages and their sharing as traced, times estimated from each op's
    floating-point operations and bytes written, temporaries unknown (0). Good enough to
    choose the schedule the profile itself runs with (:func:`lean_schedule`); a node with
    no traced value holds no memory here.
    """
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    keys: dict[int, int] = {}  # fake storage -> storage id
    sizes: list[int] = []
    refs: list[tuple[int, ...]] = []
    owns: list[tuple[int, ...]] = []
    times: list[float] = []
    # Inputs, parameters and constants are not activation memory, nor are views of them.
    external = {
        t.untyped_storage()._cdata
        for node in nodes
        if node.op in ("placeholder", "get_attr")
        for t in tree_leaves(node.meta.get("val"))
        if isinstance(t, torch.Tensor) and t.layout == torch.strided
    }
    for node in nodes:
        mine, new = [], []
        if node.op not in ("placeholder", "get_attr", "output"):
            for t in tree_leaves(node.meta.get("val")):
                if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                    continue
                storage = t.untyped_storage()
                if not isinstance(storage.nbytes(), int):
                    raise _Symbolic(node.name)
                if storage.nbytes() == 0 or storage._cdata in external:
                    continue
                key = storage._cdata
                if key not in keys:
                    keys[key] = len(sizes)
                    sizes.append(storage.nbytes())
                    new.append(keys[key])
                if keys[key] not in mine:
                    mine.append(keys[key])
        refs.append(tuple(mine))
        owns.append(tuple(new))
        times.append(_estimated_seconds(node, sum(sizes[s] for s in new)))
    output = nodes[-1]
    outs = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    excluded = {
        s
        for position in excluded_outputs
        if position < len(outs) and isinstance(outs[position], fx.Node)
        for s in refs[index[outs[position]]]
    }
    measured = _Measured(times, refs, owns, sizes, excluded, [0] * len(nodes))
    return _table(gm, nodes, measured, AliasAnalysis(gm))


#: Rough rates of a CPU core for :func:`estimate`: only the ratio of ops' costs matters.
_FLOPS_PER_S = 5e10
_BYTES_PER_S = 5e9


def _estimated_seconds(node: fx.Node, written: int) -> float:
    from torch.utils.flop_counter import flop_registry

    flops = 0
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is not None:
        args = fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta.get("val"))
        try:
            flops = formula(*args, **kwargs, out_val=node.meta.get("val"))
        except Exception:  # a formula that cannot read these operands: bytes alone
            flops = 0
    if not isinstance(flops, (int, float)):  # a symbolic count: bytes alone
        flops = 0
    return flops / _FLOPS_PER_S + written / _BYTES_PER_S + 1e-6


def lean_schedule(gm: fx.GraphModule, recomputed: Sequence[str]) -> fx.GraphModule | None:
    """A copy of ``gm`` that recomputes ``recomputed`` in its backward (what a plan chosen on
    :func:`estimate` picked), for :func:`profile` to run; None when there is nothing to
    recompute. Its nodes keep their names; the copies are new nodes."""
    from fxopt.remat.rewrite import recompute

    if not recomputed:
        return None
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    recompute(copy, recomputed)
    return copy


def lean_recompute(table: Table, budget: float | int) -> list[str]:
    """What the greedy planner recomputes on ``table`` (an :func:`estimate`) to fit
    ``budget``, or in the lowest plan it reaches when none fits: the schedule the profile
    runs with."""
    from fxopt.remat.planners import BudgetError, plan

    try:
        return list(plan(table, budget, "greedy").recompute)
    except BudgetError as error:
        reached = error.reached
        return [table.rows[i].name for i in reached.recomputed] if reached is not None else []


def profile_within(
    gm: fx.GraphModule,
    inputs: Sequence,
    budget: float | int,
    *,
    runs: int = 3,
    excluded_outputs: Iterable[int] = (),
) -> Table:
    """:func:`profile`, run with the schedule a plan for ``budget`` on :func:`estimate`
    chooses: planning a step then holds about what the planned step will, not what the
    unplanned one would (a whole eager step's activations, measured 1.62x the weights of
    a 0.7 GiB Llama beside its planned step's 1.50x)."""
    excluded = tuple(excluded_outputs)
    try:
        estimated = estimate(gm, excluded_outputs=excluded)
    except _Symbolic:  # sizes known only at run time: the unplanned run measures them
        schedule = None
    else:
        schedule = lean_schedule(gm, lean_recompute(estimated, budget))
    return profile(gm, inputs, runs=runs, excluded_outputs=excluded, schedule=schedule)


class _Symbolic(Exception):
    """A traced value whose size is symbolic: no estimate without running."""


@dataclass
class _Measured:
    """Per node of a graph: what its table rows are made of."""

    time_s: list[float]
    refs: list[tuple[int, ...]]
    owns: list[tuple[int, ...]]
    sizes: list[int]
    excluded: set[int]
    temp_bytes: list[int]


def _new_storages(sizes: list[int], node: fx.Node) -> list[int]:
    """Storage ids (appended to ``sizes``) for the storages of ``node``'s traced value."""
    found: dict[int, int] = {}
    for t in tree_leaves(node.meta.get("val")):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            storage = t.untyped_storage()
            if storage._cdata not in found and storage.nbytes():
                found[storage._cdata] = len(sizes)
                sizes.append(storage.nbytes())
    return list(found.values())


def _copies_to_originals(
    nodes: list[fx.Node], at: dict[str, int], owns: list[tuple[int, ...]]
) -> dict[int, int]:
    """Storage id of a recompute copy's output → that of its original's (same op, same
    outputs in the same order)."""
    from fxopt.remat.rewrite import RECOMPUTED_FROM

    same: dict[int, int] = {}
    for j, node in enumerate(nodes):
        original = node.meta.get(RECOMPUTED_FROM)
        if original is not None and original in at:
            same.update(zip(owns[j], owns[at[original]]))
    return same


def _table(
    gm: fx.GraphModule, nodes: list[fx.Node], measured: _Measured, alias: AliasAnalysis
) -> Table:
    index = {node: i for i, node in enumerate(nodes)}
    output = nodes[-1]
    by_name = {node.name: node for node in nodes}
    sizes, owns = measured.sizes, measured.owns
    rows = []
    for i, node in enumerate(nodes):
        snapshot = rng.snapshot_of(node, by_name) if phase(node) == FORWARD else None
        reason = (
            _why_not_recomputable(node, alias, output, snapshot) if phase(node) == FORWARD else ""
        )
        args = tuple(index[a] for a in node.all_input_nodes)
        replay_bytes = 0
        if snapshot is not None:
            # The replay of a random op reads its RNG-state snapshot: to the planners it is
            # one more input, kept alive until the op's copy. The replay also holds the
            # generator's current state while the op runs (as large as the snapshot).
            args += (index[snapshot],)
            replay_bytes = sum(sizes[s] for s in owns[index[snapshot]])
        rows.append(
            Row(
                name=node.name,
                phase=phase(node) or _phase_by_op(node),
                args=args,
                time_s=measured.time_s[i],
                refs=measured.refs[i],
                owns=owns[i],
                recomputable=phase(node) == FORWARD and not reason,
                reason=reason,
                op=alias.info[node].name,
                temp_bytes=measured.temp_bytes[i],
                copy_temp_bytes=replay_bytes,
            )
        )
    return Table(tuple(rows), tuple(sizes), frozenset(measured.excluded))


def static_timeline(table: Table) -> tuple[int, ...]:
    """Live activation bytes at each node of the unmodified graph (the cost model's view)."""
    return simulate(table).timeline


def _phase_by_op(node: fx.Node) -> str:
    return {"placeholder": INPUT, "output": OUTPUT}.get(node.op, BACKWARD)


def _devices(inputs: Sequence) -> list:
    return sorted(
        {str(x.device) for x in inputs if isinstance(x, torch.Tensor) and x.device.type != "cpu"}
    )


def _run(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    inputs: Sequence,
    times: list[list[float]],
    storages: _Storages | None = None,
    mark: Callable[[int], contextlib.AbstractContextManager] | None = None,
    signatures: list[object] | None = None,
    repeats: dict[int, int] | None = None,
    excluded: set[int] = frozenset(),
) -> None:
    """One node-by-node run, appending each node's wall time to ``times``. ``storages``
    (first run) records the storages each value holds; ``mark(i)`` brackets node i;
    ``signatures[i]`` gets node i's op signature; node i runs ``repeats[i]`` more times
    (results dropped) for more samples. A value returned only at an ``excluded`` output
    position (a parameter gradient) is freed as soon as it is made: the profile needs its
    size, and holding every gradient to the end would cost a copy of the weights."""
    dying = _dying_after(nodes, excluded)
    env: dict[fx.Node, object] = {}
    placeholders = iter(inputs)
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            env[node] = next(placeholders)
            continue
        if node.op == "output":
            if storages is not None:
                storages.exclude_outputs(node)
            break
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if signatures is not None:
            signatures[i] = _signature(node, args, kwargs)
        start = time.perf_counter()
        with mark(i) if mark is not None else contextlib.nullcontext():
            operands = (*args, *kwargs.values())
            value = op_failures.run_node(node.target, operands, _call, gm, node, args, kwargs)
        times[i].append(time.perf_counter() - start)
        for _ in range(repeats.get(i, 0) if repeats else 0):
            start = time.perf_counter()
            _call(gm, node, args, kwargs)
            times[i].append(time.perf_counter() - start)
        env[node] = value
        if storages is not None:
            storages.record(i, value)
        for dead in dying.get(i, ()):
            if storages is not None:
                storages.release(dead)
            del env[dead]


def _signature(node: fx.Node, args: tuple, kwargs: dict) -> object:
    """What a call's time depends on: the op, and its arguments with each tensor reduced
    to its shape, strides, dtype and device."""

    def describe(x: object) -> object:
        if isinstance(x, torch.Tensor):
            strides = x.stride() if x.layout == torch.strided else None
            return (tuple(x.shape), strides, x.dtype, x.device)
        return x

    return repr((node.op, node.target, tree_map(describe, (args, kwargs))))


def _pooled(times: list[list[float]], signatures: list[object]) -> list[list[float]]:
    """Each node's samples joined with those of every node of the same signature."""
    pool: dict[object, list[float]] = {}
    for samples, signature in zip(times, signatures):
        if signature is not None:
            pool.setdefault(signature, []).extend(samples)
    return [
        pool[signature] if signature is not None else samples
        for samples, signature in zip(times, signatures)
    ]


def _call(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> object:
    if node.op == "get_attr":
        return _fetch(gm, str(node.target))
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return gm.get_submodule(str(node.target))(*args, **kwargs)


def _dying_after(
    nodes: list[fx.Node], excluded: set[int] = frozenset()
) -> dict[int, list[fx.Node]]:
    """Position i → the nodes whose value is last read by node i (free them after it). A
    value nothing reads, or that the output returns only at ``excluded`` positions, dies
    where it is made."""
    last_use: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        for a in _reads(node, excluded):
            last_use[a] = i
    dying: dict[int, list[fx.Node]] = {}
    for i, node in enumerate(nodes):
        if node.op != "output":
            dying.setdefault(last_use.get(node, i), []).append(node)
    return dying


def _reads(node: fx.Node, excluded: set[int]) -> list[fx.Node]:
    if node.op != "output" or not excluded:
        return node.all_input_nodes
    outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
    return [a for p, a in enumerate(outs) if p not in excluded and isinstance(a, fx.Node)]


class _Storages:
    """Which storages each node's value references (``refs``) and allocated (``owns``),
    by storage id; ``sizes`` per id, and the ids of excluded outputs (``excluded``).

    Storages are identified by data pointer. Those of the inputs, parameters and buffers
    are not activation memory and get no id; a pointer is forgotten once no live value
    holds its storage, since the allocator may hand it out again.
    """

    def __init__(
        self, gm: fx.GraphModule, nodes: list[fx.Node], inputs: Sequence, excluded_out: set[int]
    ):
        self.refs: list[tuple[int, ...]] = [() for _ in nodes]
        self.owns: list[tuple[int, ...]] = [() for _ in nodes]
        self.sizes: list[int] = []
        self.excluded: set[int] = set()
        self._index = {node: i for i, node in enumerate(nodes)}
        self._excluded_out = excluded_out
        external = {_key(t) for t in tree_leaves(list(inputs)) if isinstance(t, torch.Tensor)}
        external |= {_key(t) for t in gm.parameters()} | {_key(t) for t in gm.buffers()}
        self._external = external
        self._by_pointer: dict[int, int] = {}
        self._pointer_of: dict[int, int] = {}
        self._holders: dict[int, int] = {}  # storage id -> live values referencing it

    def record(self, i: int, value: object) -> None:
        """Node i computed ``value``: note the storages it references, new ones as its own."""
        mine, new = [], []
        for t in tree_leaves(value):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            key = _key(t)
            if key in self._external:
                continue
            sid = self._by_pointer.get(key)
            if sid is None:
                sid = self._by_pointer[key] = len(self.sizes)
                self._pointer_of[sid] = key
                self.sizes.append(t.untyped_storage().nbytes())
                new.append(sid)
            if sid not in mine:
                mine.append(sid)
                self._holders[sid] = self._holders.get(sid, 0) + 1
        self.refs[i], self.owns[i] = tuple(mine), tuple(new)

    def release(self, dead: fx.Node) -> None:
        """``dead``'s value was freed: a storage no live value holds may be reallocated."""
        for sid in self.refs[self._index[dead]]:
            self._holders[sid] -= 1
            if self._holders[sid] == 0:
                del self._by_pointer[self._pointer_of[sid]]

    def excluded_pointers(self) -> list[set[int]]:
        """Per node, the data pointers of the excluded storages it allocated."""
        return [{self._pointer_of[sid] for sid in own if sid in self.excluded} for own in self.owns]

    def exclude_outputs(self, output: fx.Node) -> None:
        """Exclude the storages of the excluded output positions (parameter gradients)."""
        outs = output.args[0]
        outs = (outs,) if isinstance(outs, fx.Node) else outs
        for position, out in enumerate(outs):
            if position in self._excluded_out and isinstance(out, fx.Node):
                self.excluded.update(s for s in self.refs[self._index[out]])


class _Temporaries:
    """Per node, the bytes an op holds beyond its outputs while it runs (workspaces,
    intermediate buffers), from the profiler's allocation events inside the node's range:
    the running peak of the node's own allocations, minus what of them is still allocated
    when it returns. A free of a block allocated before the node does not lower that
    peak, and outputs that are not activation memory (parameter gradients) are left out
    of it: an op may make its workspace before its output, as oneDNN's convolution
    backward does on AVX2 machines, and the workspace is then all its temporary memory.
    """

    _PREFIX = "fxopt.node."

    def __init__(self, nodes: list[fx.Node]):
        self._count = len(nodes)
        self._session = None
        self._prof = None

    def __enter__(self) -> _Temporaries:
        from fxopt.remat.measure import memory_profiler

        self._session = memory_profiler()
        self._prof = self._session.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._session.__exit__(*exc)

    def mark(self, i: int):
        return torch.profiler.record_function(f"{self._PREFIX}{i}")

    def result(self, excluded: list[set[int]]) -> list[int]:
        """Temporary bytes per node, given the data pointers of each node's output
        storages that the timeline leaves out."""
        events = sorted(self._allocations())
        allocated_by: dict[int, int] = {}  # free event -> the allocation event it frees
        open_at: dict[int, int] = {}  # pointer -> its live allocation event
        for k, (_, size, ptr, _) in enumerate(events):
            if size > 0:
                open_at[ptr] = k
            elif ptr in open_at:
                allocated_by[k] = open_at.pop(ptr)
        by_node: dict[int, list[int]] = {}
        for k, event in enumerate(events):
            if event[3] is not None:
                by_node.setdefault(event[3], []).append(k)
        temporaries = [0] * self._count
        for i, ks in by_node.items():
            # The allocation of each excluded output: the last one at its pointer.
            last_at = {
                events[k][2]: k for k in ks if events[k][1] > 0 and events[k][2] in excluded[i]
            }
            skipped = set(last_at.values())
            live = peak = 0
            for k in ks:
                size = events[k][1]
                made = k if size > 0 else allocated_by.get(k)
                if made is None or events[made][3] != i or made in skipped:
                    continue  # a free of a block from before this node, or its output
                live += size
                peak = max(peak, live)
            temporaries[i] = max(0, peak - live)
        return temporaries

    def _allocations(self) -> list[tuple[int, int, int, int | None]]:
        """Every allocation event as (time, size, pointer, node it ran in or None)."""
        allocation = torch._C._profiler._EventType.Allocation
        found = []
        stack = [(e, None) for e in self._prof.profiler.kineto_results.experimental_event_tree()]
        while stack:
            event, node = stack.pop()
            if event.name.startswith(self._PREFIX):
                node = int(event.name[len(self._PREFIX) :])
            elif event.typed[0] == allocation:
                fields = event.typed[1]
                found.append((event.start_time_ns, fields.alloc_size, fields.ptr, node))
            stack.extend((child, node) for child in event.children)
        return found


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _fetch(gm: fx.GraphModule, target: str):
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _why_not_recomputable(
    node: fx.Node, alias: AliasAnalysis, output: fx.Node, snapshot: fx.Node | None
) -> str:
    """'' when ``node`` may be recomputed in the backward, else the reason it may not.
    ``snapshot``: the RNG-state snapshot capture gave ``node`` (random ops), if any."""
    info = alias.info[node]
    if node.op not in ("call_function", "call_method", "call_module"):
        return f"not a computation ({node.op})"
    must_save = node.meta.get(MUST_SAVE) or (
        "an RNG-state snapshot (replays of its random op read it)" if rng.is_snapshot(node) else ""
    )
    if must_save:
        return must_save
    if not info.known:
        return f"unknown op '{info.name}' (may have side effects)"
    if info.random and snapshot is None:
        return rng.why_not_replayable(node, info.name)
    if info.mutates:
        return f"'{info.name}' writes into its input in place"
    if info.stateful:
        return f"'{info.name}' updates module state"
    # The op table calls random ops impure; one that is replayed (or cannot draw) is pure
    # unless torch knows of another side effect.
    if not info.pure and not (info.random and not node.is_impure(impure_random=False)):
        return f"'{info.name}' has side effects"
    if output in node.users:
        return "a graph output"
    if alias.version(node, at=node) != alias.version(node, at=output):
        return "its value is written in place later (a recompute would miss the write)"
    for arg in ops.tensor_args(node):
        if alias.version(arg, at=node) != alias.version(arg, at=output):
            return f"reads '{arg.name}', which is written in place later"
    return ""
