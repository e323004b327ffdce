"""broadcast-past-reshapes: an elementwise binary op reads past a RESHAPE that only adds or
drops leading 1s, when broadcasting gives it the same result shape.

A FULLY_CONNECTED returns ``[tokens, out]``; the model's ``[1, 1, out]`` comes back by a
RESHAPE before the residual ADD or the gate's MUL. For a binary op broadcasting
``[1, out]`` against its ``[1, 1, out]`` operand is the same computation: the op reads the
RESHAPE's input, and the RESHAPE goes when nothing else reads it (a decode step has one
after each FULLY_CONNECTED).

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.AddOptions import AddOptionsT
    >>> from circle_schema.v0_10.circle.ReshapeOptions import ReshapeOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x, r = g.add_tensor("x", (1, 4), np.float32), g.add_tensor("r", (1, 1, 4), np.float32)
    >>> y, z = g.add_tensor("y", (1, 1, 4), np.float32), g.add_tensor("z", (1, 1, 4), np.float32)
    >>> g.add_op("RESHAPE", [x], [r], ReshapeOptionsT())
    >>> g.add_op("ADD", [r, y], [z], AddOptionsT())
    >>> g.inputs, g.outputs = [x, y], [z]
    >>> BroadcastPastReshapes()(g).stats, [(op.code, op.inputs) for op in g.operators][-1]
    ({'skipped': 1}, ('ADD', [0, 2]))
"""

from __future__ import annotations

import numpy as np

from fxopt.circle.passes.view import CircleRulePass
from fxopt.ir.pattern import Match, Op, Var
from fxopt.passes.rules import Rewire, Rule

#: Elementwise binary operators that broadcast their operands (numpy's rules).
BINARY = ("ADD", "MUL", "SUB", "DIV", "MAXIMUM", "MINIMUM")


def _without_leading_ones(shape) -> tuple[int, ...]:
    shape = tuple(shape)
    while shape and shape[0] == 1:
        shape = shape[1:]
    return shape


def _dynamic(tensor) -> bool:
    return tensor.shape_signature is not None and -1 in tuple(tensor.shape_signature)


class BinaryPastReshape(Rule):
    name, stat = "elementwise op reads past a RESHAPE of leading 1s", "skipped"
    keeps_inputs = True  # the RESHAPE stays while something else reads it
    pattern = Op(
        BINARY, Op("RESHAPE", Var("source"), bind="reshape"), Var("other"), commutative=True
    )

    def applies(self, match: Match) -> bool:
        tensors, op, reshape = match.graph.tensors, match.root, match["reshape"]
        source, reshaped = tensors[match["source"]], tensors[reshape.outputs[0]]
        if source.quantization != reshaped.quantization or source.dtype != reshaped.dtype:
            return False
        involved = (source, reshaped, tensors[match["other"]], tensors[op.outputs[0]])
        if any(_dynamic(t) for t in involved):
            return False  # a dynamic dim is 1 in ``shape``: these 1s are not leading 1s
        if _without_leading_ones(source.shape) != _without_leading_ones(reshaped.shape):
            return False
        other = tensors[match["other"]].shape
        try:
            result = np.broadcast_shapes(tuple(source.shape), tuple(other))
        except ValueError:
            return False
        return result == tuple(tensors[op.outputs[0]].shape)

    def replace_with(self, match: Match) -> Rewire:
        position = match.root.inputs.index(match["reshape"].outputs[0])
        return Rewire({position: match["source"]})


class BroadcastPastReshapes(CircleRulePass):
    name = "broadcast-past-reshapes"
    description = "an elementwise binary op reads past a RESHAPE of leading 1s"
    counters, leftovers = ("skipped",), "binary ops reading a RESHAPE of leading 1s"
    rules = (BinaryPastReshape(),)
