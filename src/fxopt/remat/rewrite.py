"""Apply a recompute plan to a joint graph.

For every recomputed node that the backward needs, copy it once into the backward, right
before its earliest backward consumer, and point the backward's uses at the copy:

    forward:  a = f(x) ── b = g(a) ── ...            (a dies after g: its last forward use)
    backward: ... ── a' = f(x) ── ga = h(a', gb) ── gx = k(a', ...)
                      ▲ copy inserted before the first backward use; later uses reuse a'

The copy's inputs are the copies of recomputed inputs (made earlier, since a node's
inputs are consumed before it) or the kept originals, so the recompute subgraph of each
activation reaches back exactly to kept values and placeholders, and nothing is copied
twice. Placement is :func:`fxopt.remat.simulate.anchors_of`, the function the planners'
cost model uses, so the rewritten graph is the schedule that was simulated. fx's code
generation frees every value after its last use, so the forward original dies after its
last forward use and each recomputed value after its last backward use. A random op is
copied as ``rng.replay(device, snapshot, op, *args)``, drawing what the forward drew; RNG
snapshots no replay reads are erased.

An *offloaded* node is kept on the host instead: a copy to the host right after its last
forward use (so the device original dies there), and a copy back to its device where a
recompute's copy would go; the backward reads that. Both are ``aten._to_copy`` on the
current stream (see :class:`fxopt.remat.planners.Offload` for what that costs). On a CPU
the "host" is the same memory: the graph computes the same values, and the memory the
plan saves is the planner's simulation, not a measurement.

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.remat.capture import tag_phases
    >>> def f(x):
    ...     a = torch.sin(x)
    ...     b = torch.cos(a)
    ...     return b, torch.mul(a, b)
    >>> gm = fx.symbolic_trace(f)
    >>> out = list(gm.graph.nodes)[-1]
    >>> _ = tag_phases(gm, forward_outputs=[out.args[0][0]])
    >>> recompute(gm, ["sin"]).records[0].stats
    {'copies': 1, 'snapshots_erased': 0}
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'sin', 'cos', 'sin_1', 'mul', 'output']
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from fxopt.errors import PassError
from fxopt.ir import ops
from fxopt.passes.base import Pass, PassResult, Plan, Skip
from fxopt.passes.manager import PipelineResult
from fxopt.remat import rng
from fxopt.remat.simulate import anchors_of
from fxopt.remat.table import Row, Table
from fxopt.remat.tags import BACKWARD, FORWARD, PHASE, phase

RECOMPUTED_FROM = "fxopt.recomputed_from"
OFFLOADED_FROM = "fxopt.offloaded_from"  # on a copy to the host, and on the copy back

HOST = torch.device("cpu")


def recompute(
    gm: fx.GraphModule,
    names: Iterable[str],
    *,
    offload: Iterable[str] = (),
    dump_after: Sequence[str] = (),
) -> PipelineResult:
    """Rewrite ``gm`` in place so the named forward nodes are recomputed in the backward
    (and the ``offload`` ones kept on the host): the :class:`Recompute` pass, run by the
    PassManager (checked, then recompiled).

    Each copy carries ``meta[RECOMPUTED_FROM]``, the name of its original (a recomputed
    node that nothing in the backward needs gets no copy).
    """
    from fxopt.passes import PassManager

    rewrite = Recompute(names, offload)
    return PassManager([rewrite], copy=False, name="remat", dump_after=dump_after).run(gm)


@dataclass(frozen=True)
class RecomputePlan(Plan):
    # (forward node, the backward node its copy goes before), in insertion order
    copies: tuple[tuple[fx.Node, fx.Node], ...] = ()
    # offloaded forward node -> the forward node its copy to the host goes after
    offloads: tuple[tuple[fx.Node, fx.Node], ...] = ()


class Recompute(Pass[RecomputePlan]):
    """Copy the named forward nodes into the backward; backward uses read the copies.
    ``offload`` names forward nodes the backward reads back from the host instead.

    Refuses (PassError) a name not in the graph, a node that is not in the forward, a
    random node without an RNG-state snapshot to replay, and an offload of a value that
    is not one tensor.
    """

    name = "recompute"
    description = "recompute chosen forward activations in the backward (or offload them)"

    def __init__(self, names: Iterable[str], offload: Iterable[str] = ()):
        self.names = tuple(names)
        self.offload = tuple(offload)

    def analyze(self, gm: fx.GraphModule) -> RecomputePlan:
        nodes = list(gm.graph.nodes)
        index = {node: i for i, node in enumerate(nodes)}
        wanted = [index[node] for node in self._forward_nodes(gm, self.names)]
        kept = [index[node] for node in self._forward_nodes(gm, self.offload)]
        both = sorted(nodes[i].name for i in set(wanted) & set(kept))
        if both:
            raise PassError(self.name, f"{', '.join(both)}: both recomputed and offloaded")
        for x in kept:
            if not isinstance(nodes[x].meta.get("val"), torch.Tensor):
                raise PassError(
                    self.name, f"cannot offload '{nodes[x].name}': its value is not one tensor"
                )
        anchors = anchors_of(_structure(nodes, index), wanted, kept)
        for x in sorted(set(anchors) - set(kept)):
            original = nodes[x]
            if ops.info(original, gm).random and rng.snapshot_of(original) is None:
                raise PassError(
                    self.name,
                    f"'{original.name}' is random and has no RNG-state snapshot to replay",
                )
        order = sorted(anchors, key=lambda i: (anchors[i], i))
        skipped = tuple(
            Skip(nodes[x].name, "nothing in the backward reads it: no copy needed")
            for x in [*wanted, *kept]
            if x not in anchors
        )
        # Each copy to the host goes right after the original's last forward use.
        offloads = tuple(
            (
                nodes[x],
                max(
                    (u for u in nodes[x].users if phase(u) != BACKWARD),
                    key=index.get,
                    default=nodes[x],
                ),
            )
            for x in kept
            if x in anchors
        )
        return RecomputePlan(skipped, tuple((nodes[x], nodes[anchors[x]]) for x in order), offloads)

    def _forward_nodes(self, gm: fx.GraphModule, names: Sequence[str]) -> list[fx.Node]:
        by_name = {node.name: node for node in gm.graph.nodes}
        found = []
        for name in names:
            node = by_name.get(name)
            if node is None:
                raise PassError(self.name, f"no node named '{name}' in the graph")
            if phase(node) != "forward":
                raise PassError(self.name, f"'{name}' is not a forward node ({phase(node)})")
            found.append(node)
        return found

    def transform(self, gm: fx.GraphModule, plan: RecomputePlan) -> PassResult:
        on_host = {
            original: _to_host(gm.graph, original, after) for original, after in plan.offloads
        }
        copies: dict[fx.Node, fx.Node] = {}
        for original, anchor in plan.copies:
            if original in on_host:
                copies[original] = _back_from_host(gm.graph, original, on_host[original], anchor)
            else:
                copies[original] = _copy_before(gm.graph, original, anchor, copies)
        for original, copy in copies.items():
            for user in list(original.users):
                if phase(user) == BACKWARD and not _is_copy(user):
                    user.replace_input_with(original, copy)
        # No cost for random ops the plan keeps: snapshots no replay reads go.
        unused = [n for n in gm.graph.nodes if rng.is_snapshot(n) and not n.users]
        for node in unused:
            gm.graph.erase_node(node)
        changed = bool(copies or unused)
        stats = {"copies": len(copies) - len(on_host), "snapshots_erased": len(unused)}
        if on_host:
            stats["offloads"] = len(on_host)
        return PassResult(changed, stats)

    def verify(self, gm: fx.GraphModule) -> None:
        for node in gm.graph.nodes:
            source = node.meta.get(RECOMPUTED_FROM)
            if source is not None and phase(node) != BACKWARD:
                raise AssertionError(f"the copy {node.name} of {source} is not in the backward")
            source = node.meta.get(OFFLOADED_FROM)
            if source is not None:
                back = OFFLOADED_FROM in node.args[0].meta
                expected = BACKWARD if back else FORWARD
                if phase(node) != expected:
                    raise AssertionError(
                        f"{node.name}, the copy of {source} {'from' if back else 'to'} the "
                        f"host, is not in the {expected}"
                    )
            if rng.is_snapshot(node) and not node.users:
                raise AssertionError(f"the RNG snapshot {node.name} is left unread")


def _is_copy(node: fx.Node) -> bool:
    return RECOMPUTED_FROM in node.meta or OFFLOADED_FROM in node.meta


def _to_host(graph: fx.Graph, original: fx.Node, after: fx.Node) -> fx.Node:
    """A copy of ``original`` on the host, right after ``after`` (its last forward use)."""
    with graph.inserting_after(after):
        host = ops.emit(graph, "to", original, device=HOST)
    host.meta = {k: v for k, v in original.meta.items() if k in (PHASE, "partitioner_tag")}
    host.meta[OFFLOADED_FROM] = original.name
    return host


def _back_from_host(graph: fx.Graph, original: fx.Node, host: fx.Node, anchor: fx.Node) -> fx.Node:
    """``host`` copied back to ``original``'s device, right before ``anchor``."""
    device = original.meta["val"].device
    with graph.inserting_before(anchor):
        back = ops.emit(graph, "to", host, device=device)
    back.meta = dict(original.meta)
    back.meta[PHASE] = BACKWARD
    back.meta[OFFLOADED_FROM] = original.name
    if "partitioner_tag" in back.meta:
        back.meta["partitioner_tag"] = "is_backward"
    return back


def _copy_before(
    graph: fx.Graph, original: fx.Node, anchor: fx.Node, copies: dict[fx.Node, fx.Node]
) -> fx.Node:
    """A backward copy of ``original`` before ``anchor``, reading earlier copies."""
    snapshot = rng.snapshot_of(original)
    with graph.inserting_before(anchor):
        if snapshot is not None:  # same draws as the forward, generator restored after
            copy = _replay_node(graph, original, snapshot, lambda a: copies.get(a, a))
        else:
            copy = graph.node_copy(original, lambda a: copies.get(a, a))
    copy.meta = dict(original.meta)
    copy.meta[PHASE] = BACKWARD
    copy.meta[RECOMPUTED_FROM] = original.name
    if "partitioner_tag" in copy.meta:  # AOTAutograd's own forward/backward marker
        copy.meta["partitioner_tag"] = "is_backward"
    return copy


def _replay_node(
    graph: fx.Graph, original: fx.Node, snapshot: fx.Node, arg_transform: Callable
) -> fx.Node:
    """Insert (at the graph's insert point) ``rng.replay(device, snapshot, op, *args)`` for
    ``original``, its arguments mapped by ``arg_transform`` as ``Graph.node_copy`` does."""
    args = fx.node.map_arg(original.args, arg_transform)
    kwargs = fx.node.map_arg(original.kwargs, arg_transform)
    return graph.create_node(
        "call_function",
        rng.replay,
        (snapshot.args[0], snapshot, original.target, *args),
        dict(kwargs),
        name=original.name,
    )


def _structure(nodes: list[fx.Node], index: dict[fx.Node, int]) -> Table:
    """The graph's shape as a Table (phases and arguments only), for placement."""
    rows = tuple(
        Row(name=n.name, phase=phase(n), args=tuple(index[a] for a in n.all_input_nodes))
        for n in nodes
    )
    return Table(rows, ())
