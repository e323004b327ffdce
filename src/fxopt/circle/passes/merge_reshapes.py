"""merge-reshapes: a RESHAPE of a RESHAPE reads the first one's input, and a RESHAPE to
its input's own shape is bypassed.

A reshape's result depends only on its input's elements in row-major order and the target
shape, so the middle RESHAPE of a chain is not needed; it becomes dead (and
remove-dead-ops drops it) unless something else reads it. Layout conversion leaves such
chains at flatten points; merging one can leave a RESHAPE from [1, 1, 1, C] to
[1, 1, 1, C] (a flatten and an un-flatten around a quantized FULLY_CONNECTED written as a
1×1 CONV_2D), whose readers then read its input. A graph output, a dynamic shape, or a
change of type or quantization parameters keeps the RESHAPE.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> a, b = g.add_tensor("a", (6,), np.float32), g.add_tensor("b", (3, 2), np.float32)
    >>> g.add_op("RESHAPE", [x], [a])
    >>> g.add_op("RESHAPE", [a], [b])
    >>> g.inputs, g.outputs = [x], [b]
    >>> MergeReshapes()(g).stats, g.operators[1].inputs
    ({'merged': 1, 'bypassed': 0}, [0])
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan


@dataclass(frozen=True)
class MergePlan(Plan):
    rewires: tuple[tuple[int, int], ...] = ()  # (RESHAPE operator index, its new input)
    bypasses: tuple[tuple[int, int], ...] = ()  # (identity RESHAPE's output, its input)


class MergeReshapes(Pass[MergePlan]):
    name = "merge-reshapes"
    description = "a RESHAPE of a RESHAPE reads the first one's input; identity RESHAPEs go"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> MergePlan:
        producers = graph.producers()
        source: dict[int, int] = {}  # RESHAPE output → the tensor the chain starts from
        rewires, bypasses = [], []
        outputs, readers = set(graph.outputs), graph.consumers()
        for index, op in enumerate(graph.operators):
            if op.code != "RESHAPE":
                continue
            first = producers.get(op.inputs[0])
            start = op.inputs[0]
            if first is not None and first.code == "RESHAPE":
                start = source[op.inputs[0]]
                rewires.append((index, start))
            source[op.outputs[0]] = start
            out = op.outputs[0]
            if readers.get(out) and out not in outputs and _same_tensor_type(graph, start, out):
                bypasses.append((out, start))
        return MergePlan((), tuple(rewires), tuple(bypasses))

    def transform(self, graph: CircleGraph, plan: MergePlan) -> PassResult:
        for index, start in plan.rewires:
            op = graph.operators[index]
            op.inputs = [start, *op.inputs[1:]]
        replaced = dict(plan.bypasses)
        for op in graph.operators:
            op.inputs = [_resolve(replaced, i) for i in op.inputs]
        stats = {"merged": len(plan.rewires), "bypassed": len(plan.bypasses)}
        return PassResult(bool(plan.rewires or plan.bypasses), stats)

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph)
        assert not left.rewires, f"{len(left.rewires)} RESHAPE chain(s) left after merge-reshapes"
        assert not left.bypasses, f"{len(left.bypasses)} identity RESHAPE(s) still read"


def _same_tensor_type(graph: CircleGraph, a: int, b: int) -> bool:
    """Same static shape, type and quantization: reading ``a`` for ``b`` changes nothing."""
    x, y = graph.tensors[a], graph.tensors[b]
    static = not x.shape_signature and not y.shape_signature
    return (
        static
        and tuple(x.shape) == tuple(y.shape)
        and x.dtype == y.dtype
        and x.quantization == y.quantization
    )


def _resolve(replaced: dict[int, int], index: int) -> int:
    while index in replaced:
        index = replaced[index]
    return index
