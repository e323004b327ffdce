"""Lower a core-ATen GraphModule to a :class:`~fxopt.circle.graph.CircleGraph`.

:data:`LOWERINGS` is the explicit table, keyed by the canonical op name of
:mod:`fxopt.ir.ops` (no import side effects, no list of ATen spellings here): each entry is
one small function and the layout it wants (:mod:`fxopt.circle.layout`). Every op without a
lowering — or whose form its lowering rejects — is collected, and all of them are reported
at once with their count and the source line of their first occurrence.

    >>> "conv" in LOWERINGS and LOWERINGS["conv"].layout == "nhwc"
    True
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from fxopt.circle import layout as L
from fxopt.circle.config import CircleConfig
from fxopt.circle.errors import Unsupported, UnsupportedOpsError
from fxopt.circle.graph import CircleGraph
from fxopt.circle.lower import elementwise as E
from fxopt.circle.lower import nn as N
from fxopt.circle.lower import quant as Q
from fxopt.circle.lower import reduce as R
from fxopt.circle.lower import shape as S
from fxopt.circle.lower.context import LoweringContext, Unlowerable, static_shape
from fxopt.ir import ops


@dataclass(frozen=True)
class Lowering:
    fn: Callable[[LoweringContext, fx.Node], None]
    layout: str = L.TORCH


_F, _N, _R, _P = L.FOLLOWS, L.NEEDS_NHWC, L.REDUCES, L.PERMUTES

# fmt: off
LOWERINGS: dict[str, Lowering] = {
    # elementwise arithmetic and comparisons (layout-agnostic)
    "add": Lowering(E.binary("ADD"), _F),
    "sub": Lowering(E.binary("SUB"), _F),
    "rsub": Lowering(E.binary("SUB", swap=True), _F),
    "mul": Lowering(E.binary("MUL"), _F),
    "div": Lowering(E.lower_div, _F),
    "maximum": Lowering(E.binary("MAXIMUM"), _F),
    "minimum": Lowering(E.binary("MINIMUM"), _F),
    "pow": Lowering(E.lower_pow, _F),
    "eq": Lowering(E.binary("EQUAL", compare=True), _F),
    "ne": Lowering(E.binary("NOT_EQUAL", compare=True), _F),
    "lt": Lowering(E.binary("LESS", compare=True), _F),
    "le": Lowering(E.binary("LESS_EQUAL", compare=True), _F),
    "gt": Lowering(E.binary("GREATER", compare=True), _F),
    "ge": Lowering(E.binary("GREATER_EQUAL", compare=True), _F),
    "logical_and": Lowering(E.logical("LOGICAL_AND"), _F),
    "logical_or": Lowering(E.logical("LOGICAL_OR"), _F),
    "logical_not": Lowering(E.lower_logical_not, _F),
    "where": Lowering(E.lower_where, _F),
    "masked_fill": Lowering(E.lower_masked_fill, _F),
    "to": Lowering(E.lower_to, _F),
    # unary math and activations
    "relu": Lowering(E.unary("RELU"), _F),
    "relu6": Lowering(E.lower_relu6, _F),
    "hardtanh": Lowering(E.lower_hardtanh, _F),
    "clamp": Lowering(E.lower_clamp, _F),
    "leaky_relu": Lowering(E.lower_leaky_relu, _F),
    "sigmoid": Lowering(E.unary("LOGISTIC"), _F),
    "tanh": Lowering(E.unary("TANH"), _F),
    "gelu": Lowering(E.lower_gelu, _F),
    "elu": Lowering(E.unary("ELU"), _F),
    "silu": Lowering(E.lower_silu, _F),
    "hardswish": Lowering(E.lower_hardswish, _F),
    "hardsigmoid": Lowering(E.lower_hardsigmoid, _F),
    "exp": Lowering(E.unary("EXP"), _F),
    "log": Lowering(E.unary("LOG"), _F),
    "sqrt": Lowering(E.unary("SQRT"), _F),
    "rsqrt": Lowering(E.unary("RSQRT"), _F),
    "abs": Lowering(E.unary("ABS"), _F),
    "neg": Lowering(E.unary("NEG"), _F),
    "floor": Lowering(E.unary("FLOOR"), _F),
    "ceil": Lowering(E.lower_ceil, _F),
    "round": Lowering(E.unary("ROUND"), _F),
    "reciprocal": Lowering(E.lower_reciprocal, _F),
    "sin": Lowering(E.unary("SIN"), _F),
    "cos": Lowering(E.unary("COS"), _F),
    # layers
    "conv": Lowering(N.lower_conv, _N),
    "max_pool": Lowering(N.lower_max_pool, _N),
    "avg_pool": Lowering(N.lower_avg_pool, _N),
    "adaptive_avg_pool": Lowering(N.lower_adaptive_avg_pool, _N),
    "interpolate": Lowering(N.lower_interpolate, _N),
    "linear": Lowering(N.lower_linear),
    "ggml_linear": Lowering(N.lower_ggml_linear),
    "ggml_embedding": Lowering(N.lower_ggml_embedding),
    "addmm": Lowering(N.lower_addmm),
    "mm": Lowering(N.lower_mm),
    "bmm": Lowering(N.lower_mm),
    "matmul": Lowering(N.lower_mm),
    "batch_norm": Lowering(N.lower_batch_norm, _F),
    "layer_norm": Lowering(N.lower_layer_norm),
    "softmax": Lowering(N.lower_softmax),
    "log_softmax": Lowering(N.lower_log_softmax),
    "embedding": Lowering(N.lower_embedding),
    # quantization (integer tensors between QUANTIZE and DEQUANTIZE)
    "quantize": Lowering(Q.lower_quantize, _F),
    "dequantize": Lowering(Q.lower_dequantize, _F),
    "fake_quantize": Lowering(Q.lower_fake_quantize, _F),
    # reductions and scans
    "mean": Lowering(R.reduction("MEAN"), _R),
    "sum": Lowering(R.reduction("SUM"), _R),
    "amax": Lowering(R.reduction("REDUCE_MAX"), _R),
    "amin": Lowering(R.reduction("REDUCE_MAX", negate=True), _R),
    "any": Lowering(R.reduction("REDUCE_ANY"), _R),
    "cumsum": Lowering(R.lower_cumsum),
    "topk": Lowering(R.lower_topk),
    "argmax": Lowering(R.arg_reduction("ARG_MAX")),
    "argmin": Lowering(R.arg_reduction("ARG_MIN")),
    # shapes and data movement
    "view": Lowering(S.lower_reshape),
    "reshape": Lowering(S.lower_reshape),
    "flatten": Lowering(S.lower_reshape),
    "unflatten": Lowering(S.lower_reshape),
    "squeeze": Lowering(S.lower_reshape),
    "unsqueeze": Lowering(S.lower_reshape),
    "permute": Lowering(S.lower_permute, _P),
    "transpose": Lowering(S.lower_permute, _P),
    "t": Lowering(S.lower_permute, _P),
    "expand": Lowering(S.lower_expand),
    "clone": Lowering(S.lower_alias, _F),
    "identity": Lowering(S.lower_alias, _F),
    "detach": Lowering(S.lower_alias, _F),
    "contiguous": Lowering(S.lower_alias, _F),
    "cat": Lowering(S.lower_cat, _F),
    "slice": Lowering(S.lower_slice, _F),
    "select": Lowering(S.lower_select, _R),
    "split": Lowering(S.lower_split),
    "getitem": Lowering(S.lower_getitem),
    "index_select": Lowering(S.lower_index_select),
    "index": Lowering(S.lower_index),
    "pad": Lowering(S.lower_pad, _F),
    "size": Lowering(S.lower_size),
    "repeat": Lowering(S.lower_repeat),
    "as_strided": Lowering(S.lower_as_strided),
    "full": Lowering(S.lower_constant),
    "arange": Lowering(S.lower_constant),
}
# fmt: on

_aten = torch.ops.aten

#: ATen ops the export keeps whole (not decomposed) because a lowering above has a native
#: Circle operator (or a better lowering) for them than for their decomposition.
KEPT_WHOLE = (
    _aten.linear.default,  # FULLY_CONNECTED
    _aten.hardswish.default,  # HARD_SWISH
    _aten.silu.default,  # LOGISTIC + MUL, not the decomposition's x * sigmoid(x) spelling
    _aten.hardsigmoid.default,
    _aten.relu6.default,  # RELU6
    _aten.matmul.default,  # BATCH_MATMUL, without the expand/view/bmm decomposition
    _aten.upsample_nearest2d.vec,  # RESIZE_NEAREST_NEIGHBOR
    _aten.upsample_nearest2d.default,
    _aten.upsample_bilinear2d.vec,  # RESIZE_BILINEAR
    _aten.upsample_bilinear2d.default,
    # QUANTIZE + DEQUANTIZE, not the decomposition's (values, mask) pair
    _aten.fake_quantize_per_tensor_affine.default,
    _aten.fake_quantize_per_tensor_affine.tensor_qparams,
    _aten.fake_quantize_per_channel_affine.default,
)

_QUANTIZATION = re.compile(r"quantize|dequantize|fake_quant")


def supported_ops() -> list[str]:
    """Canonical names of the ops the converter takes, sorted: those with a lowering and
    those decomposed into them (:mod:`fxopt.circle.decompose`)."""
    from fxopt.circle.decompose import decomposed_ops

    return sorted(set(LOWERINGS) | decomposed_ops())


def lower(gm: fx.GraphModule, config: CircleConfig) -> CircleGraph:
    """Lower every node of ``gm``; UnsupportedOpsError lists all that cannot be lowered."""

    def kind_of(node: fx.Node) -> str:
        entry = LOWERINGS.get(ops.info(node, gm).name)
        return entry.layout if entry else L.TORCH

    layouts = L.plan(gm, kind_of, propagate=config.propagate_nhwc)
    graph = CircleGraph()
    ctx = LoweringContext(gm, layouts, config, graph)
    problems: dict[str, list] = {}  # op name → [count, first node, reason]
    failed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            _lower_input(ctx, node)
        elif node.op == "output":
            if not failed:
                _lower_outputs(ctx, node)
        elif ops.is_compute(node):
            name = ops.info(node, gm).name
            if any(a in failed for a in node.all_input_nodes):
                # Its operands could not be lowered. An op with a lowering would follow
                # from that; one without is a problem of its own, reported too.
                failed.add(node)
                reason = _lowering_missing(name)
                if reason is not None:
                    problems.setdefault(name, [0, node, reason])[0] += 1
                continue
            reason = _try_lower(ctx, node, name)
            if reason is not None:
                failed.add(node)
                entry = problems.setdefault(name, [0, node, reason])
                entry[0] += 1
    if problems:
        raise UnsupportedOpsError(
            [
                Unsupported(name, count, where(node), reason)
                for name, (count, node, reason) in problems.items()
            ]
        )
    return graph


def _lowering_missing(name: str) -> str | None:
    """Why an op of this name has no lowering at all, or None when it has one."""
    if name not in LOWERINGS:
        if _QUANTIZATION.search(name):
            return (
                "no Circle lowering for this quantization op (fxopt lowers per-tensor "
                "quantize/dequantize of activations and integer weights)"
            )
        return "no Circle lowering"
    return None


def _try_lower(ctx: LoweringContext, node: fx.Node, name: str) -> str | None:
    """None when lowered, else why not."""
    missing = _lowering_missing(name)
    if missing is not None:
        return missing
    try:
        LOWERINGS[name].fn(ctx, node)
    except Unlowerable as error:
        return str(error)
    return None


def _lower_input(ctx: LoweringContext, node: fx.Node) -> None:
    val = node.meta.get("val")
    if val is None or not hasattr(val, "shape"):
        raise UnsupportedOpsError([Unsupported("input", 1, node.name, "not a tensor input")])
    shape, signature = static_shape(val.shape)
    dtype = ctx.dtype_of(val)
    graph = ctx.graph
    if not shape and signature is None:
        # onert 0.1.0 crashes binding rank-0 inputs: take [1], reshape to a scalar inside.
        index = graph.add_tensor(node.name, (1,), dtype)
        graph.inputs.append(index)
        graph.input_names.append(node.name)
        ctx.bind(node, ctx.reshape(index, (), dtype))
        return
    index = graph.add_tensor(node.name, shape, dtype, shape_signature=signature)
    graph.inputs.append(index)
    graph.input_names.append(node.name)
    ctx.bind(node, index)


def _lower_outputs(ctx: LoweringContext, node: fx.Node) -> None:
    results, constants = constant_outputs(node)
    written = [v for v in results if v is not None]  # pytree flattening drops None too
    if not any(isinstance(v, fx.Node) for v in written):
        raise UnsupportedOpsError(
            [Unsupported("output", 1, "output", "the model returns no tensor")]
        )
    scalars = {i: v for i, v in constants.items() if v is not None}
    odd = {i: v for i, v in scalars.items() if type(v) not in _SCALAR_DTYPES}
    if odd:
        listed = ", ".join(f"output {i} = {v!r}" for i, v in odd.items())
        raise UnsupportedOpsError(
            [Unsupported("output", len(odd), "output", f"not a tensor or a number: {listed}")]
        )
    if scalars and ctx.config.tensor_outputs_only:
        listed = ", ".join(f"output {i} = {v!r}" for i, v in scalars.items())
        raise UnsupportedOpsError(
            [Unsupported("output", len(scalars), "output", f"non-tensor outputs: {listed}")]
        )
    for i, value in enumerate(written):
        if isinstance(value, fx.Node):
            index = ctx.input(value)
        else:  # an int size, a float, a flag export baked in: the file returns it as given
            dtype = _SCALAR_DTYPES[type(value)]
            held = ctx.const(np.asarray([value], dtype), f"output_{i}")  # onert: rank >= 1
            index = ctx.reshape(held, (), dtype)
        tensor = ctx.graph.tensors[index]
        if tensor.data is not None or index in ctx.graph.inputs or index in ctx.graph.outputs:
            # A Circle output must be produced by an operator: copy through a RESHAPE.
            index = ctx.reshape(index, tensor.shape, tensor.dtype)
        ctx.graph.outputs.append(index)
        ctx.graph.output_names.append(f"output_{i}")


#: The Circle dtype of a Python scalar output: torch.tensor's for it.
_SCALAR_DTYPES = {int: np.int64, float: np.float32, bool: np.bool_}


def constant_outputs(output: fx.Node) -> tuple[list, dict[int, object]]:
    """(the output node's values, position → value of those that are not tensors).

    Export bakes a non-tensor output (``None``, an int) into the graph as a literal: the
    file returns an int, float or bool as a constant scalar output (reported), and leaves
    out ``None``.
    """
    results = output.args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    return results, {i: v for i, v in enumerate(results) if not isinstance(v, fx.Node)}


def where(node: fx.Node) -> str:
    """'file:line' of the user's code that created ``node`` (its name when unknown)."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    user = [(f, n) for f, n in found if "/torch/" not in f and "/fxopt/circle/" not in f]
    if user:
        path, line = user[-1]
        return f"{path}:{line}"
    return f"node {node.name}"


__all__ = ["LOWERINGS", "Lowering", "constant_outputs", "lower", "supported_ops", "where"]
