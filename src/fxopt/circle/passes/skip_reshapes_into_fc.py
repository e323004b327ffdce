"""skip-reshapes-into-fc: a FULLY_CONNECTED reads past a RESHAPE that keeps the last dim.

FULLY_CONNECTED flattens its input to ``[-1, K]`` itself, so a RESHAPE in front of it that
keeps the last dim ``K`` changes nothing it computes; neither does one in front of an
elementwise unary op (GELU, RELU, ...) whose only reader is the FULLY_CONNECTED. The pattern
is the MLP of a channels-last block (ConvNeXt): FC → RESHAPE back to [N, H, W, C] → GELU →
FC. The FULLY_CONNECTED (through the unary op) then reads the RESHAPE's input, and the
RESHAPE goes when nothing else reads it.

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x, r = g.add_tensor("x", (6, 4), np.float32), g.add_tensor("r", (1, 2, 3, 4), np.float32)
    >>> a, y = g.add_tensor("a", (1, 2, 3, 4), np.float32), g.add_tensor("y", (6, 5), np.float32)
    >>> w = g.add_tensor("w", (5, 4), np.float32, np.ones((5, 4), np.float32))
    >>> g.add_op("RESHAPE", [x], [r]); g.add_op("GELU", [r], [a])
    >>> g.add_op("FULLY_CONNECTED", [a, w, -1], [y], FullyConnectedOptionsT())
    >>> g.inputs, g.outputs = [x], [y]
    >>> SkipReshapesIntoFC()(g).stats, [(op.code, op.inputs[0]) for op in g.operators]
    ({'skipped': 1}, [('GELU', 0), ('FULLY_CONNECTED', 5)])
"""

from __future__ import annotations

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.view import CircleRulePass
from fxopt.ir.pattern import Match, Op, Var
from fxopt.passes.rules import Rewire, Rule

#: Elementwise unary operators (one input, same shape out): a RESHAPE commutes with them.
UNARY = ("GELU", "RELU", "RELU6", "LOGISTIC", "TANH", "ABS", "NEG", "EXP", "SQRT", "RSQRT")

_RESHAPE = Op("RESHAPE", Var("source"), bind="reshape")


def _keeps_last_dim(match: Match) -> bool:
    tensors, reshape = match.graph.tensors, match["reshape"]
    source = tensors[match["source"]].shape
    if tensors[match.root.inputs[1]].packed is not None and len(source) != 2:
        return False  # onert's kernel for ggml weights does not flatten its input
    return source[-1:] == tensors[reshape.outputs[0]].shape[-1:]


class ReshapeIntoFC(Rule):
    name, stat = "FULLY_CONNECTED reads past a RESHAPE", "skipped"
    keeps_inputs = True  # the RESHAPE stays while something else reads it
    pattern = Op("FULLY_CONNECTED", _RESHAPE)

    def applies(self, match: Match) -> bool:
        return _keeps_last_dim(match)

    def replace_with(self, match: Match) -> Rewire:
        return Rewire({0: match["source"]})


class ReshapeThroughUnaryIntoFC(Rule):
    """FC(unary(RESHAPE(x))) → FC(unary(x)): the unary op then computes on x's shape."""

    name, stat = "FULLY_CONNECTED reads past a unary op's RESHAPE", "skipped"
    pattern = Op("FULLY_CONNECTED", Op(UNARY, _RESHAPE, bind="unary"))

    def applies(self, match: Match) -> bool:
        return _keeps_last_dim(match)

    def build(self, graph: CircleGraph, match: Match):
        fc, unary, source = match.root, match["unary"], match["source"]
        old, shaped = graph.tensors[unary.outputs[0]], graph.tensors[source]
        out = graph.add_tensor(old.name, shaped.shape, old.dtype)
        unary.inputs = [source, *unary.inputs[1:]]
        unary.outputs = [out]
        fc.inputs = [out, *fc.inputs[1:]]
        return fc  # changed in place


class SkipReshapesIntoFC(CircleRulePass):
    name = "skip-reshapes-into-fc"
    description = "a FULLY_CONNECTED reads past a RESHAPE that keeps the last dim"
    counters, leftovers = ("skipped",), "FULLY_CONNECTEDs read through a RESHAPE"
    rules = (ReshapeIntoFC(), ReshapeThroughUnaryIntoFC())
