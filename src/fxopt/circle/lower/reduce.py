"""Reductions and scans: mean, sum, amax, amin (axes remapped to the held layout), cumsum,
topk, argmax, argmin."""

from __future__ import annotations

import numpy as np
from circle_schema.v0_10.circle import (
    ArgMaxOptions,
    ArgMinOptions,
    CastOptions,
    CumsumOptions,
    ReducerOptions,
    TopKV2Options,
)
from torch import fx

from fxopt.circle import layout as L
from fxopt.circle.build import tensor_type
from fxopt.circle.lower.context import LoweringContext, Unlowerable
from fxopt.ir import ops


def reduction(code: str, *, negate: bool = False):
    """``x.mean(dims, keepdim)`` → ``code`` over the dims as held (NHWC stays NHWC).

    ``negate`` computes ``-code(-x)``: ``amin`` as ``-max(-x)``, since onert 0.1.0 has no
    REDUCE_MIN kernel (measured: "Unsupported operation: REDUCE_MIN" at load).
    """

    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        x = node.args[0]
        rank = len(ctx.shape(x))
        if node.kwargs.get("dtype") is not None:
            raise Unlowerable("reduction with a dtype argument")
        dims = sorted(L.reduced_dims(node, rank)) if rank else []
        keep = bool(ops.args(node).get("keepdim", False))  # mean() of all: none
        stored = ctx.held_perm(x)
        held = ctx.input(x, stored)
        if keep:
            out_perm = stored
        else:
            kept = [d for d in stored if d not in dims]
            renumber = {d: i for i, d in enumerate(sorted(kept))}
            out_perm = tuple(renumber[d] for d in kept)
        held_axes = [stored.index(d) for d in dims]
        axes = ctx.const(np.asarray(held_axes, np.int32), "axes")
        options = ReducerOptions.ReducerOptionsT()
        # onert 0.1.0 refuses most reductions of a rank >= 4 tensor that drop dims
        # (measured: "ShapeValidator failed" at prepare for axis 0, 1, (2, 3) of 4-D and
        # for 5-D; the last axis alone passes): keep the dims, then RESHAPE them away.
        squeeze_after = not keep and rank >= 4 and held_axes != [rank - 1]
        options.keepDims = keep or squeeze_after
        out = ctx.result(node, out_perm)
        dtype = ctx.dtype(node)
        source = held
        if code == "REDUCE_ANY" and ctx.dtype(x) != np.bool_:
            # onert 0.1.0 prepares REDUCE_ANY of bool only: any(x) is any(x != 0).
            source = ctx.tensor(ctx.graph.tensors[held].shape, np.bool_, "nonzero")
            ctx.emit("NOT_EQUAL", [held, ctx.scalar(0, ctx.dtype(x))], [source])
        if negate:
            source = ctx.tensor(ctx.graph.tensors[held].shape, ctx.dtype(x), "neg")
            ctx.emit("NEG", [held], [source])
        if not negate and not squeeze_after:
            ctx.emit(code, [source, axes], [out], options)
            return
        steps = (["NEG"] if negate else []) + (["RESHAPE"] if squeeze_after else [])
        shape = ctx.graph.tensors[held].shape
        if options.keepDims:
            shape = tuple(1 if a in held_axes else n for a, n in enumerate(shape))
        else:
            shape = ctx.graph.tensors[out].shape
        value = ctx.tensor(shape, dtype, "reduced")
        ctx.emit(code, [source, axes], [value], options)
        for i, step in enumerate(steps):
            target = out if i == len(steps) - 1 else ctx.tensor(shape, dtype, "neg")
            if step == "NEG":
                ctx.emit("NEG", [value], [target])
            else:
                ctx.reshape(value, ctx.graph.tensors[out].shape, dtype, out=target)
            value = target

    lower.__name__ = f"lower_{code.lower()}"
    return lower


def lower_cumsum(ctx: LoweringContext, node: fx.Node) -> None:
    """CUMSUM in the result's dtype: torch sums bool and int32 into int64 (and a ``dtype``
    argument picks another), so the input is CAST first when the two differ."""
    x, dim = node.args[:2]
    options = CumsumOptions.CumsumOptionsT()
    axis = ctx.const(np.asarray([dim % len(ctx.shape(x))], np.int32), "axis")
    held = ctx.input(x)
    if ctx.dtype(x) != ctx.dtype(node):
        cast = CastOptions.CastOptionsT()
        cast.inDataType = tensor_type(ctx.dtype(x))
        cast.outDataType = tensor_type(ctx.dtype(node))
        converted = ctx.tensor(ctx.shape(x), ctx.dtype(node), "cast")
        ctx.emit("CAST", [held], [converted], cast)
        held = converted
    ctx.emit("CUMSUM", [held, axis], [ctx.result(node)], options)


def _to_int64(ctx: LoweringContext, index: int, shape) -> int:
    options = CastOptions.CastOptionsT()
    options.inDataType, options.outDataType = tensor_type(np.int32), tensor_type(np.int64)
    out = ctx.tensor(shape, np.int64, "indices")
    ctx.emit("CAST", [index], [out], options)
    return out


def lower_topk(ctx: LoweringContext, node: fx.Node) -> None:
    x, k = node.args[:2]
    rank = len(ctx.shape(x))
    args = ops.args(node)
    dim = args["dim"] % rank
    if dim != rank - 1 or not args["largest"]:
        raise Unlowerable("topk over a non-last dim, or smallest")
    values_val, _ = node.meta["val"]
    shape = tuple(int(d) for d in values_val.shape)
    values = ctx.tensor(shape, ctx.dtype(x), f"{node.name}_values")
    indices = ctx.tensor(shape, np.int32, f"{node.name}_indices")
    k_index = ctx.const(np.asarray([k], np.int32), "k")
    ctx.emit("TOPK_V2", [ctx.input(x), k_index], [values, indices], TopKV2Options.TopKV2OptionsT())
    identity = L.identity(rank)
    ctx.values[node] = [(values, identity), (_to_int64(ctx, indices, shape), identity)]


def arg_reduction(code: str):
    """``argmax`` / ``argmin`` → ARG_MAX / ARG_MIN (int64 indices). Over all dims the input
    is flattened first; ``keepdim`` is a RESHAPE after."""

    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        x = node.args[0]
        args = ops.args(node)
        dim, shape = args["dim"], ctx.shape(x)
        held = ctx.input(x)
        if dim is None:
            size = int(np.prod(shape, dtype=np.int64))
            held, shape, dim = ctx.reshape(held, (size,), ctx.dtype(x)), (size,), 0
        dim %= max(len(shape), 1)
        options = (
            ArgMaxOptions.ArgMaxOptionsT if code == "ARG_MAX" else ArgMinOptions.ArgMinOptionsT
        )()
        options.outputType = tensor_type(np.int64)
        axis = ctx.const(np.asarray([dim], np.int32), "axis")
        out_shape = ctx.shape(node)
        reduced_shape = tuple(s for d, s in enumerate(shape) if d != dim)
        if reduced_shape == out_shape:
            ctx.emit(code, [held, axis], [ctx.result(node)], options)
            return
        reduced = ctx.tensor(reduced_shape, np.int64, "arg")
        ctx.emit(code, [held, axis], [reduced], options)
        ctx.reshape(reduced, out_shape, np.int64, out=ctx.result(node))

    lower.__name__ = f"lower_{code.lower()}"
    return lower
