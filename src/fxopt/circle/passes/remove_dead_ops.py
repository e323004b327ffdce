"""remove-dead-ops: operators whose outputs reach no graph output.

One walk from the last operator back: an operator is live when a graph output or a live
operator reads one of its outputs. What fusion and merging orphaned goes, whole chains at
once.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2,), np.float32)
    >>> y, z = g.add_tensor("y", (2,), np.float32), g.add_tensor("z", (2,), np.float32)
    >>> g.add_op("RELU", [x], [y])
    >>> g.add_op("RELU6", [x], [z])
    >>> g.inputs, g.outputs = [x], [y]
    >>> RemoveDeadOps()(g).stats, g.op_counts()
    ({'removed': 1}, {'RELU': 1})
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan


@dataclass(frozen=True)
class DeadPlan(Plan):
    dead: frozenset[int] = frozenset()  # operator indices


class RemoveDeadOps(Pass[DeadPlan]):
    name = "remove-dead-ops"
    description = "drop Circle operators whose outputs nothing reads"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> DeadPlan:
        needed = set(graph.outputs)
        dead = set()
        for index in range(len(graph.operators) - 1, -1, -1):
            op = graph.operators[index]
            if any(t in needed for t in op.outputs):
                needed.update(op.inputs)
            else:
                dead.add(index)
        return DeadPlan((), frozenset(dead))

    def transform(self, graph: CircleGraph, plan: DeadPlan) -> PassResult:
        graph.operators = [op for i, op in enumerate(graph.operators) if i not in plan.dead]
        return PassResult(bool(plan.dead), {"removed": len(plan.dead)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).dead
        assert not left, f"{len(left)} dead operator(s) left after remove-dead-ops"
