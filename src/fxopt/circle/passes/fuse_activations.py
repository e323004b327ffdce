"""fuse-activations: an activation becomes its producer's ``fusedActivationFunction``.

RELU / RELU6 / RELU_N1_TO_1 whose input is the only use of a CONV_2D, DEPTHWISE_CONV_2D,
FULLY_CONNECTED, ADD, SUB, MUL, DIV or pool output: one kernel and one tensor fewer. Not
when the producer already has an activation or the two dtypes differ, nor (the rule
engine's refusal) when the producer's output is read by anything else or is a graph output.

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (1, 4), np.float32)
    >>> w = g.add_tensor("w", (2, 4), np.float32, np.ones((2, 4), np.float32))
    >>> h, y = g.add_tensor("h", (1, 2), np.float32), g.add_tensor("y", (1, 2), np.float32)
    >>> g.add_op("FULLY_CONNECTED", [x, w, -1], [h], FullyConnectedOptionsT())
    >>> g.add_op("RELU", [h], [y])
    >>> g.inputs, g.outputs = [x], [y]
    >>> FuseActivations()(g).stats, g.op_counts()
    ({'fused': 1}, {'FULLY_CONNECTED': 1})
"""

from __future__ import annotations

from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType as Act

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.view import CircleRulePass
from fxopt.ir.pattern import Match, Op, Var
from fxopt.passes.rules import Rule

ACTIVATIONS = {
    "RELU": Act.RELU,
    "RELU6": Act.RELU6,
    "RELU_N1_TO_1": Act.RELU_N1_TO_1,
    # TANH is a legal fused activation in the schema, but onert 0.1.0 fails at run time
    # with "Unsupported fused activation function" (measured on FC + tanh): not fused.
}
FUSIBLE = (
    "CONV_2D",
    "DEPTHWISE_CONV_2D",
    "FULLY_CONNECTED",
    "ADD",
    "SUB",
    "MUL",
    "DIV",
    "MAX_POOL_2D",
    "AVERAGE_POOL_2D",
)


class ActivationIntoProducer(Rule):
    name, stat = "activation into its producer", "fused"
    pattern = Op(ACTIVATIONS, Op(FUSIBLE, bind="producer"))
    near = Op(ACTIVATIONS, Op("*", bind="producer") | Var("input"))

    def near_miss(self, match: Match) -> str | None:
        producer = match.get("producer")
        if producer is None:
            return "its input is a graph input or a constant, not an operator's output"
        return f"its producer {producer.code} has no fused activation"

    def check(self, match: Match) -> str | None:
        producer = match["producer"]
        if getattr(producer.options, "fusedActivationFunction", None) != Act.NONE:
            return f"its producer {producer.code} already has a fused activation"
        tensors, activation = match.graph.tensors, match.root
        if tensors[activation.inputs[0]].dtype != tensors[activation.outputs[0]].dtype:
            return "its input and output dtypes differ"
        if producer.code == "FULLY_CONNECTED" and tensors[producer.inputs[1]].packed is not None:
            # measured: onert 0.1.0's kernel for ggml weights ignores a fused activation
            return "its producer is a FULLY_CONNECTED on ggml weights"
        return None

    def build(self, graph: CircleGraph, match: Match) -> None:
        producer, activation = match["producer"], match.root
        producer.options.fusedActivationFunction = ACTIVATIONS[activation.code]
        producer.outputs = [activation.outputs[0]]  # the activation goes


class FuseActivations(CircleRulePass):
    name = "fuse-activations"
    description = "RELU/RELU6/RELU_N1_TO_1 into the CONV_2D/FC/ADD/pool that feeds it"
    counters, leftovers = ("fused",), "fusible activations"
    rules = (ActivationIntoProducer(),)
