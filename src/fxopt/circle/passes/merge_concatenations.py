"""merge-concatenations: a CONCATENATION of a CONCATENATION along the same axis is one.

``cat([cat([a, b], d), c], d)`` is ``cat([a, b, c], d)``: the inner operator's inputs take
its place in the outer one's list (the seed's ``MergeConsecutiveCat``). Only when nothing
else reads the inner result (not a graph output, no other reader) and neither fuses an
activation; the inner operator is then dead and remove-dead-ops drops it.

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.ConcatenationOptions import ConcatenationOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> def axis(a):
    ...     o = ConcatenationOptionsT(); o.axis = a; return o
    >>> g = CircleGraph()
    >>> a, b, c = (g.add_tensor(n, (2, 3), np.float32) for n in "abc")
    >>> ab, abc = g.add_tensor("ab", (4, 3), np.float32), g.add_tensor("abc", (6, 3), np.float32)
    >>> g.add_op("CONCATENATION", [a, b], [ab], axis(0))
    >>> g.add_op("CONCATENATION", [ab, c], [abc], axis(0))
    >>> g.inputs, g.outputs = [a, b, c], [abc]
    >>> MergeConcatenations()(g).stats, g.operators[1].inputs
    ({'merged': 1}, [0, 1, 2])
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class MergePlan(Plan):
    inputs: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (operator index, new inputs)


def _axis(op: Operator) -> int:
    return op.options.axis


def _fused(op: Operator) -> bool:
    return bool(getattr(op.options, "fusedActivationFunction", 0))


class MergeConcatenations(Pass[MergePlan]):
    name = "merge-concatenations"
    description = "a CONCATENATION of a CONCATENATION along the same axis becomes one"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> MergePlan:
        producers, readers = graph.producers(), graph.consumers()
        merged: dict[int, tuple[int, ...]] = {}  # CONCATENATION output → its flat inputs
        plan, skipped = [], []
        for index, op in enumerate(graph.operators):
            if op.code != "CONCATENATION":
                continue
            flat: list[int] = []
            for tensor in op.inputs:
                inner = producers.get(tensor)
                if inner is None or inner.code != "CONCATENATION" or _axis(inner) != _axis(op):
                    flat.append(tensor)
                    continue
                why = None
                if graph.sole_reader(tensor, readers) is None:
                    why = "its result is read elsewhere too"
                elif _fused(inner) or _fused(op):
                    why = "a fused activation"
                if why is None:
                    flat.extend(merged.get(tensor, inner.inputs))
                else:
                    skipped.append(Skip(graph.tensors[tensor].name, f"not merged: {why}"))
                    flat.append(tensor)
            merged[op.outputs[0]] = tuple(flat)
            if flat != op.inputs:
                plan.append((index, tuple(flat)))
        return MergePlan(tuple(skipped), tuple(plan))

    def transform(self, graph: CircleGraph, plan: MergePlan) -> PassResult:
        for index, inputs in plan.inputs:
            graph.operators[index].inputs = list(inputs)
        return PassResult(bool(plan.inputs), {"merged": len(plan.inputs)})

    def verify(self, graph: CircleGraph) -> None:
        producers, readers = graph.producers(), graph.consumers()
        for op in graph.operators:
            if op.code != "CONCATENATION":
                continue
            for tensor in op.inputs:
                inner = producers.get(tensor)
                alone = graph.sole_reader(tensor, readers) is not None
                if inner is not None and inner.code == "CONCATENATION" and alone:
                    assert _axis(inner) != _axis(op) or _fused(inner) or _fused(op), (
                        f"CONCATENATION {graph.tensors[tensor].name} left unmerged"
                    )
