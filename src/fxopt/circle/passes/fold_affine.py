"""fold-affine: a per-channel MUL / ADD by constants next to a FULLY_CONNECTED or an unpadded
CONV_2D goes into its weights.

Before the operator (a LayerNorm's affine, then a linear layer: ``(x * s + t) @ Wᵀ + c``):
the weights become ``W * s`` (each input channel scaled) and the bias ``c + W @ t``. After
a FULLY_CONNECTED (ConvNeXt's and CaiT's layer scale: ``γ * (x @ Wᵀ + c)``, possibly through
a RESHAPE that keeps the last dim): ``γ W`` and ``γ c``. Channels are the last axis (FC
inputs, NHWC convolutions). Each folded operator must be read by nothing else, and the
constants must vary along the channel axis only. A padded convolution is left alone: its
padding is zeros, not ``t``, so the bias would be wrong at the borders. Rounding changes as
with BatchNorm folding (one product instead of two).

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
    >>> from circle_schema.v0_10.circle.MulOptions import MulOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x, y, z = (g.add_tensor(n, (2, 3), np.float32) for n in "xyz")
    >>> s = g.add_tensor("s", (3,), np.float32, np.asarray([1, 2, 3], np.float32))
    >>> w = g.add_tensor("w", (3, 3), np.float32, np.eye(3, dtype=np.float32))
    >>> g.add_op("MUL", [x, s], [y], MulOptionsT())
    >>> g.add_op("FULLY_CONNECTED", [y, w, -1], [z], FullyConnectedOptionsT())
    >>> g.inputs, g.outputs = [x], [z]
    >>> FoldAffine()(g).stats, [op.code for op in g.operators], g.operators[0].inputs[0]
    ({'folded': 1}, ['FULLY_CONNECTED'], 0)
    >>> g.tensors[g.operators[0].inputs[1]].data[1]  # the weight's columns scaled
    array([0., 2., 0.], dtype=float32)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan

_VALID = 1  # Padding.VALID


@dataclass(frozen=True)
class FoldPlan(Plan):
    # (weighted operator index, the elementwise operator index, "before" or "after")
    folds: tuple[tuple[int, int, str], ...] = ()


def _channel_vector(graph: CircleGraph, index: int, channels: int) -> np.ndarray | None:
    """The constant at ``index`` as a [channels] vector, when it varies along the last axis
    only (or is a scalar); else None."""
    tensor = graph.tensors[index] if index >= 0 else None
    if tensor is None or tensor.data is None or tensor.data.dtype.kind != "f":
        return None
    data = tensor.data
    if data.size == 1:
        return np.full(channels, data.reshape(()), data.dtype)
    if data.shape[-1] != channels or data.size != channels:
        return None
    return data.reshape(channels)


def _is_weighted(op: Operator, graph: CircleGraph) -> bool:
    """A FULLY_CONNECTED or an unpadded CONV_2D with constant weights (a fused activation
    acts on the output: folding into the input side keeps it)."""
    if op.code not in ("FULLY_CONNECTED", "CONV_2D") or graph.tensors[op.inputs[1]].data is None:
        return False
    return op.code == "FULLY_CONNECTED" or op.options.padding == _VALID


class FoldAffine(Pass[FoldPlan]):
    name = "fold-affine"
    description = "a per-channel MUL / ADD by constants next to FC or CONV_2D into its weights"
    graph_kind = CIRCLE

    def analyze(self, graph: CircleGraph) -> FoldPlan:
        producers, readers = graph.producers(), graph.consumers()
        index_of = {id(op): i for i, op in enumerate(graph.operators)}

        folds, used = [], set()
        for i, op in enumerate(graph.operators):
            if not _is_weighted(op, graph):
                continue
            channels = graph.tensors[op.inputs[1]].shape[-1]
            source = producers.get(op.inputs[0])
            if (
                source is not None
                and source.code in ("MUL", "ADD")
                and graph.sole_reader(op.inputs[0], readers) is op
                and not getattr(source.options, "fusedActivationFunction", 0)
                and _constant_operand(graph, source, channels) is not None
                and id(source) not in used
            ):
                folds.append((i, index_of[id(source)], "before"))
                used.add(id(source))
            if op.code == "FULLY_CONNECTED":
                after = _layer_scale(graph, op, readers)
                if after is not None and id(after) not in used:
                    folds.append((i, index_of[id(after)], "after"))
                    used.add(id(after))
        return FoldPlan((), tuple(folds))

    def transform(self, graph: CircleGraph, plan: FoldPlan) -> PassResult:
        """Fold, drop the folded operators, and again: a LayerNorm's MUL then ADD fold one
        after the other into the same weights."""
        folded = 0
        while plan.folds:
            dead = set()
            for weighted_index, elementwise_index, where in plan.folds:
                op = graph.operators[weighted_index]
                elementwise = graph.operators[elementwise_index]
                fold = _fold_before if where == "before" else _fold_after
                fold(graph, op, elementwise)
                dead.add(id(elementwise))
            graph.operators = [op for op in graph.operators if id(op) not in dead]
            folded += len(plan.folds)
            plan = self.analyze(graph)
        return PassResult(bool(folded), {"folded": folded})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).folds
        assert not left, f"{len(left)} foldable MUL/ADD left next to FC/CONV_2D"


def _constant_operand(graph: CircleGraph, op: Operator, channels: int):
    """(position of the non-constant operand, the constant as a channel vector) of a binary
    MUL / ADD with one constant operand, or None."""
    for position in (0, 1):
        vector = _channel_vector(graph, op.inputs[1 - position], channels)
        if vector is not None and graph.tensors[op.inputs[position]].data is None:
            return position, vector
    return None


def _layer_scale(graph, op: Operator, readers) -> Operator | None:
    """The MUL by a constant channel vector that alone reads ``op``'s output (directly or
    through a RESHAPE keeping the last dim)."""
    if getattr(op.options, "fusedActivationFunction", 0):  # γ·relu(z) is not relu(γ·z)
        return None
    out = op.outputs[0]
    channels = graph.tensors[op.inputs[1]].shape[0]
    user = graph.sole_reader(out, readers)
    if user is not None and user.code == "RESHAPE":
        reshaped = user.outputs[0]
        if graph.tensors[reshaped].shape[-1] != channels:
            return None
        user = graph.sole_reader(reshaped, readers)
    if user is None or user.code != "MUL" or getattr(user.options, "fusedActivationFunction", 0):
        return None
    return user if _constant_operand(graph, user, channels) is not None else None


def _bias(graph: CircleGraph, op: Operator, outputs: int, dtype) -> np.ndarray:
    index = op.inputs[2] if len(op.inputs) > 2 else -1
    if index < 0:
        return np.zeros(outputs, dtype)
    return graph.tensors[index].data.astype(np.float64)


def _set_weights(graph: CircleGraph, op: Operator, weight: np.ndarray, bias: np.ndarray) -> None:
    """New constants (the old ones may be shared: tied weights)."""
    old = graph.tensors[op.inputs[1]]
    w = graph.add_tensor(
        f"{old.name}_folded", old.shape, old.dtype, np.asarray(weight, dtype=old.dtype)
    )
    b = graph.add_tensor(f"{old.name}_bias_folded", bias.shape, old.dtype, bias.astype(old.dtype))
    op.inputs = [op.inputs[0], w, b]


def _fold_before(graph: CircleGraph, op: Operator, elementwise: Operator) -> None:
    weight = graph.tensors[op.inputs[1]].data  # [out, (kh, kw,) in]
    channels = weight.shape[-1]
    position, vector = _constant_operand(graph, elementwise, channels)
    bias = _bias(graph, op, weight.shape[0], np.float64)
    if elementwise.code == "MUL":
        weight = _scaled(weight, vector)
    else:  # ADD: every output sums the constant through the kernel
        bias = bias + _row_sums(weight, vector.astype(np.float64))
    _set_weights(graph, op, weight, bias)
    op.inputs[0] = elementwise.inputs[position]


def _scaled(weight: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """``weight * vector`` in the weight's dtype: one product per element is rounded once
    either way (the exact product of two float32 fits a float64), and a float64 copy of a
    large weight would cost twice its memory."""
    return weight * vector.astype(weight.dtype)


def _row_sums(weight: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """``(weight * vector).reshape(out, -1).sum(1)`` in float64, a block of rows at a time
    (a float64 copy of the whole weight would cost twice its memory)."""
    rows = weight.shape[0]
    block = max(1, (1 << 20) // max(1, weight[0].size))
    sums = np.empty(rows, np.float64)
    for start in range(0, rows, block):
        part = weight[start : start + block].astype(np.float64) * vector
        sums[start : start + block] = part.reshape(part.shape[0], -1).sum(1)
    return sums


def _fold_after(graph: CircleGraph, op: Operator, scale: Operator) -> None:
    weight = graph.tensors[op.inputs[1]].data  # [out, in]
    position, vector = _constant_operand(graph, scale, weight.shape[0])
    bias = _bias(graph, op, weight.shape[0], np.float64)
    _set_weights(graph, op, _scaled(weight, vector[:, None]), bias * vector.astype(np.float64))
    # The MUL now passes its input through: its readers read that input instead.
    replaced, kept = scale.outputs[0], scale.inputs[position]
    for other in graph.operators:
        other.inputs = [kept if i == replaced else i for i in other.inputs]
    graph.outputs = [kept if i == replaced else i for i in graph.outputs]
