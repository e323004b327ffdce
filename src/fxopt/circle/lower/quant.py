"""Quantize and dequantize: PT2E's ``quantized_decomposed`` ops → Circle QUANTIZE /
DEQUANTIZE, the integer tensor between them carrying its scale and zero point.

Lowered one to one, a quantized graph is a float graph with QUANTIZE→DEQUANTIZE round
trips: it computes exactly what the quantized model computes, operator by operator. The
Circle passes ``propagate-quantization`` and ``quantize-operators`` then move the integer
tensors into the operators that run quantized. Weight dequantizes are gone before this
(``quantized-weights``); a dequantize here reads an activation.

int8 tensors are written as uint8, zero point + 128, when the config's ``int8_as_uint8``
is on (the same real values: ``s * (q - z) == s * ((q + 128) - (z + 128))``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import fx

from fxopt.circle.graph import Quantization
from fxopt.circle.lower.context import LoweringContext, Unlowerable, permuted, static_shape

_RANGES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-32768, 32767)}
_NP = {torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16}


def _scalar(ctx: LoweringContext, value: object, what: str) -> float:
    if isinstance(value, fx.Node):
        if value.op != "get_attr":
            raise Unlowerable(f"a computed {what} (dynamic quantization)")
        value = ctx.constant_value(value)
    tensor = torch.as_tensor(value)
    if tensor.numel() != 1:
        raise Unlowerable(f"per-channel quantization of a computed tensor ({what})")
    return float(tensor)


def integer_type(
    ctx: LoweringContext, dtype: torch.dtype, scale: float, zero_point: int, qmin, qmax
) -> tuple[np.dtype, Quantization]:
    """The Circle tensor type and parameters for values quantized to ``dtype`` in
    ``[qmin, qmax]``; Unlowerable when Circle cannot express that range."""
    if dtype not in _RANGES:
        raise Unlowerable(f"quantization to {dtype} (Circle files take int8, uint8, int16)")
    if (qmin, qmax) != _RANGES[dtype]:
        # QUANTIZE clamps to the type's range; a narrower range is a clamp Circle lacks.
        raise Unlowerable(f"activation quantization range [{qmin}, {qmax}] narrower than {dtype}'s")
    if dtype == torch.int8 and ctx.config.int8_as_uint8:
        return np.dtype(np.uint8), Quantization((scale,), (zero_point + 128,))
    return np.dtype(_NP[dtype]), Quantization((scale,), (zero_point,))


def lower_quantize(ctx: LoweringContext, node: fx.Node) -> None:
    """quantize_per_tensor(x, scale, zero_point, qmin, qmax, dtype) → QUANTIZE."""
    if "per_channel" in str(node.target):
        raise Unlowerable("per-channel quantization of a computed tensor")
    x, scale, zero_point, qmin, qmax, dtype = node.args[:6]
    scale = _scalar(ctx, scale, "scale")
    zero_point = int(_scalar(ctx, zero_point, "zero point"))
    circle_dtype, quantization = integer_type(ctx, dtype, scale, zero_point, qmin, qmax)
    perm = ctx.perm(node)
    held = ctx.input(x, perm)
    shape, signature = static_shape(ctx.val(node).shape)
    out = ctx.graph.add_tensor(
        node.name,
        permuted(shape, perm),
        circle_dtype,
        shape_signature=permuted(signature, perm) if signature else None,
        quantization=quantization,
    )
    ctx.values[node] = (out, perm)
    ctx.emit("QUANTIZE", [held], [out])


def lower_dequantize(ctx: LoweringContext, node: fx.Node) -> None:
    """dequantize_per_tensor(q, scale, zero_point, qmin, qmax, dtype) → DEQUANTIZE of the
    integer tensor, whose parameters must be the ones given here."""
    if "per_channel" in str(node.target):
        raise Unlowerable("per-channel dequantization of a computed tensor")
    q, scale, zero_point, qmin, qmax, dtype = node.args[:6]
    perm = ctx.perm(node)
    held = ctx.input(q, perm)
    tensor = ctx.graph.tensors[held]
    _, expected = integer_type(
        ctx,
        dtype,
        _scalar(ctx, scale, "scale"),
        int(_scalar(ctx, zero_point, "zero point")),
        qmin,
        qmax,
    )
    if tensor.quantization is None:
        raise Unlowerable("dequantize of an integer input of the model (feed float inputs)")
    if tensor.quantization != expected:
        raise Unlowerable(
            f"dequantize with scale/zero point {expected.scale[0]:g}/{expected.zero_point[0]} "
            f"of a tensor quantized with {tensor.quantization.scale[0]:g}/"
            f"{tensor.quantization.zero_point[0]}"
        )
    ctx.emit("DEQUANTIZE", [held], [ctx.result(node, perm)])


def lower_fake_quantize(ctx: LoweringContext, node: fx.Node) -> None:
    """fake_quantize_per_tensor_affine(x, scale, zero_point, qmin, qmax) → QUANTIZE then
    DEQUANTIZE: the integer type is the narrowest that holds [qmin, qmax]."""
    if "per_channel" in str(node.target):
        raise Unlowerable("per-channel fake quantization of a computed tensor")
    x, scale, zero_point, qmin, qmax = node.args[:5]
    dtype = next((d for d, (lo, hi) in _RANGES.items() if lo <= qmin and qmax <= hi), None)
    if dtype is None:
        raise Unlowerable(f"fake quantization to [{qmin}, {qmax}]: wider than int16")
    scale = _scalar(ctx, scale, "scale")
    zero_point = int(_scalar(ctx, zero_point, "zero point"))
    circle_dtype, quantization = integer_type(ctx, dtype, scale, zero_point, qmin, qmax)
    perm = ctx.perm(node)
    held = ctx.input(x, perm)
    out = ctx.result(node, perm)
    shape = ctx.graph.tensors[out].shape
    q = ctx.graph.add_tensor(f"{node.name}_q", shape, circle_dtype, quantization=quantization)
    ctx.emit("QUANTIZE", [held], [q])
    ctx.emit("DEQUANTIZE", [q], [out])
