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
    >>> MergeReshapes()(g).stats, [op.inputs for op in g.operators]
    ({'merged': 1, 'bypassed': 0}, [[0]])
"""

from __future__ import annotations

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.view import CircleRulePass
from fxopt.ir.pattern import Match, Op, Var
from fxopt.passes.rules import Rewire, Rule

_CHAIN = Op("RESHAPE", Op("RESHAPE", Var("start"), optional=0))


class IdentityReshape(Rule):
    """A RESHAPE (of a chain of them) to its start's own type: its readers read the start."""

    name, stat = "reshape to its own type", "bypassed"
    keeps_inputs = True  # a RESHAPE in the chain stays while something else reads it
    pattern = _CHAIN

    def applies(self, match: Match) -> bool:
        return _same_tensor_type(match.graph, match["start"], match.root.outputs[0])

    def replace_with(self, match: Match) -> int:
        return match["start"]


class ReshapeOfReshape(Rule):
    name, stat = "reshape of a reshape", "merged"
    keeps_inputs = True
    pattern = Op("RESHAPE", Op("RESHAPE", Var("start")))

    def replace_with(self, match: Match) -> Rewire:
        return Rewire({0: match["start"]})


class MergeReshapes(CircleRulePass):
    name = "merge-reshapes"
    description = "a RESHAPE of a RESHAPE reads the first one's input; identity RESHAPEs go"
    counters, leftovers = ("merged", "bypassed"), "RESHAPE chains or identity RESHAPEs"
    rules = (IdentityReshape(), ReshapeOfReshape())


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
