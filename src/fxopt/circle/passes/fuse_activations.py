"""fuse-activations: an activation becomes its producer's ``fusedActivationFunction``.

RELU / RELU6 / RELU_N1_TO_1 whose input is the only use of a CONV_2D, DEPTHWISE_CONV_2D,
FULLY_CONNECTED, ADD, SUB, MUL, DIV or pool output: one kernel and one tensor fewer. Not
when the producer's output is a graph output (fusing would change it), is read by anything
else, or already has an activation, or when the two dtypes differ.

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

from dataclasses import dataclass

from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType as Act

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan, Skip

ACTIVATIONS = {
    "RELU": Act.RELU,
    "RELU6": Act.RELU6,
    "RELU_N1_TO_1": Act.RELU_N1_TO_1,
    # TANH is a legal fused activation in the schema, but onert 0.1.0 fails at run time
    # with "Unsupported fused activation function" (measured on FC + tanh): not fused.
}
FUSIBLE = frozenset(
    (
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
)


@dataclass(frozen=True)
class Fusion:
    producer: int  # operator indices in graph.operators
    activation: int
    function: int  # ActivationFunctionType


@dataclass(frozen=True)
class FusionPlan(Plan):
    fusions: tuple[Fusion, ...] = ()


class FuseActivations(Pass[FusionPlan]):
    name = "fuse-activations"
    description = "RELU/RELU6/RELU_N1_TO_1 into the CONV_2D/FC/ADD/pool that feeds it"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> FusionPlan:
        producers = {t: i for i, op in enumerate(graph.operators) for t in op.outputs}
        users = graph.consumers()
        fused: set[int] = set()  # producers this plan already gives an activation
        fusions, skipped = [], []
        for index, op in enumerate(graph.operators):
            function = ACTIVATIONS.get(op.code)
            if function is None:
                continue
            source = op.inputs[0]
            producer = producers.get(source)
            reason = _why_not(graph, op, producer, users.get(source, []), fused)
            if reason:
                skipped.append(Skip(_label(graph, op), reason))
                continue
            assert producer is not None
            fused.add(producer)
            producers[op.outputs[0]] = producer  # a following activation sees the fusion
            fusions.append(Fusion(producer, index, function))
        return FusionPlan(tuple(skipped), tuple(fusions))

    def transform(self, graph: CircleGraph, plan: FusionPlan) -> PassResult:
        operators = graph.operators
        for fusion in plan.fusions:
            producer, activation = operators[fusion.producer], operators[fusion.activation]
            producer.options.fusedActivationFunction = fusion.function
            producer.outputs = [activation.outputs[0]]
        gone = {fusion.activation for fusion in plan.fusions}
        graph.operators = [op for i, op in enumerate(operators) if i not in gone]
        return PassResult(bool(gone), {"fused": len(gone)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).fusions
        assert not left, f"{len(left)} activation(s) still fusible after fuse-activations"


def _why_not(
    graph: CircleGraph, op: Operator, producer: int | None, readers: list, fused: set[int]
) -> str:
    if producer is None:
        return "its input is a graph input or a constant, not an operator's output"
    code = graph.operators[producer].code
    if code not in FUSIBLE:
        return f"its producer {code} has no fused activation"
    if len(readers) != 1:
        return f"its input is read by {len(readers)} operators; fusing changes the others"
    if op.inputs[0] in graph.outputs:
        return "its input is a graph output; fusing would change that output"
    options = graph.operators[producer].options
    if producer in fused or getattr(options, "fusedActivationFunction", None) != Act.NONE:
        return f"its producer {code} already has a fused activation"
    if graph.tensors[op.inputs[0]].dtype != graph.tensors[op.outputs[0]].dtype:
        return "its input and output dtypes differ"
    return ""


def _label(graph: CircleGraph, op: Operator) -> str:
    """An operator's name in reports: its code and first output tensor."""
    return f"{op.code} → {graph.tensors[op.outputs[0]].name}"
