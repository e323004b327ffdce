"""propagate-quantization: move DEQUANTIZE past operators that do not change values, and
drop DEQUANTIZE→QUANTIZE round trips that give back the same integers.

A RESHAPE or TRANSPOSE moves values without changing them, so it computes the same on
the integer tensor as on its dequantized floats: ``T(dequantize(q)) == dequantize(T(q))``
exactly. So does a PAD (zeros around the values): the integer kernel pads with the zero
point, which is the real 0. A PADV2 whose value lies at or below the grid's lowest value
(a max-pool's padding: the lowest float) pads with the type's minimum instead; a max over
a window that holds a real value then picks the same value either way. Moving the
DEQUANTIZE after it makes the layout work of an NHWC CNN and the flatten before a
classifier run on one byte per value,
and brings the DEQUANTIZE next to the QUANTIZE that usually follows. A QUANTIZE of a
DEQUANTIZE with the integer tensor's own type and parameters gives back that tensor:
its readers read the integer tensor instead (the pair becomes dead for remove-dead-ops).

Only operators onert runs in the tensor's integer type move
(:mod:`fxopt.circle.onert_quantized`).

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph, Quantization
    >>> g = CircleGraph()
    >>> q8 = Quantization((0.1,), (128,))
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> xq = g.add_tensor("xq", (2, 3), np.uint8, quantization=q8)
    >>> xf = g.add_tensor("xf", (2, 3), np.float32)
    >>> r = g.add_tensor("r", (6,), np.float32)
    >>> rq = g.add_tensor("rq", (6,), np.uint8, quantization=q8)
    >>> out = g.add_tensor("out", (6,), np.float32)
    >>> g.add_op("QUANTIZE", [x], [xq])
    >>> g.add_op("DEQUANTIZE", [xq], [xf])
    >>> g.add_op("RESHAPE", [xf], [r])
    >>> g.add_op("QUANTIZE", [r], [rq])
    >>> g.add_op("DEQUANTIZE", [rq], [out])
    >>> g.inputs, g.outputs = [x], [out]
    >>> PropagateQuantization()(g).stats
    {'moved': 0, 'hoisted': 1, 'round_trips': 1}
    >>> from fxopt.circle.passes.remove_dead_ops import RemoveDeadOps
    >>> _ = RemoveDeadOps()(g)
    >>> [op.code for op in g.operators]
    ['QUANTIZE', 'RESHAPE', 'DEQUANTIZE']
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.onert_quantized import runs
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan

#: Operators whose output holds the values of their first input, only moved or regrouped
#: (PAD: and zeros, which every quantization grid holds exactly).
VALUE_PRESERVING = ("RESHAPE", "TRANSPOSE", "PAD")


@dataclass(frozen=True)
class PropagatePlan(Plan):
    moves: tuple[int, ...] = ()  # operators to run on the integer tensor before them
    hoists: tuple[int, ...] = ()  # QUANTIZEs to run before the operator that feeds them
    round_trips: tuple[int, ...] = ()  # QUANTIZEs that give back their source


class PropagateQuantization(Pass[PropagatePlan]):
    name = "propagate-quantization"
    description = (
        "DEQUANTIZE moved after and QUANTIZE before RESHAPE/TRANSPOSE/PAD; round trips dropped"
    )
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> PropagatePlan:
        producers, readers = graph.producers(), graph.consumers()
        moves, hoists, round_trips = [], [], []
        for index, op in enumerate(graph.operators):
            source = producers.get(op.inputs[0]) if op.inputs else None
            if op.code == "QUANTIZE" and _hoistable(graph, op, source, readers):
                hoists.append(index)
            if source is None or source.code != "DEQUANTIZE":
                continue
            integer = graph.tensors[source.inputs[0]]
            movable = op.code in VALUE_PRESERVING or _pads_below_grid(graph, op, integer)
            if movable and runs(op.code, integer.dtype.name):
                # Other readers of the DEQUANTIZE keep it (a residual block's input feeds
                # a padded conv and the shortcut); this reader runs on the integers.
                moves.append(index)
            elif (
                op.code == "QUANTIZE"
                and _same_type(graph, source.inputs[0], op.outputs[0])
                and op.outputs[0] not in graph.outputs
                and op.outputs[0] in readers
            ):
                round_trips.append(index)
        return PropagatePlan((), tuple(moves), tuple(hoists), tuple(round_trips))

    def transform(self, graph: CircleGraph, plan: PropagatePlan) -> PassResult:
        moved = hoisted = dropped = 0
        while plan.moves or plan.hoists or plan.round_trips:  # a move enables the next one
            producers = graph.producers()
            # Round trips first (indices stay valid): the QUANTIZE's readers read the
            # integer tensor.
            renamed = {
                graph.operators[i].outputs[0]: producers[graph.operators[i].inputs[0]].inputs[0]
                for i in plan.round_trips
            }
            for op in graph.operators:
                op.inputs = [renamed.get(i, i) for i in op.inputs]
            # Hoists swap two operators in place; the moves, from the last, each insert
            # one DEQUANTIZE after their operator.
            position = {id(op): i for i, op in enumerate(graph.operators)}
            for index in plan.hoists:
                _hoist(graph, index, position[id(producers[graph.operators[index].inputs[0]])])
            if not plan.hoists:
                for index in sorted(plan.moves, reverse=True):
                    _move_after(graph, graph.operators[index], index, producers)
                moved += len(plan.moves)
            hoisted, dropped = hoisted + len(plan.hoists), dropped + len(renamed)
            plan = self.analyze(graph)
        stats = {"moved": moved, "hoisted": hoisted, "round_trips": dropped}
        return PassResult(bool(moved or hoisted or dropped), stats)

    def verify(self, graph: CircleGraph) -> None:
        plan = self.analyze(graph)
        left = len(plan.moves) + len(plan.hoists) + len(plan.round_trips)
        assert not left, f"{left} DEQUANTIZE(s) left to move or drop"


def _hoistable(graph: CircleGraph, quantize: Operator, source, readers) -> bool:
    """QUANTIZE(op(x)) can be op(QUANTIZE(x)): ``op`` moves values without changing them,
    runs in the integer type, and neither ``x`` nor ``op``'s output is read elsewhere."""
    if source is None or source.code not in VALUE_PRESERVING:
        return False
    integer = graph.tensors[quantize.outputs[0]]
    return (
        graph.sole_reader(source.outputs[0], readers) is quantize
        and graph.sole_reader(source.inputs[0], readers) is source
        and graph.tensors[source.inputs[0]].data is None
        and runs(source.code, integer.dtype.name)
    )


def _hoist(graph: CircleGraph, index: int, at: int) -> None:
    """``QUANTIZE(op(x))`` → ``op(QUANTIZE(x))``: the QUANTIZE (at ``index``) takes the
    place of ``op`` (at ``at``), which reads its new integer tensor and writes the old
    QUANTIZE output."""
    quantize, op = graph.operators[index], graph.operators[at]
    early = _integer_like(graph, op.inputs[0], quantize.outputs[0])
    final = quantize.outputs[0]
    quantize.inputs, quantize.outputs = [op.inputs[0]], [early]
    op.inputs, op.outputs = [early, *op.inputs[1:]], [final]
    graph.operators[at], graph.operators[index] = quantize, op


def _integer_like(graph: CircleGraph, shaped: int, typed: int) -> int:
    """A new tensor with the shape of float tensor ``shaped`` and the integer type and
    quantization of ``typed``."""
    like, integer = graph.tensors[shaped], graph.tensors[typed]
    return graph.add_tensor(
        f"{like.name}_q",
        like.shape,
        integer.dtype,
        shape_signature=like.shape_signature,
        quantization=integer.quantization,
    )


def _same_type(graph: CircleGraph, a: int, b: int) -> bool:
    ta, tb = graph.tensors[a], graph.tensors[b]
    return ta.dtype == tb.dtype and ta.quantization == tb.quantization


def _pads_below_grid(graph: CircleGraph, op: Operator, integer) -> bool:
    """A PADV2 of ``integer``'s dequantized values with a constant at or below the lowest
    value its grid holds (what a max-pool's padding is)."""
    if op.code != "PADV2" or len(op.inputs) < 3 or integer.quantization is None:
        return False
    value = graph.tensors[op.inputs[2]].data
    q = integer.quantization
    if value is None or value.size != 1 or q.per_channel or integer.dtype.kind not in "iu":
        return False
    lowest = (np.iinfo(integer.dtype).min - q.zero_point[0]) * q.scale[0]
    return float(value.reshape(-1)[0]) <= lowest


def _move_after(graph: CircleGraph, op: Operator, index: int, producers: dict) -> None:
    """``op(DEQUANTIZE(q))`` → ``DEQUANTIZE(op(q))``: ``op`` reads ``q`` into a new integer
    tensor with ``q``'s type, and a DEQUANTIZE after it writes ``op``'s old output (a
    PADV2 pads with the type's minimum)."""
    dequantize = producers[op.inputs[0]]
    moved = _integer_like(graph, op.outputs[0], dequantize.inputs[0])
    float_out = op.outputs[0]
    if op.code == "PADV2":
        integer = graph.tensors[dequantize.inputs[0]]
        value = graph.tensors[op.inputs[2]]
        lowest = np.full(value.data.shape, np.iinfo(integer.dtype).min, integer.dtype)
        op.inputs[2] = graph.add_tensor(
            f"{value.name}_q", value.shape, integer.dtype, lowest, quantization=integer.quantization
        )
    op.inputs = [dequantize.inputs[0], *op.inputs[1:]]
    op.outputs = [moved]
    graph.operators.insert(index + 1, Operator("DEQUANTIZE", [moved], [float_out]))
