"""Reductions and scans: mean, sum, amax, amin (axes remapped to the held layout), cumsum,
topk, argmax."""

from __future__ import annotations

import numpy as np
from circle_schema.v0_10.circle import (
    ArgMaxOptions,
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


def reduction(code: str):
    """``x.mean(dims, keepdim)`` → ``code`` over the dims as held (NHWC stays NHWC)."""

    def lower(ctx: LoweringContext, node: fx.Node) -> None:
        x = node.args[0]
        rank = len(ctx.shape(x))
        if node.kwargs.get("dtype") is not None:
            raise Unlowerable("reduction with a dtype argument")
        dims = sorted(L.reduced_dims(node, rank)) if rank else []
        keep = bool(ops.args(node)["keepdim"])
        stored = ctx.held_perm(x)
        held = ctx.input(x, stored)
        if keep:
            out_perm = stored
        else:
            kept = [d for d in stored if d not in dims]
            renumber = {d: i for i, d in enumerate(sorted(kept))}
            out_perm = tuple(renumber[d] for d in kept)
        axes = ctx.const(np.asarray([stored.index(d) for d in dims], np.int32), "axes")
        options = ReducerOptions.ReducerOptionsT()
        options.keepDims = keep
        ctx.emit(code, [held, axes], [ctx.result(node, out_perm)], options)

    lower.__name__ = f"lower_{code.lower()}"
    return lower


def lower_cumsum(ctx: LoweringContext, node: fx.Node) -> None:
    x, dim = node.args[:2]
    if node.kwargs.get("dtype") is not None and ctx.dtype(node) != ctx.dtype(x):
        raise Unlowerable("cumsum with a dtype change")
    options = CumsumOptions.CumsumOptionsT()
    axis = ctx.const(np.asarray([dim % len(ctx.shape(x))], np.int32), "axis")
    ctx.emit("CUMSUM", [ctx.input(x), axis], [ctx.result(node)], options)


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


def lower_argmax(ctx: LoweringContext, node: fx.Node) -> None:
    x = node.args[0]
    args = ops.args(node)
    dim = args["dim"]
    if dim is None or args["keepdim"]:
        raise Unlowerable("argmax over all dims or with keepdim")
    options = ArgMaxOptions.ArgMaxOptionsT()
    options.outputType = tensor_type(np.int64)
    axis = ctx.const(np.asarray([dim % len(ctx.shape(x))], np.int32), "axis")
    ctx.emit("ARG_MAX", [ctx.input(x), axis], [ctx.result(node)], options)
