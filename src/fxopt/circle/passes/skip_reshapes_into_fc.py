"""skip-reshapes-into-fc: a FULLY_CONNECTED reads past a RESHAPE that keeps the last dim.

FULLY_CONNECTED flattens its input to ``[-1, K]`` itself, so a RESHAPE in front of it that
keeps the last dim ``K`` changes nothing it computes; neither does one in front of an
elementwise unary op (GELU, RELU, ...) whose only reader is the FULLY_CONNECTED. The pattern
is the MLP of a channels-last block (ConvNeXt): FC → RESHAPE back to [N, H, W, C] → GELU →
FC. The FULLY_CONNECTED (through the unary op) then reads the RESHAPE's input, and
remove-dead-ops drops the RESHAPE when nothing else reads it.

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
    >>> SkipReshapesIntoFC()(g).stats, g.operators[1].inputs  # GELU reads x
    ({'skipped': 1}, [0])
"""

from __future__ import annotations

from dataclasses import dataclass

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan

#: Elementwise unary operators (one input, same shape out): a RESHAPE commutes with them.
UNARY = ("GELU", "RELU", "RELU6", "LOGISTIC", "TANH", "ABS", "NEG", "EXP", "SQRT", "RSQRT")


@dataclass(frozen=True)
class SkipPlan(Plan):
    # (FC operator index, unary operator index or -1, the tensor to read instead)
    rewires: tuple[tuple[int, int, int], ...] = ()


class SkipReshapesIntoFC(Pass[SkipPlan]):
    name = "skip-reshapes-into-fc"
    description = "a FULLY_CONNECTED reads past a RESHAPE that keeps the last dim"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> SkipPlan:
        producers, readers = graph.producers(), graph.consumers()
        index_of = {id(op): i for i, op in enumerate(graph.operators)}

        def reshape_source(tensor: int) -> int | None:
            op = producers.get(tensor)
            if op is None or op.code != "RESHAPE":
                return None
            source = op.inputs[0]
            same_last = graph.tensors[source].shape[-1:] == graph.tensors[tensor].shape[-1:]
            return source if same_last else None

        rewires = []
        for i, op in enumerate(graph.operators):
            if op.code != "FULLY_CONNECTED":
                continue
            source = reshape_source(op.inputs[0])
            if source is not None:
                rewires.append((i, -1, source))
                continue
            unary = producers.get(op.inputs[0])
            if unary is None or unary.code not in UNARY:
                continue
            if graph.sole_reader(op.inputs[0], readers) is None:
                continue
            source = reshape_source(unary.inputs[0])
            if source is not None and len(readers.get(unary.inputs[0], ())) == 1:
                rewires.append((i, index_of[id(unary)], source))
        return SkipPlan((), tuple(rewires))

    def transform(self, graph: CircleGraph, plan: SkipPlan) -> PassResult:
        for fc_index, unary_index, source in plan.rewires:
            fc = graph.operators[fc_index]
            if unary_index < 0:
                fc.inputs = [source, *fc.inputs[1:]]
                continue
            unary = graph.operators[unary_index]
            old = graph.tensors[unary.outputs[0]]
            shaped = graph.tensors[source]
            out = graph.add_tensor(old.name, shaped.shape, old.dtype)
            unary.inputs = [source, *unary.inputs[1:]]
            unary.outputs = [out]
            fc.inputs = [out, *fc.inputs[1:]]
        return PassResult(bool(plan.rewires), {"skipped": len(plan.rewires)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).rewires
        assert not left, f"{len(left)} FULLY_CONNECTED still read through a RESHAPE"
