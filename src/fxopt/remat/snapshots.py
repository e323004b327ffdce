"""add-snapshots: snapshot the generator right before each forward random op the backward
may need, so a plan can recompute the op by replaying its draws (:mod:`fxopt.remat.rng`).

"May need": the op's value reaches a backward node through forward nodes. The snapshot is
a forward node nothing reads yet; ``recompute`` makes replays read it and erases it
otherwise.

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.remat.capture import tag_phases
    >>> aten = torch.ops.aten
    >>> def f(x):
    ...     d = aten.native_dropout.default(x, 0.5, True)
    ...     return aten.sum.default(d[0]), aten.mul.Tensor(d[1], x)
    >>> gm = fx.symbolic_trace(f)
    >>> for n in gm.graph.nodes:
    ...     n.meta["val"] = torch.empty(0)  # a device to snapshot (capture sets it)
    >>> out = list(gm.graph.nodes)[-1]
    >>> _ = tag_phases(gm, forward_outputs=[out.args[0][0]])
    >>> AddSnapshots()(gm).stats, [n.name for n in gm.graph.nodes][:3]
    ({'added': 1}, ['x', 'native_dropout_default_rng_state', 'native_dropout_default'])
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxopt.ir import ops
from fxopt.passes.base import Pass, PassResult, Plan, Skip
from fxopt.remat import rng
from fxopt.remat.tags import BACKWARD, FORWARD, PHASE, phase


@dataclass(frozen=True)
class SnapshotPlan(Plan):
    random_ops: tuple[fx.Node, ...] = ()


class AddSnapshots(Pass[SnapshotPlan]):
    name = "add-snapshots"
    description = "an RNG-state snapshot before each forward random op the backward may need"
    idempotent = True

    def analyze(self, gm: fx.GraphModule) -> SnapshotPlan:
        found, skipped = [], []
        for node in _reaching_the_backward(gm):
            if node.meta.get(rng.RNG_STATE) or not ops.info(node, gm).random:
                continue
            if (
                rng.generator_of(node) is None
                and rng.device_of(node) is not None
                and (ops.aten_name(node) is not None)
            ):
                found.append(node)
            else:
                skipped.append(Skip(node.name, rng.why_not_replayable(node, ops.info(node).name)))
        return SnapshotPlan(tuple(skipped), tuple(found))

    def transform(self, gm: fx.GraphModule, plan: SnapshotPlan) -> PassResult:
        for node in plan.random_ops:
            _snapshot_before(gm.graph, node)
        return PassResult(bool(plan.random_ops), {"added": len(plan.random_ops)})

    def verify(self, gm: fx.GraphModule) -> None:
        left = self.analyze(gm).random_ops
        assert not left, f"{len(left)} replayable random op(s) without a snapshot"


def _reaching_the_backward(gm: fx.GraphModule) -> list[fx.Node]:
    """Forward nodes whose value reaches the backward, in graph order."""
    needed: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if phase(node) == FORWARD and any(phase(u) == BACKWARD or u in needed for u in node.users):
            needed.add(node)
    return [node for node in gm.graph.nodes if node in needed]


def _snapshot_before(graph: fx.Graph, node: fx.Node) -> None:
    device = str(rng.device_of(node))
    with graph.inserting_before(node):
        snap = graph.create_node(
            "call_function", rng.state_of, (device,), name=f"{node.name}_rng_state"
        )
    snap.meta[PHASE] = FORWARD
    snap.meta[rng.SNAPSHOT_OF] = node.name
    if "partitioner_tag" in node.meta:  # AOTAutograd's partitioner keeps it forward
        snap.meta["partitioner_tag"] = node.meta["partitioner_tag"]
    val = rng.fake_state(node, device)
    if val is not None:  # partitioners check that a saved value is a tensor
        snap.meta["val"] = val
    node.meta[rng.RNG_STATE] = snap.name
