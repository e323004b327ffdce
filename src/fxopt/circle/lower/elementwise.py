"""Elementwise lowerings: binary arithmetic, comparisons, activations, casts, select.

All are layout-agnostic: operands are read in the layout planned for the result (an NHWC
residual add stays NHWC), constants are stored in that layout, and lower-rank operands are
broadcast the way torch broadcasts them.
"""

from __future__ import annotations

import numpy as np
import torch
from circle_schema.v0_10.circle import (
    AddOptions,
    CastOptions,
    DivOptions,
    GeluOptions,
    LeakyReluOptions,
    MulOptions,
    SubOptions,
)
from torch import fx

from fxopt.circle.build import tensor_type
from fxopt.circle.lower.context import LoweringContext, Unlowerable, np_dtype
from fxopt.ir import ops

_OPTIONS = {
    "ADD": AddOptions.AddOptionsT,
    "SUB": SubOptions.SubOptionsT,
    "MUL": MulOptions.MulOptionsT,
    "DIV": DivOptions.DivOptionsT,
}


def _compute_dtype(ctx: LoweringContext, operands: list) -> np.dtype:
    """torch's type promotion of the operands (the dtype Circle computes in)."""
    values = [o.meta["val"] if isinstance(o, fx.Node) else o for o in operands]
    if all(isinstance(v, torch.Tensor) and v.ndim == 0 for v in values):
        return np_dtype(torch.result_type(*values))
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if len(values) == 1:
        return np_dtype(tensors[0].dtype)
    return np_dtype(
        torch.result_type(values[0], values[1]) if len(values) == 2 else tensors[0].dtype
    )


def _operand(
    ctx: LoweringContext, value, node: fx.Node, dtype: np.dtype, *, mask: bool = False
) -> int:
    """``value`` as an operand of ``node``'s op, in its layout and ``dtype``. ``mask``: the
    operand may be an attention mask value, which ``legalize_causal_mask_value`` bounds."""
    perm, rank = ctx.perm(node), len(ctx.shape(node))
    bound = ctx.config.legalize_causal_mask_value and mask and dtype.kind == "f"
    if bound and not isinstance(value, fx.Node) and value == float("-inf"):
        value = MASK_VALUE
    elif bound and isinstance(value, fx.Node) and value.op == "get_attr":
        array = ctx.constant_value(value).cpu().numpy()
        if np.isneginf(array).any():
            return ctx.const_cast(value, dtype, perm, rank, edit=_bounded)
    index = ctx.input_broadcast(value, perm, rank, dtype=dtype)
    if isinstance(value, fx.Node) and ctx.dtype(value) != dtype:
        if value.op == "get_attr":  # an int or bool constant in a float op: cast it now
            return ctx.const_cast(value, dtype, perm, rank)
        index = cast(ctx, index, ctx.graph.tensors[index].shape, ctx.dtype(value), dtype)
    return index


#: What ``legalize_causal_mask_value`` puts where a mask holds ``-inf`` (TICO's value):
#: softmax gives a masked position a weight of about exp(-120) ≈ 8e-53 of the row's
#: largest instead of exactly 0 (invisible in float32 unless every logit is below -100),
#: and a quantizer sees a finite range.
MASK_VALUE = -120.0


def _bounded(array: np.ndarray) -> np.ndarray:
    return np.where(np.isneginf(array), np.asarray(MASK_VALUE, array.dtype), array)


def cast(ctx: LoweringContext, index: int, shape, source: np.dtype, target: np.dtype) -> int:
    options = CastOptions.CastOptionsT()
    options.inDataType, options.outDataType = tensor_type(source), tensor_type(target)
    out = ctx.tensor(shape, target, "cast")
    ctx.emit("CAST", [index], [out], options)
    return out


def binary(code: str, *, compare: bool = False, swap: bool = False):
    """``a OP b`` → ``code``; comparisons compute in the promoted dtype, return bool."""

    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        a, b = node.args[0], node.args[1]
        if swap:  # rsub(a, b) = b - a
            a, b = b, a
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            raise Unlowerable(f"alpha={alpha}")
        dtype = _compute_dtype(ctx, [a, b]) if compare else ctx.dtype(node)
        mask = code == "ADD"  # scores + mask
        inputs = [
            _operand(ctx, a, node, dtype, mask=mask),
            _operand(ctx, b, node, dtype, mask=mask),
        ]
        options = _OPTIONS[code]() if code in _OPTIONS else None
        ctx.emit(code, inputs, [ctx.result(node)], options)

    lower.__name__ = f"lower_{code.lower()}"
    return lower


def lower_div(ctx: LoweringContext, node: fx.Node) -> None:
    """``a / b`` → DIV; an integer ``a // b`` (``rounding_mode="floor"``) → FLOOR_DIV, which
    onert 0.1.0 and LiteRT run on int32 only (measured: int64 fails to prepare in both)."""
    mode = node.kwargs.get("rounding_mode")
    if mode is None or ctx.val(node).is_floating_point():
        binary("DIV")(ctx, node)
        return
    dtype = ctx.dtype(node)
    if mode != "floor":
        raise Unlowerable("integer division rounding toward zero (rounding_mode='trunc')")
    if dtype != np.int32:
        raise Unlowerable(
            f"integer floor division of {np.dtype(dtype).name} (FLOOR_DIV runs on int32 only "
            "in onert and LiteRT): divide int32 tensors"
        )
    a, b = (_operand(ctx, v, node, dtype) for v in node.args[:2])
    ctx.emit("FLOOR_DIV", [a, b], [ctx.result(node)])


def unary(code: str, options_factory=None):
    """``f(x)`` → ``code`` in the input's layout."""

    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        x = _operand(ctx, node.args[0], node, ctx.dtype(node))
        options = options_factory(node) if options_factory else None
        ctx.emit(code, [x], [ctx.result(node)], options)

    lower.__name__ = f"lower_{code.lower()}"
    return lower


def lower_reciprocal(ctx: LoweringContext, node: fx.Node) -> None:
    """``1 / x``: DIV by a constant one."""
    dtype = ctx.dtype(node)
    x = _operand(ctx, node.args[0], node, dtype)
    ctx.emit("DIV", [ctx.scalar(1, dtype), x], [ctx.result(node)], DivOptions.DivOptionsT())


def lower_ceil(ctx: LoweringContext, node: fx.Node) -> None:
    """``-floor(-x)``: onert 0.1.0 has no CEIL kernel (measured), FLOOR and NEG it has."""
    dtype = ctx.dtype(node)
    x = _operand(ctx, node.args[0], node, dtype)
    shape = ctx.graph.tensors[x].shape
    negated, floored = ctx.tensor(shape, dtype, "neg"), ctx.tensor(shape, dtype, "floor")
    ctx.emit("NEG", [x], [negated])
    ctx.emit("FLOOR", [negated], [floored])
    ctx.emit("NEG", [floored], [ctx.result(node)])


def _gelu_options(node: fx.Node):
    options = GeluOptions.GeluOptionsT()
    options.approximate = node.kwargs.get("approximate", "none") == "tanh"
    return options


lower_gelu = unary("GELU", _gelu_options)


def lower_leaky_relu(ctx: LoweringContext, node: fx.Node) -> None:
    options = LeakyReluOptions.LeakyReluOptionsT()
    options.alpha = float(ops.args(node)["negative_slope"])
    ctx.emit(
        "LEAKY_RELU",
        [_operand(ctx, node.args[0], node, ctx.dtype(node))],
        [ctx.result(node)],
        options,
    )


def _clamp(ctx: LoweringContext, node: fx.Node, low, high) -> None:
    """clamp / hardtanh: RELU6 / RELU when the bounds match, else MAXIMUM / MINIMUM.
    (Not RELU_N1_TO_1 for [-1, 1]: onert 0.1.0 has no kernel for it standing alone.)"""
    dtype = ctx.dtype(node)
    x = _operand(ctx, node.args[0], node, dtype)
    out = ctx.result(node)
    named = {(0.0, 6.0): "RELU6", (0.0, None): "RELU"}
    key = (None if low is None else float(low), None if high is None else float(high))
    if key in named and dtype == np.float32:
        ctx.emit(named[key], [x], [out])
        return
    shape = ctx.graph.tensors[out].shape
    if low is not None and high is not None:
        mid = ctx.tensor(shape, dtype, "clamp_low")
        ctx.emit("MAXIMUM", [x, ctx.scalar(low, dtype)], [mid])
        ctx.emit("MINIMUM", [mid, ctx.scalar(high, dtype)], [out])
    elif low is not None:
        ctx.emit("MAXIMUM", [x, ctx.scalar(low, dtype)], [out])
    elif high is not None:
        ctx.emit("MINIMUM", [x, ctx.scalar(high, dtype)], [out])
    else:
        raise Unlowerable("clamp without bounds")


def lower_clamp(ctx: LoweringContext, node: fx.Node) -> None:
    packet = node.target._overloadpacket.__name__
    if any(isinstance(a, fx.Node) for a in node.args[1:]):
        raise Unlowerable("clamp with tensor bounds")
    if packet == "clamp_min":
        _clamp(ctx, node, node.args[1], None)
    elif packet == "clamp_max":
        _clamp(ctx, node, None, node.args[1])
    else:
        args = ops.args(node)
        _clamp(ctx, node, args["min"], args["max"])


def lower_hardtanh(ctx: LoweringContext, node: fx.Node) -> None:
    args = ops.args(node)
    _clamp(ctx, node, args["min_val"], args["max_val"])


def lower_relu6(ctx: LoweringContext, node: fx.Node) -> None:
    _clamp(ctx, node, 0.0, 6.0)


def lower_silu(ctx: LoweringContext, node: fx.Node) -> None:
    x = _operand(ctx, node.args[0], node, ctx.dtype(node))
    out = ctx.result(node)
    gate = ctx.tensor(ctx.graph.tensors[out].shape, ctx.dtype(node), "sigmoid")
    ctx.emit("LOGISTIC", [x], [gate])
    ctx.emit("MUL", [x, gate], [out], MulOptions.MulOptionsT())


def _hardsigmoid(ctx: LoweringContext, x: int, shape, dtype, out: int) -> None:
    """relu6(x + 3) / 6: ADD, RELU6, MUL."""
    shifted, clipped = ctx.tensor(shape, dtype, "hs_add"), ctx.tensor(shape, dtype, "hs_relu6")
    ctx.emit("ADD", [x, ctx.scalar(3.0, dtype)], [shifted], AddOptions.AddOptionsT())
    ctx.emit("RELU6", [shifted], [clipped])
    ctx.emit("MUL", [clipped, ctx.scalar(1.0 / 6.0, dtype)], [out], MulOptions.MulOptionsT())


def lower_hardsigmoid(ctx: LoweringContext, node: fx.Node) -> None:
    dtype = ctx.dtype(node)
    x = _operand(ctx, node.args[0], node, dtype)
    out = ctx.result(node)
    _hardsigmoid(ctx, x, ctx.graph.tensors[out].shape, dtype, out)


def lower_hardswish(ctx: LoweringContext, node: fx.Node) -> None:
    """x * hardsigmoid(x). Circle has HARD_SWISH, but onert 0.1.0 refuses to load it
    ("Unsupported operation: HARD_SWISH"): four ops that run beat one that does not."""
    dtype = ctx.dtype(node)
    x = _operand(ctx, node.args[0], node, dtype)
    out = ctx.result(node)
    shape = ctx.graph.tensors[out].shape
    gate = ctx.tensor(shape, dtype, "hs_gate")
    _hardsigmoid(ctx, x, shape, dtype, gate)
    ctx.emit("MUL", [x, gate], [out], MulOptions.MulOptionsT())


def lower_pow(ctx: LoweringContext, node: fx.Node) -> None:
    exponent = node.args[1]
    if exponent == 2:  # x * x: exact, and runs everywhere POW does not
        x = _operand(ctx, node.args[0], node, ctx.dtype(node))
        ctx.emit("MUL", [x, x], [ctx.result(node)], MulOptions.MulOptionsT())
        return
    binary("POW")(ctx, node)


def lower_to(ctx: LoweringContext, node: fx.Node) -> None:
    """_to_copy: CAST when the dtype changes, else the same tensor."""
    source = node.args[0]
    target = ctx.dtype(node)
    if ctx.dtype(source) == target:
        index = ctx.input(source, ctx.perm(node))
        ctx.bind(node, index, ctx.perm(node))
        return
    x = ctx.input(source, ctx.perm(node))
    out = ctx.result(node)
    options = CastOptions.CastOptionsT()
    options.inDataType, options.outDataType = tensor_type(ctx.dtype(source)), tensor_type(target)
    ctx.emit("CAST", [x], [out], options)


def lower_where(ctx: LoweringContext, node: fx.Node) -> None:
    """SELECT_V2; none when the condition is a constant that picks one side everywhere
    (a mask of all True, as transformers builds for inputs without padding) and that side
    already has the result's shape and dtype."""
    condition, a, b = node.args
    dtype = ctx.dtype(node)
    if isinstance(condition, fx.Node) and ctx.is_constant(condition):
        value = ctx.constant_value(condition)
        side = a if bool(value.all()) else b if not bool(value.any()) else None
        if (
            isinstance(side, fx.Node)
            and not ctx.is_constant(side)
            and ctx.shape(side) == ctx.shape(node)
            and ctx.dtype(side) == dtype
        ):
            ctx.bind(node, ctx.input(side, ctx.held_perm(side)), ctx.held_perm(side))
            return
    perm, rank = ctx.perm(node), len(ctx.shape(node))
    inputs = [ctx.input_broadcast(condition, perm, rank, dtype=np.bool_)]
    inputs += [_operand(ctx, a, node, dtype, mask=True), _operand(ctx, b, node, dtype, mask=True)]
    ctx.emit("SELECT_V2", inputs, [ctx.result(node)])


def lower_masked_fill(ctx: LoweringContext, node: fx.Node) -> None:
    x, mask, value = node.args
    dtype = ctx.dtype(node)
    perm, rank = ctx.perm(node), len(ctx.shape(node))
    inputs = [ctx.input_broadcast(mask, perm, rank, dtype=np.bool_)]
    inputs += [_operand(ctx, value, node, dtype, mask=True), _operand(ctx, x, node, dtype)]
    ctx.emit("SELECT_V2", inputs, [ctx.result(node)])


def lower_logical_not(ctx: LoweringContext, node: fx.Node) -> None:
    if ctx.dtype(node.args[0]) != np.bool_:
        raise Unlowerable("bitwise_not of a non-bool tensor")
    ctx.emit("LOGICAL_NOT", [ctx.input(node.args[0], ctx.perm(node))], [ctx.result(node)])


def logical(code: str):
    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        if any(isinstance(a, fx.Node) and ctx.dtype(a) != np.bool_ for a in node.args[:2]):
            raise Unlowerable("bitwise op on a non-bool tensor")
        binary(code)(ctx, node)

    lower.__name__ = f"lower_{code.lower()}"
    return lower
