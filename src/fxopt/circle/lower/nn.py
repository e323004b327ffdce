"""Layer lowerings: convolution, fully connected, matmul, pools, norms, softmax, embedding,
resize. Convs, pools and resizes read and write NHWC (see :mod:`fxopt.circle.layout`)."""

from __future__ import annotations

import math

import numpy as np
import torch
from circle_schema.v0_10.circle import (
    ActivationFunctionType,
    AddOptions,
    BatchMatMulOptions,
    ConcatenationOptions,
    Conv2DOptions,
    Conv3DOptions,
    DepthwiseConv2DOptions,
    FullyConnectedOptions,
    GatherOptions,
    LogSoftmaxOptions,
    MulOptions,
    Padding,
    Pool2DOptions,
    ReducerOptions,
    ResizeBilinearOptions,
    ResizeNearestNeighborOptions,
    SoftmaxOptions,
    SplitOptions,
    SubOptions,
    TransposeConvOptions,
)
from torch import fx

from fxopt.circle import layout as L
from fxopt.circle.lower.context import LoweringContext, Unlowerable, permuted, static_shape
from fxopt.ir import ops

_NONE = ActivationFunctionType.ActivationFunctionType.NONE


def _pair(value, n: int = 2) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value * n if len(value) == 1 else value


def _same_padding(size, kernel, stride, dilation, pad, out) -> bool:
    """True when torch's symmetric ``pad`` gives what Circle's SAME padding gives."""
    for i, k, s, d, p, o in zip(size, kernel, stride, dilation, pad, out):
        effective = d * (k - 1) + 1
        if o != math.ceil(i / s):
            return False
        total = max((o - 1) * s + effective - i, 0)
        if total // 2 != p:
            return False
    return True


def _explicit_pad(
    ctx: LoweringContext, x: int, shape, dtype, pad, value: float = 0.0, extra=(0, 0)
) -> int:
    """PAD an NHWC tensor by ``pad`` (h, w) on both sides, plus ``extra`` (h, w) after;
    PADV2 when the value is not 0."""
    n, h, w, c = shape
    pads = [[0, 0], [pad[0], pad[0] + extra[0]], [pad[1], pad[1] + extra[1]], [0, 0]]
    pads = np.asarray(pads, np.int32)
    out = ctx.tensor((n, h + pads[1].sum(), w + pads[2].sum(), c), dtype, "pad")
    if value == 0.0:
        ctx.emit("PAD", [x, ctx.const(pads, "pads")], [out])
    else:
        ctx.emit("PADV2", [x, ctx.const(pads, "pads"), ctx.scalar(value, dtype)], [out])
    return out


def _nhwc_out(ctx: LoweringContext, node: fx.Node, val) -> int:
    """The NHWC tensor for ``node``'s (first) 4-D result, bound to the node."""
    if isinstance(node.meta["val"], (tuple, list)):
        n, c, h, w = (int(d) for d in val.shape)
        index = ctx.tensor((n, h, w, c), ctx.dtype_of(val), node.name)
        ctx.values[node] = [(index, L.NHWC)] + [None] * (len(node.meta["val"]) - 1)
        return index
    return ctx.result(node, L.NHWC)


def lower_conv(ctx: LoweringContext, node: fx.Node) -> None:
    """2-D convolution → CONV_2D, DEPTHWISE_CONV_2D, or one CONV_2D per group (a SPLIT
    before, a CONCATENATION after) on NHWC. A weight computed at run time (or fed as an
    input) is transposed to OHWI in the file."""
    x, weight, bias, stride, padding, dilation, transposed, _, groups = node.args
    if transposed:
        lower_conv_transpose(ctx, node)
        return
    if len(ctx.shape(node)) == 5:
        lower_conv3d(ctx, node)
        return
    if len(ctx.shape(node)) != 4:
        raise Unlowerable(f"{len(ctx.shape(node)) - 2}-D convolution")
    out_channels, in_per_group, kh, kw = ctx.shape(weight)
    in_shape = ctx.shape(x)
    channels = in_shape[1]
    stride, dilation, pad = _pair(stride), _pair(dilation), _pair(padding)
    out_shape = ctx.shape(node)
    dtype = ctx.dtype(node)
    held = ctx.input(x, L.NHWC)
    size = (in_shape[2], in_shape[3])
    if any(pad) and not _same_padding(size, (kh, kw), stride, dilation, pad, out_shape[2:]):
        held = _explicit_pad(ctx, held, permuted(in_shape, L.NHWC), dtype, pad)
        mode = Padding.Padding.VALID
    else:
        mode = Padding.Padding.SAME if any(pad) else Padding.Padding.VALID
    bias_index, out = _conv_bias(ctx, node, bias, out_channels), ctx.result(node, L.NHWC)
    if groups == 1:
        code, options = "CONV_2D", Conv2DOptions.Conv2DOptionsT()
        filt = ctx.input(weight, (0, 2, 3, 1))  # OIHW → OHWI
    elif groups == channels and in_per_group == 1 and out_channels % channels == 0:
        code, options = "DEPTHWISE_CONV_2D", DepthwiseConv2DOptions.DepthwiseConv2DOptionsT()
        options.depthMultiplier = out_channels // channels
        filt = ctx.input(weight, (1, 2, 3, 0))  # OIHW (I = 1) → 1HWO
    else:
        filt = ctx.input(weight, (0, 2, 3, 1))

        def one_group(piece, group_filter, group_bias, group_out):
            options = _conv2d_options(mode, stride, dilation)
            ctx.emit("CONV_2D", [piece, group_filter, group_bias], [group_out], options)

        _grouped(ctx, node, (held, filt, bias_index, out), groups, 3, one_group)
        return
    options.padding = mode
    options.strideH, options.strideW = stride
    options.dilationHFactor, options.dilationWFactor = dilation
    options.fusedActivationFunction = _NONE
    ctx.emit(code, [held, filt, bias_index], [out], options)


def _conv2d_options(mode, stride, dilation) -> Conv2DOptions.Conv2DOptionsT:
    options = Conv2DOptions.Conv2DOptionsT()
    options.padding = mode
    options.strideH, options.strideW = stride
    options.dilationHFactor, options.dilationWFactor = dilation
    options.fusedActivationFunction = _NONE
    return options


def _conv_bias(ctx, node, bias, out_channels: int) -> int:
    """The bias operand: the model's, constant or computed at run time (onert and LiteRT
    take either: measured on TICO's conv tests), or zeros."""
    if bias is not None:
        return ctx.input(bias)
    return ctx.const(np.zeros(out_channels, ctx.dtype(node)), f"{node.name}_bias")


def _grouped(ctx, node, operands, groups: int, channel_axis: int, one_group) -> None:
    """1 < groups, not depthwise: convolution operators have no groups, so the input is
    SPLIT along channels (``channel_axis``), the filter along its output channels (axis 0
    of OHWI, the last of DHWIO), the bias alike; ``one_group(piece, filter, bias, out)``
    emits each group's operator, and a CONCATENATION joins the results into ``out``."""
    held, filt, bias, out = operands
    filter_axis = 0 if channel_axis == 3 else len(ctx.graph.tensors[filt].shape) - 1
    dtype = ctx.dtype(node)

    def split(index: int, axis: int, name: str) -> list[int]:
        source = ctx.graph.tensors[index]
        if source.data is not None:  # a constant: sliced at conversion
            return [
                ctx.const(np.ascontiguousarray(piece), f"{node.name}_{name}{g}")
                for g, piece in enumerate(np.split(source.data, groups, axis=axis))
            ]
        shape = list(source.shape)
        shape[axis] //= groups
        pieces = [ctx.tensor(tuple(shape), dtype, f"{node.name}_{name}{g}") for g in range(groups)]
        options = SplitOptions.SplitOptionsT()
        options.numSplits = groups
        axis_index = ctx.const(np.asarray([axis], np.int32), "axis")
        ctx.emit("SPLIT", [axis_index, index], pieces, options)
        return pieces

    pieces = split(held, channel_axis, "in")
    filters = split(filt, filter_axis, "w")
    biases = split(bias, 0, "b")
    out_shape = list(ctx.graph.tensors[out].shape)
    out_shape[channel_axis] //= groups
    outs = []
    for piece, group_filter, group_bias in zip(pieces, filters, biases):
        group_out = ctx.tensor(tuple(out_shape), dtype, f"{node.name}_out")
        one_group(piece, group_filter, group_bias, group_out)
        outs.append(group_out)
    concat = ConcatenationOptions.ConcatenationOptionsT()
    concat.axis = channel_axis
    ctx.emit("CONCATENATION", outs, [out], concat)


_NDHWC = (0, 2, 3, 4, 1)


def lower_conv3d(ctx: LoweringContext, node: fx.Node) -> None:
    """3-D convolution → CONV_3D on NDHWC (filter DHWIO), torch's symmetric padding as a
    PAD before it unless it is SAME's; groups as in :func:`_grouped`, a computed weight
    transposed in the file."""
    x, weight, bias, stride, padding, dilation, _, _, groups = node.args
    kernel = ctx.shape(weight)[2:]
    stride, dilation, pad = _pair(stride, 3), _pair(dilation, 3), _pair(padding, 3)
    in_shape, out_shape, dtype = ctx.shape(x), ctx.shape(node), ctx.dtype(node)
    held = ctx.input(x, _NDHWC)
    mode = Padding.Padding.VALID
    if any(pad) and _same_padding(in_shape[2:], kernel, stride, dilation, pad, out_shape[2:]):
        mode = Padding.Padding.SAME
    elif any(pad):
        pads = np.asarray([[0, 0], *([p, p] for p in pad), [0, 0]], np.int32)
        padded_shape = tuple(n + 2 * p for n, p in zip(permuted(in_shape, _NDHWC), (0, *pad, 0)))
        padded = ctx.tensor(padded_shape, dtype, "pad")
        ctx.emit("PAD", [held, ctx.const(pads, "pads")], [padded])
        held = padded

    def one_group(piece, group_filter, group_bias, group_out):
        options = Conv3DOptions.Conv3DOptionsT()
        options.padding = mode
        options.strideD, options.strideH, options.strideW = stride
        options.dilationDFactor, options.dilationHFactor, options.dilationWFactor = dilation
        options.fusedActivationFunction = _NONE
        ctx.emit("CONV_3D", [piece, group_filter, group_bias], [group_out], options)

    bias_index = _conv_bias(ctx, node, bias, ctx.shape(weight)[0])
    out = ctx.result(node, _NDHWC)
    filt = ctx.input(weight, (2, 3, 4, 1, 0))  # OIDHW → DHWIO
    if groups == 1:
        one_group(held, filt, bias_index, out)
    else:
        _grouped(ctx, node, (held, filt, bias_index, out), groups, 4, one_group)


def lower_conv_transpose(ctx: LoweringContext, node: fx.Node) -> None:
    """2-D transposed convolution → TRANSPOSE_CONV (VALID), then torch's ``padding``
    cropped with a SLICE, ``output_padding`` past the kernel's reach padded with zeros,
    and the bias ADDed after both. onert 0.1.0 has no TRANSPOSE_CONV kernel: such files
    are validated in LiteRT."""
    x, weight, bias, stride, padding, dilation, _, _, groups = node.args  # output size: meta
    if len(ctx.shape(node)) != 4:
        raise Unlowerable(f"{len(ctx.shape(node)) - 2}-D transposed convolution")
    if groups != 1 or _pair(dilation) != (1, 1):
        raise Unlowerable("grouped or dilated transposed convolution")
    if not ctx.is_constant(weight) or (bias is not None and not ctx.is_constant(bias)):
        raise Unlowerable("transposed convolution with non-constant weights")
    w = ctx.constant_value(weight)  # [in, out, kh, kw]
    _, out_channels, kh, kw = w.shape
    n, _, h, wd = ctx.shape(x)
    stride, pad = _pair(stride), _pair(padding)
    full = (n, (h - 1) * stride[0] + kh, (wd - 1) * stride[1] + kw, out_channels)
    out_shape = permuted(ctx.shape(node), L.NHWC)
    dtype = ctx.dtype(node)
    options = TransposeConvOptions.TransposeConvOptionsT()
    options.padding = Padding.Padding.VALID
    options.strideH, options.strideW = stride
    options.fusedActivationFunction = _NONE
    filt = ctx.const_tensor(w, (1, 2, 3, 0), name=str(weight.target))  # [out, kh, kw, in]
    shape = ctx.const(np.asarray(full, np.int32), "output_shape")
    exact = full == out_shape
    bias_index = ctx.input(bias) if bias is not None and exact else -1
    out = ctx.result(node, L.NHWC) if exact else ctx.tensor(full, dtype, "transpose_conv")
    ctx.emit("TRANSPOSE_CONV", [shape, filt, ctx.input(x, L.NHWC), bias_index], [out], options)
    if exact:
        return
    kept = (
        n,
        min(out_shape[1], full[1] - pad[0]),
        min(out_shape[2], full[2] - pad[1]),
        out_channels,
    )
    cropped = ctx.tensor(kept, dtype, "crop")
    begin = ctx.const(np.asarray([0, pad[0], pad[1], 0], np.int32), "begin")
    ctx.emit("SLICE", [out, begin, ctx.const(np.asarray(kept, np.int32), "size")], [cropped])
    if kept != out_shape:  # output_padding beyond the last kernel tap: zeros (+ bias)
        pads = [[0, 0], [0, out_shape[1] - kept[1]], [0, out_shape[2] - kept[2]], [0, 0]]
        padded = ctx.tensor(out_shape, dtype, "pad")
        ctx.emit("PAD", [cropped, ctx.const(np.asarray(pads, np.int32), "pads")], [padded])
        cropped = padded
    if bias is None:
        ctx.values[node] = (cropped, L.NHWC)
        return
    result = ctx.result(node, L.NHWC)
    ctx.emit("ADD", [cropped, ctx.input(bias)], [result], AddOptions.AddOptionsT())


def _pool(ctx, node, code, kernel, stride, pad, ceil_mode, *, include_pad=True) -> None:
    x = node.args[0]
    in_shape = ctx.shape(x)
    if len(in_shape) != 4:
        raise Unlowerable("pooling of a non-4-D tensor")
    val = node.meta["val"][0] if isinstance(node.meta["val"], (tuple, list)) else node.meta["val"]
    out_hw = tuple(int(d) for d in val.shape[2:])
    kernel = _pair(kernel)
    stride = _pair(stride) if stride else kernel
    pad = _pair(pad)
    floor_hw = tuple(
        (i + 2 * p - k) // s + 1 for i, k, s, p in zip(in_shape[2:], kernel, stride, pad)
    )
    dtype = ctx.dtype(x)
    held = ctx.input(x, L.NHWC)
    mode = Padding.Padding.VALID
    if ceil_mode and floor_hw != out_hw:
        if code != "MAX_POOL_2D":
            raise Unlowerable("average pool with ceil_mode=True that changes the output size")
        # One more window at the end: pad with -inf past the input so floor mode finds it.
        extra = tuple(
            (o - 1) * s + k - (i + 2 * p)
            for o, s, k, i, p in zip(out_hw, stride, kernel, in_shape[2:], pad)
        )
        held = _explicit_pad(ctx, held, permuted(in_shape, L.NHWC), dtype, pad, -np.inf, extra)
    elif any(pad):
        same = _same_padding(in_shape[2:], kernel, stride, (1, 1), pad, out_hw)
        if same and (code == "MAX_POOL_2D" or not include_pad):
            mode = Padding.Padding.SAME
        elif code == "AVERAGE_POOL_2D" and include_pad:
            held = _explicit_pad(ctx, held, permuted(in_shape, L.NHWC), dtype, pad)
        elif code == "MAX_POOL_2D":
            held = _explicit_pad(ctx, held, permuted(in_shape, L.NHWC), dtype, pad, -np.inf)
        else:
            raise Unlowerable("padded average pool with count_include_pad=False")
    options = Pool2DOptions.Pool2DOptionsT()
    options.padding = mode
    options.strideH, options.strideW = stride
    options.filterHeight, options.filterWidth = kernel
    options.fusedActivationFunction = _NONE
    ctx.emit(code, [held], [_nhwc_out(ctx, node, val)], options)


def lower_max_pool(ctx: LoweringContext, node: fx.Node) -> None:
    args = ops.args(node)
    if _pair(args["dilation"]) != (1, 1):
        raise Unlowerable("dilated max pool")
    _pool(
        ctx,
        node,
        "MAX_POOL_2D",
        args["kernel_size"],
        args["stride"],
        args["padding"],
        args["ceil_mode"],
    )


def lower_avg_pool(ctx: LoweringContext, node: fx.Node) -> None:
    args = ops.args(node)
    if args["divisor_override"] is not None:
        raise Unlowerable("avg_pool with divisor_override")
    _pool(
        ctx,
        node,
        "AVERAGE_POOL_2D",
        args["kernel_size"],
        args["stride"],
        args["padding"],
        args["ceil_mode"],
        include_pad=args["count_include_pad"],
    )


def lower_adaptive_avg_pool(ctx: LoweringContext, node: fx.Node) -> None:
    x = node.args[0]
    in_shape, out_shape = ctx.shape(x), ctx.shape(node)
    if len(in_shape) != 4:
        raise Unlowerable("adaptive pooling of a non-4-D tensor")
    held = ctx.input(x, L.NHWC)
    if out_shape[2:] == (1, 1):
        options = ReducerOptions.ReducerOptionsT()
        options.keepDims = True
        axes = ctx.const(np.asarray([1, 2], np.int32), "axes")
        ctx.emit("MEAN", [held, axes], [ctx.result(node, L.NHWC)], options)
        return
    if any(i % o for i, o in zip(in_shape[2:], out_shape[2:])):
        raise Unlowerable("adaptive pool whose output size does not divide the input size")
    kernel = tuple(i // o for i, o in zip(in_shape[2:], out_shape[2:]))
    options = Pool2DOptions.Pool2DOptionsT()
    options.padding = Padding.Padding.VALID
    options.strideH, options.strideW = kernel
    options.filterHeight, options.filterWidth = kernel
    ctx.emit("AVERAGE_POOL_2D", [held], [ctx.result(node, L.NHWC)], options)


def _fully_connected(ctx, node, x, weight_index, bias, out_rank, out=None) -> None:
    """FULLY_CONNECTED into ``out`` (default: ``node``'s result); a rank > 2 result is
    computed 2-D and reshaped back, because onert 0.1.0 ignores ``keepNumDims``
    (measured: [2, 3, 4] → [6, 8], not [2, 3, 8])."""
    options = FullyConnectedOptions.FullyConnectedOptionsT()
    options.fusedActivationFunction = _NONE
    options.keepNumDims = False
    out = ctx.result(node) if out is None else out
    if out_rank <= 2:
        ctx.emit("FULLY_CONNECTED", [x, weight_index, bias], [out], options)
        return
    shape, signature = static_shape(ctx.val(node).shape)
    if signature is not None and signature.count(-1) > 1:
        raise Unlowerable("linear on an input with more than one dynamic dimension")
    rows = (-1 if signature is not None else int(np.prod(shape[:-1])), shape[-1])
    flat = ctx.tensor(
        (int(np.prod(shape[:-1])), shape[-1]),
        ctx.dtype(node),
        "fc",
        signature=rows if signature is not None else None,
    )
    ctx.emit("FULLY_CONNECTED", [x, weight_index, bias], [flat], options)
    ctx.reshape(flat, signature or shape, ctx.dtype(node), out=out)


def lower_linear(ctx: LoweringContext, node: fx.Node) -> None:
    x, weight = node.args[0], node.args[1]
    bias = ops.args(node)["bias"]
    if ctx.is_constant(weight) and (bias is None or ctx.is_constant(bias)):
        bias_index = ctx.input(bias) if bias is not None else -1
        w = ctx.input(weight)
        _fully_connected(ctx, node, ctx.input(x), w, bias_index, len(ctx.shape(node)))
        return
    if bias is not None:
        raise Unlowerable("linear with a computed weight and a bias")
    # x @ wᵀ with the transpose in the file: onert 0.1.0 ignores BATCH_MATMUL's adjY
    # (measured: wrong values, or the wrong shape).
    options = BatchMatMulOptions.BatchMatMulOptionsT()
    options.adjX = options.adjY = False
    w_t = ctx.input(weight, (1, 0))
    ctx.emit("BATCH_MATMUL", [ctx.input(x), w_t], [ctx.result(node)], options)


def lower_ggml_linear(ctx: LoweringContext, node: fx.Node) -> None:
    """A linear with a ggml weight (:mod:`fxopt.quant.ggml`): FULLY_CONNECTED on the
    weight's blocks as they are, then ADD for the bias (onert's kernel for these weights
    takes none)."""
    args = ops.args(node)
    packed, bias = args["packed"], args["bias"]
    if not ctx.is_constant(packed) or (bias is not None and not ctx.is_constant(bias)):
        raise Unlowerable("ggml linear with a computed weight or bias")
    rows, cols = args["out_features"], ctx.shape(args["x"])[-1]
    weight = _ggml_constant(ctx, packed, args["kind"], (rows, cols))
    shape, signature = static_shape(ctx.val(node).shape)
    if signature is not None:
        raise Unlowerable("ggml linear on a dynamic shape")
    x = ctx.input(args["x"])
    if len(shape) != 2:  # onert's kernel for these weights does not flatten its input
        x = ctx.reshape(x, (int(np.prod(shape[:-1])), cols), ctx.dtype(args["x"]))
    if bias is None:
        _fully_connected(ctx, node, x, weight, -1, len(shape))
        return
    product = ctx.tensor(shape, ctx.dtype(node), "fc")
    _fully_connected(ctx, node, x, weight, -1, len(shape), out=product)
    bias_index = ctx.input_broadcast(bias, L.identity(len(shape)), len(shape))
    ctx.emit("ADD", [product, bias_index], [ctx.result(node)], AddOptions.AddOptionsT())


def lower_ggml_embedding(ctx: LoweringContext, node: fx.Node) -> None:
    """An embedding table in ggml blocks: GATHER on the blocks as they are."""
    from fxopt.circle.lower.elementwise import cast
    from fxopt.quant.ggml import BLOCK, BLOCK_BYTES

    args = ops.args(node)
    packed, dim, kind = args["packed"], args["dim"], args["kind"]
    if not ctx.is_constant(packed):
        raise Unlowerable("ggml embedding with a computed table")
    rows = ctx.shape(packed)[0] // (dim // BLOCK * BLOCK_BYTES[kind])
    table = _ggml_constant(ctx, packed, kind, (rows, dim))
    indices = args["indices"]
    held = ctx.input(indices)
    if ctx.dtype(indices) != np.int32:  # onert reads ggml tables with int32 indices only
        held = cast(ctx, held, ctx.shape(indices), ctx.dtype(indices), np.dtype(np.int32))
    options = GatherOptions.GatherOptionsT()
    options.axis = 0
    ctx.emit("GATHER", [table, held], [ctx.result(node)], options)


def _ggml_constant(ctx: LoweringContext, packed: fx.Node, kind: str, shape) -> int:
    """The Circle tensor of ggml blocks (their bytes as they are, typed by format); one
    per storage, so a head tied to its embedding table shares the table's buffer."""
    from fxopt.quant.ggml import CIRCLE_TYPES

    value = ctx.constant_value(packed).detach()
    key = ("ggml", value.untyped_storage().data_ptr(), kind, tuple(shape))
    found = ctx.graph_constant(key)
    if found is not None:
        return found
    index = ctx.graph.add_tensor(
        str(packed.target), tuple(shape), np.uint8, value.cpu().numpy(), buffer_key=key[:2]
    )
    ctx.graph.tensors[index].packed = CIRCLE_TYPES[kind]
    ctx.remember_constant(key, index)
    return index


def lower_addmm(ctx: LoweringContext, node: fx.Node) -> None:
    """``bias + a @ b`` (the decomposition moved any alpha/beta onto the operands):
    FULLY_CONNECTED for a constant weight and 1-D bias, else BATCH_MATMUL then ADD."""
    bias, a, b = node.args[:3]
    args = ops.args(node)
    if args["beta"] != 1 or args["alpha"] != 1:
        raise Unlowerable("addmm with beta or alpha")
    if ctx.is_constant(b) and ctx.is_constant(bias) and len(ctx.shape(bias)) == 1:
        w = ctx.constant_value(b)
        weight = ctx.const_tensor(w, (1, 0), name=str(b.target))
        _fully_connected(ctx, node, ctx.input(a), weight, ctx.input(bias), 2)
        return
    shape, dtype = ctx.shape(node), ctx.dtype(node)
    product = _matmul(ctx, a, b, ctx.tensor(shape, dtype, "mm"))
    bias_index = ctx.input_broadcast(bias, L.identity(2), 2)
    ctx.emit("ADD", [product, bias_index], [ctx.result(node)], AddOptions.AddOptionsT())


def _constant_matrix(ctx: LoweringContext, value) -> bool:
    """A constant 2-D operand (a weight), or a constant 3-D one with batch 1."""
    if not ctx.is_constant(value):
        return False
    shape = ctx.shape(value)
    return len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)


def _swap_last_two(rank: int) -> tuple[int, ...]:
    return (*range(rank - 2), rank - 1, rank - 2)


def _matmul(ctx: LoweringContext, a, b, out: int) -> int:
    """``a @ b`` into ``out``. A constant right operand is a FULLY_CONNECTED weight (with
    ``matmul_to_fully_connected``); a constant left one too, on the transposed problem
    ``(bᵀ aᵀ)ᵀ`` — onert 0.1.0 refuses a BATCH_MATMUL whose left operand is constant
    (measured: "OperationValidator failed" at load). Otherwise BATCH_MATMUL."""
    out_shape, dtype = ctx.graph.tensors[out].shape, ctx.graph.tensors[out].dtype
    fc = FullyConnectedOptions.FullyConnectedOptionsT()
    fc.fusedActivationFunction = _NONE
    if ctx.config.matmul_to_fully_connected and _constant_matrix(ctx, b):
        w = ctx.constant_value(b)
        weight = ctx.const_tensor(w.reshape(w.shape[-2:]), (1, 0), name=str(b.target))
        flat = ctx.tensor((int(np.prod(out_shape[:-1])), out_shape[-1]), dtype, "fc")
        ctx.emit("FULLY_CONNECTED", [ctx.input(a), weight, -1], [flat], fc)
        ctx.reshape(flat, out_shape, dtype, out=out)
        return out
    lhs_fc = ctx.config.const_lhs_matmul_to_fully_connected
    if lhs_fc and _constant_matrix(ctx, a) and not ctx.is_constant(b) and len(ctx.shape(b)) <= 3:
        w = ctx.constant_value(a)
        weight = ctx.const_tensor(w.reshape(w.shape[-2:]), name=str(a.target))  # [M, K]
        b_shape = ctx.shape(b)
        rank = len(b_shape)  # bᵀ: [.., N, K]
        b_t = ctx.transpose(ctx.input(b), b_shape, ctx.dtype(b), _swap_last_two(rank))
        rows = int(np.prod(b_shape[:-2], dtype=np.int64)) * b_shape[-1]
        flat = ctx.tensor((rows, out_shape[-2]), dtype, "fc")
        ctx.emit("FULLY_CONNECTED", [b_t, weight, -1], [flat], fc)  # [.. * N, M]
        held = (*out_shape[:-2], out_shape[-1], out_shape[-2])
        result_t = ctx.reshape(flat, held, dtype)
        back = ctx.transpose(result_t, held, dtype, _swap_last_two(len(held)))
        ctx.reshape(back, out_shape, dtype, out=out)
        return out
    options = BatchMatMulOptions.BatchMatMulOptionsT()
    options.adjX, options.adjY = False, False
    ctx.emit("BATCH_MATMUL", [ctx.input(a), ctx.input(b)], [out], options)
    return out


def lower_mm(ctx: LoweringContext, node: fx.Node) -> None:
    """mm / bmm / matmul (2-D or batched operands): see :func:`_matmul`."""
    a, b = node.args[:2]
    if len(ctx.shape(a)) < 2 or len(ctx.shape(b)) < 2:
        raise Unlowerable("matmul with a 1-D operand")
    _matmul(ctx, a, b, ctx.result(node))


def lower_batch_norm(ctx: LoweringContext, node: fx.Node) -> None:
    """BatchNorm at inference. With running statistics: ``x * scale + shift`` per channel
    (axis 1), both constants. With ``training=True`` (the statistics of the batch itself,
    as ``instance_norm`` decomposes to): normalized over every axis but the channels."""
    args = ops.args(node)
    if args is None:
        raise Unlowerable("batch_norm whose arguments cannot be read")
    x, weight, bias, eps = args["input"], args.get("weight"), args.get("bias"), args["eps"]
    if args.get("training"):
        _batch_statistics_norm(ctx, node, x, weight, bias, float(eps))
        return
    if not all(v is None or ctx.is_constant(v) for v in (weight, bias)):
        raise Unlowerable("batch_norm with a non-constant weight or bias")
    mean, var = args.get("running_mean"), args.get("running_var")
    if mean is None or var is None:
        raise Unlowerable("batch_norm in inference mode without running statistics")
    if not (ctx.is_constant(mean) and ctx.is_constant(var)):
        raise Unlowerable("batch_norm with non-constant statistics")
    mean_t, var_t = ctx.constant_value(mean).double(), ctx.constant_value(var).double()
    scale = torch.rsqrt(var_t + eps)
    if weight is not None:
        scale = scale * ctx.constant_value(weight).double()
    shift = -mean_t * scale
    if bias is not None:
        shift = shift + ctx.constant_value(bias).double()
    rank = len(ctx.shape(x))
    perm = ctx.held_perm(x)
    view = (1, -1) + (1,) * (rank - 2)
    dtype = ctx.dtype(x)
    held = ctx.input(x, perm)
    shape = permuted(ctx.shape(x), perm)

    def per_channel(t):
        return ctx.const(t.reshape(view).permute(perm).contiguous().numpy().astype(dtype))

    scaled = ctx.tensor(shape, dtype, "bn_scale")
    ctx.emit("MUL", [held, per_channel(scale)], [scaled], MulOptions.MulOptionsT())
    out = ctx.tensor(shape, dtype, node.name)
    ctx.emit("ADD", [scaled, per_channel(shift)], [out], AddOptions.AddOptionsT())
    ctx.values[node] = [(out, perm)] + [None] * (len(node.meta["val"]) - 1)


def _batch_statistics_norm(
    ctx: LoweringContext, node: fx.Node, x: fx.Node, weight, bias, eps: float
) -> None:
    """(x - mean) / sqrt(var + eps) over every axis but 1, biased variance as torch's; the
    affine weight and bias constant or computed at run time (``instance_norm`` repeats
    them per sample)."""
    shape, dtype = ctx.shape(x), ctx.dtype(x)
    view = (1, shape[1]) + (1,) * (len(shape) - 2)
    last = _normalized(ctx, node, ctx.input(x), shape, [0, *range(2, len(shape))], eps)
    for value, code, options in (
        (weight, "MUL", MulOptions.MulOptionsT()),
        (bias, "ADD", AddOptions.AddOptionsT()),
    ):
        if value is not None:
            if ctx.is_constant(value):
                channel = ctx.const(ctx.constant_value(value).reshape(view).numpy().astype(dtype))
            else:
                channel = ctx.reshape(ctx.input(value), view, dtype)
            out = ctx.tensor(shape, dtype, f"{node.name}_{code.lower()}")
            ctx.emit(code, [last, channel], [out], options)
            last = out
    ctx.values[node] = [(last, L.identity(len(shape)))] + [None] * (len(node.meta["val"]) - 1)


def _normalized(
    ctx: LoweringContext, node: fx.Node, held: int, shape, axes: list[int], eps: float
) -> int:
    """MEAN, SUB, MUL, MEAN, ADD(eps), RSQRT, MUL: ``held`` normalized over ``axes``."""
    dtype = ctx.dtype(node.args[0])
    reduced = tuple(1 if i in axes else d for i, d in enumerate(shape))
    axes_t = ctx.const(np.asarray(axes, np.int32), "axes")
    keep = ReducerOptions.ReducerOptionsT()
    keep.keepDims = True

    def t(s, name):
        return ctx.tensor(s, dtype, f"{node.name}_{name}")

    mean, centred, square, var, var_eps, inv, normed = (
        t(reduced, "mean"),
        t(shape, "centred"),
        t(shape, "square"),
        t(reduced, "var"),
        t(reduced, "var_eps"),
        t(reduced, "rstd"),
        t(shape, "normed"),
    )
    ctx.emit("MEAN", [held, axes_t], [mean], keep)
    ctx.emit("SUB", [held, mean], [centred], SubOptions.SubOptionsT())
    ctx.emit("MUL", [centred, centred], [square], MulOptions.MulOptionsT())
    ctx.emit("MEAN", [square, axes_t], [var], keep)
    ctx.emit("ADD", [var, ctx.scalar(eps, dtype)], [var_eps], AddOptions.AddOptionsT())
    ctx.emit("RSQRT", [var_eps], [inv])
    ctx.emit("MUL", [centred, inv], [normed], MulOptions.MulOptionsT())
    return normed


def _constant_equal_to(ctx: LoweringContext, value, fill: float) -> bool:
    """``value`` is a constant whose every element is ``fill``."""
    return ctx.is_constant(value) and bool((ctx.constant_value(value) == fill).all())


def lower_layer_norm(ctx: LoweringContext, node: fx.Node) -> None:
    """Normalized over the trailing ``normalized_shape`` axes, then the affine MUL/ADD."""
    x, normalized, weight, bias, eps = node.args[:5]
    shape = ctx.shape(x)
    dtype = ctx.dtype(x)
    axes = list(range(len(shape) - len(normalized), len(shape)))
    last = _normalized(ctx, node, ctx.input(x), shape, axes, float(eps))

    def t(s, name):
        return ctx.tensor(s, dtype, f"{node.name}_{name}")

    # An affine that is the identity (a freshly initialized LayerNorm: weight 1, bias 0)
    # adds nothing: no MUL / ADD for it.
    if weight is not None and not _constant_equal_to(ctx, weight, 1.0):
        scaled = t(shape, "scaled")
        ctx.emit("MUL", [last, ctx.input(weight)], [scaled], MulOptions.MulOptionsT())
        last = scaled
    if bias is not None and not _constant_equal_to(ctx, bias, 0.0):
        shifted = t(shape, "shifted")
        ctx.emit("ADD", [last, ctx.input(bias)], [shifted], AddOptions.AddOptionsT())
        last = shifted
    outputs = node.meta["val"]
    ctx.values[node] = [(last, L.identity(len(shape)))] + [None] * (len(outputs) - 1)


def _softmax_like(ctx: LoweringContext, node: fx.Node, code: str, options) -> None:
    x = node.args[0]
    rank = len(ctx.shape(x))
    dim = node.args[1] % rank
    if dim == rank - 1:
        ctx.emit(code, [ctx.input(x)], [ctx.result(node)], options)
        return
    # Circle normalizes the last axis: hold the value with `dim` last, then relabel.
    perm = (*(d for d in range(rank) if d != dim), dim)
    held = ctx.input(x, perm)
    ctx.emit(code, [held], [ctx.result(node, perm)], options)


def lower_softmax(ctx: LoweringContext, node: fx.Node) -> None:
    options = SoftmaxOptions.SoftmaxOptionsT()
    options.beta = 1.0
    _softmax_like(ctx, node, "SOFTMAX", options)


def lower_log_softmax(ctx: LoweringContext, node: fx.Node) -> None:
    _softmax_like(ctx, node, "LOG_SOFTMAX", LogSoftmaxOptions.LogSoftmaxOptionsT())


def lower_embedding(ctx: LoweringContext, node: fx.Node) -> None:
    weight, indices = node.args[:2]
    options = GatherOptions.GatherOptionsT()
    options.axis = 0
    ctx.emit("GATHER", [ctx.input(weight), ctx.input(indices)], [ctx.result(node)], options)


def lower_interpolate(ctx: LoweringContext, node: fx.Node) -> None:
    x = node.args[0]
    out_shape = ctx.shape(node)
    if len(out_shape) != 4:
        raise Unlowerable("interpolation of a non-4-D tensor")
    packet = node.target._overloadpacket.__name__
    size = ctx.const(np.asarray(out_shape[2:], np.int32), "size")
    held = ctx.input(x, L.NHWC)
    if "nearest" in packet:
        if "exact" in packet:
            raise Unlowerable("nearest-exact interpolation")
        code, options = (
            "RESIZE_NEAREST_NEIGHBOR",
            (ResizeNearestNeighborOptions.ResizeNearestNeighborOptionsT()),
        )
        options.alignCorners, options.halfPixelCenters = False, False
    else:
        align = bool(node.args[2]) if len(node.args) > 2 else False
        code, options = "RESIZE_BILINEAR", ResizeBilinearOptions.ResizeBilinearOptionsT()
        options.alignCorners, options.halfPixelCenters = align, not align
    ctx.emit(code, [held, size], [ctx.result(node, L.NHWC)], options)
