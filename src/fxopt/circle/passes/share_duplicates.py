"""share-duplicates: an operator that repeats an earlier one's work is replaced by it.

Two operators of the same kind, with the same inputs (the same tensors, or constants equal
in type, shape and value) and the same options, compute the same outputs; the later one's
readers read the earlier one's outputs, and remove-dead-ops drops it. Lowering leaves such
pairs where one value feeds several readers that each reshape it the same way: the three
projections of an attention block, each a quantized FULLY_CONNECTED written as a 1×1
CONV_2D, each reshaping the same input to [M, 1, 1, K]. Only operators that just move,
select or convert values are shared (:data:`SHAREABLE`); a graph output is never
redirected, and outputs of another type or quantization keep their operator. Constant
inputs are equal by value when small, by the storage they read when large (a weight).

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> shapes = [g.add_tensor("s", (1,), np.int32, np.asarray([6], np.int32)) for _ in "ab"]
    >>> a, b = g.add_tensor("a", (6,), np.float32), g.add_tensor("b", (6,), np.float32)
    >>> out = g.add_tensor("out", (6,), np.float32)
    >>> g.add_op("RESHAPE", [x, shapes[0]], [a])
    >>> g.add_op("RESHAPE", [x, shapes[1]], [b])
    >>> g.add_op("ADD", [a, b], [out])
    >>> g.inputs, g.outputs = [x], [out]
    >>> ShareDuplicates()(g).stats, g.operators[2].inputs
    ({'shared': 1}, [3, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan

#: Operators whose result depends only on their inputs and options, and that only move,
#: select or convert values (no arithmetic whose rounding could differ).
SHAREABLE = (
    "RESHAPE",
    "TRANSPOSE",
    "EXPAND_DIMS",
    "SQUEEZE",
    "SLICE",
    "STRIDED_SLICE",
    "GATHER",
    "PAD",
    "CONCATENATION",
    "CAST",
    "QUANTIZE",
    "DEQUANTIZE",
)


@dataclass(frozen=True)
class SharePlan(Plan):
    # (output of the duplicate, output of the operator it repeats), per output
    renames: tuple[tuple[int, int], ...] = ()


class ShareDuplicates(Pass[SharePlan]):
    name = "share-duplicates"
    description = "an operator repeating an earlier one's work is replaced by it"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> SharePlan:
        readers, outputs = graph.consumers(), set(graph.outputs)
        seen: dict[tuple, Operator] = {}
        renamed: dict[int, int] = {}  # earlier renames, so chains of duplicates share too
        renames = []
        for op in graph.operators:
            if op.code not in SHAREABLE:
                continue
            key = _key(graph, op, renamed)
            first = seen.setdefault(key, op)
            if first is op:
                continue
            pairs = list(zip(op.outputs, first.outputs))
            read = any(readers.get(out) for out, _ in pairs)
            if read and not any(out in outputs for out, _ in pairs):
                renames += pairs
                renamed.update(pairs)
        return SharePlan((), tuple(renames))

    def transform(self, graph: CircleGraph, plan: SharePlan) -> PassResult:
        renamed = dict(plan.renames)
        for op in graph.operators:
            op.inputs = [renamed.get(i, i) for i in op.inputs]
        return PassResult(bool(plan.renames), {"shared": _operators(plan, graph)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).renames
        assert not left, f"{len(left)} duplicate operator output(s) still read"


def _operators(plan: SharePlan, graph: CircleGraph) -> int:
    """How many operators the plan makes redundant (each may have several outputs)."""
    producers = graph.producers()
    return len({id(producers[out]) for out, _ in plan.renames if out in producers})


def _key(graph: CircleGraph, op: Operator, renamed: dict[int, int]) -> tuple:
    """What ``op`` computes: its kind, options, inputs (constants by value) and the type
    of each output."""
    inputs = []
    for index in op.inputs:
        index = renamed.get(index, index)
        tensor = graph.tensors[index] if index >= 0 else None
        if tensor is not None and tensor.data is not None:
            inputs.append(_constant_key(tensor))
        else:
            inputs.append(index)
    outputs = tuple(
        (t.dtype.str, t.shape, t.shape_signature, t.quantization)
        for t in (graph.tensors[i] for i in op.outputs)
    )
    return (op.code, _options(op.options), tuple(inputs), outputs)


#: Constants up to this size are compared by value (shapes, axes, scalars); larger ones
#: (weights) by the storage they come from: their bytes as a key would copy every weight.
BY_VALUE_BYTES = 4096


def _constant_key(tensor) -> tuple:
    data = tensor.data
    if data.nbytes <= BY_VALUE_BYTES:
        data = np.ascontiguousarray(data)
        return ("constant", data.dtype.str, data.shape, data.tobytes())
    if tensor.buffer_key is not None:  # one torch storage, one view of it
        return ("buffer", tensor.buffer_key)
    return ("array", id(data))  # equal only to itself: conservative, never wrong


def _options(options: object) -> object:
    """A comparable form of an options object (its fields; arrays as tuples)."""
    if options is None:
        return None
    fields = []
    for name, value in sorted(vars(options).items()):
        if isinstance(value, np.ndarray):
            value = tuple(value.tolist())
        elif isinstance(value, list):
            value = tuple(value)
        fields.append((name, value))
    return (type(options).__name__, tuple(fields))
