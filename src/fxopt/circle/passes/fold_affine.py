"""fold-affine: a per-channel MUL / ADD by constants next to a FULLY_CONNECTED or an unpadded
CONV_2D goes into its weights.

Before the operator (a LayerNorm's affine, then a linear layer: ``(x * s + t) @ Wᵀ + c``):
the weights become ``W * s`` (each input channel scaled) and the bias ``c + W @ t``. After
a FULLY_CONNECTED (ConvNeXt's and CaiT's layer scale: ``γ * (x @ Wᵀ + c)``, possibly through
a RESHAPE that keeps the last dim): ``γ W`` and ``γ c``. Channels are the last axis (FC
inputs, NHWC convolutions). Each folded operator must be read by nothing else, except a
MUL all of whose readers are such operators (an RMSNorm's weight before q, k and v): it
goes into each of them. The constants must vary along the channel axis only. A padded
convolution is left alone: its padding is zeros, not ``t``, so the bias would be wrong at
the borders. Rounding changes as with BatchNorm folding (one product instead of two).

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

import numpy as np

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.view import CircleRulePass
from fxopt.ir.pattern import Match, Op, Var
from fxopt.passes.rules import Rule

_VALID = 1  # Padding.VALID


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
    weight = graph.tensors[op.inputs[1]] if len(op.inputs) > 1 else None
    if op.code not in ("FULLY_CONNECTED", "CONV_2D") or weight is None or weight.data is None:
        return False
    if weight.packed is not None:  # ggml blocks: scaling them would change the format
        return False
    return op.code == "FULLY_CONNECTED" or op.options.padding == _VALID


def _activation(op: Operator) -> int:
    return getattr(op.options, "fusedActivationFunction", 0)


class AffineBefore(Rule):
    """(x * s + t) @ Wᵀ + c → x @ (W s)ᵀ + (c + W t), one MUL or ADD at a time."""

    name, stat = "MUL / ADD into the weights after it", "folded"
    pattern = Op(("FULLY_CONNECTED", "CONV_2D"), Op(("MUL", "ADD"), bind="affine"))

    def applies(self, match: Match) -> bool:
        graph, op, affine = match.graph, match.root, match["affine"]
        if not _is_weighted(op, graph) or _activation(affine):
            return False
        channels = graph.tensors[op.inputs[1]].shape[-1]
        return _constant_operand(graph, affine, channels) is not None

    def build(self, graph: CircleGraph, match: Match) -> Operator:
        _fold_before(graph, match.root, match["affine"])
        return match.root  # changed in place; the MUL / ADD is read no more


class ScaleIntoEveryReader(Rule):
    """x * s read by several FC / CONV_2D (an RMSNorm's weight before q, k and v) → each
    reads x, its weights scaled by s. Only when every reader takes it: one left reading
    the MUL would keep it, and the copies would cost weights for nothing."""

    name, stat = "MUL into the weights of every reader", "folded"
    pattern = Op("MUL", bind="affine")

    def applies(self, match: Match) -> bool:
        graph, scale = match.graph, match.root
        readers = graph.consumers().get(scale.outputs[0], [])
        if len(readers) < 2 or _activation(scale) or scale.outputs[0] in graph.outputs:
            return False
        for reader in readers:
            if not _is_weighted(reader, graph) or reader.inputs[0] != scale.outputs[0]:
                return False
            if reader.inputs[1] == scale.outputs[0] or (
                len(reader.inputs) > 2 and reader.inputs[2] == scale.outputs[0]
            ):
                return False
        channels = {graph.tensors[r.inputs[1]].shape[-1] for r in readers}
        return len(channels) == 1 and _constant_operand(graph, scale, channels.pop()) is not None

    def build(self, graph: CircleGraph, match: Match) -> int:
        scale = match.root
        source = scale.inputs[_constant_operand(graph, scale, _last_dim(graph, scale))[0]]
        for reader in graph.consumers()[scale.outputs[0]]:
            _fold_before(graph, reader, scale)
        return source  # read by no one now: the MUL goes


def _last_dim(graph: CircleGraph, op: Operator) -> int:
    return graph.tensors[op.outputs[0]].shape[-1]


class LayerScaleAfter(Rule):
    """γ * (x @ Wᵀ + c) → x @ (γ W)ᵀ + γ c, also through a RESHAPE keeping the last dim."""

    name, stat = "layer-scale MUL into the FULLY_CONNECTED before it", "folded"
    pattern = Op(
        "MUL",
        Op("RESHAPE", Op("FULLY_CONNECTED", bind="fc"), optional=0, bind="reshape"),
        Var("scale"),
        commutative=True,
    )

    def applies(self, match: Match) -> bool:
        graph, fc, scale = match.graph, match["fc"], match.root
        if _activation(scale) or _activation(fc) or not _is_weighted(fc, graph):
            return False  # (γ·relu(z) is not relu(γ·z))
        channels = graph.tensors[fc.inputs[1]].shape[0]
        reshape = match.get("reshape")
        if reshape is not None and graph.tensors[reshape.outputs[0]].shape[-1] != channels:
            return False
        return _constant_operand(graph, scale, channels) is not None

    def build(self, graph: CircleGraph, match: Match) -> int:
        return _fold_after(graph, match["fc"], match.root)


class FoldAffine(CircleRulePass):
    name = "fold-affine"
    description = "a per-channel MUL / ADD by constants next to FC or CONV_2D into its weights"
    counters, leftovers = ("folded",), "foldable MUL/ADD next to FC/CONV_2D"
    repeat = True  # a LayerNorm's ADD folded, its MUL is next to the FC
    rules = (AffineBefore(), ScaleIntoEveryReader(), LayerScaleAfter())


def _constant_operand(graph: CircleGraph, op: Operator, channels: int):
    """(position of the non-constant operand, the constant as a channel vector) of a binary
    MUL / ADD with one constant operand, or None."""
    for position in (0, 1):
        vector = _channel_vector(graph, op.inputs[1 - position], channels)
        if vector is not None and graph.tensors[op.inputs[position]].data is None:
            return position, vector
    return None


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


def _fold_after(graph: CircleGraph, op: Operator, scale: Operator) -> int:
    weight = graph.tensors[op.inputs[1]].data  # [out, in]
    position, vector = _constant_operand(graph, scale, weight.shape[0])
    bias = _bias(graph, op, weight.shape[0], np.float64)
    _set_weights(graph, op, _scaled(weight, vector[:, None]), bias * vector.astype(np.float64))
    return scale.inputs[position]  # the MUL passes it through: its readers read it instead
