"""merge-reshapes: a RESHAPE of a RESHAPE reads the first one's input.

A reshape's result depends only on its input's elements in row-major order and the target
shape, so the middle RESHAPE of a chain is not needed; it becomes dead (and
remove-dead-ops drops it) unless something else reads it. Layout conversion leaves such
chains at flatten points.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> a, b = g.add_tensor("a", (6,), np.float32), g.add_tensor("b", (3, 2), np.float32)
    >>> g.add_op("RESHAPE", [x], [a])
    >>> g.add_op("RESHAPE", [a], [b])
    >>> g.inputs, g.outputs = [x], [b]
    >>> MergeReshapes()(g).stats, g.operators[1].inputs
    ({'merged': 1}, [0])
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan


@dataclass(frozen=True)
class MergePlan(Plan):
    rewires: tuple[tuple[int, int], ...] = ()  # (RESHAPE operator index, its new input)


class MergeReshapes(Pass[MergePlan]):
    name = "merge-reshapes"
    description = "a RESHAPE of a RESHAPE reads the first one's input"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> MergePlan:
        producers = graph.producers()
        source: dict[int, int] = {}  # RESHAPE output → the tensor the chain starts from
        rewires = []
        for index, op in enumerate(graph.operators):
            if op.code != "RESHAPE":
                continue
            first = producers.get(op.inputs[0])
            start = op.inputs[0]
            if first is not None and first.code == "RESHAPE":
                start = source[op.inputs[0]]
                rewires.append((index, start))
            source[op.outputs[0]] = start
        return MergePlan((), tuple(rewires))

    def transform(self, graph: CircleGraph, plan: MergePlan) -> PassResult:
        for index, start in plan.rewires:
            op = graph.operators[index]
            op.inputs = [start, *op.inputs[1:]]
        return PassResult(bool(plan.rewires), {"merged": len(plan.rewires)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).rewires
        assert not left, f"{len(left)} RESHAPE chain(s) left after merge-reshapes"
