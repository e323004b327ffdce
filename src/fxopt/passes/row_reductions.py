"""One-row linears as the reductions they are, for Inductor to generate.

At one row a linear is a matrix-vector product, ``y[n] = Σ_k x[k] · W[n, k]``: all its
time goes to streaming ``W`` from memory. Written as ``(x[..., None, :] * W).sum(-1)``,
Inductor turns it into one vectorised loop over the rows of ``W`` (split across threads),
which streamed a Llama decode step's weights faster than MKL's packed GEMM: the step's 17
GEMMs (hidden 512, 4 layers, q/k/v and gate/up stacked, the 32000-word head) took 5.6-5.9
ms against 6.7-7.0 on 1 thread and 4.5 against 7.1 on 2 (AMD EPYC, weights out of cache).
torch.compile calls MKL's GEMM there.

Eager would compute the product into an N×K temporary: this rewrite is only for a graph
Inductor compiles whole (:func:`fxopt.passes.inductor_regions.compile_whole`), which keeps
it only where the compiled graph is timed faster than with the GEMMs. The dense weight it
reads is the model's own (the packed copy stays, for the graph that runs other sizes).

Exact as a GEMM is: each output is the same dot product of float32 values, summed in
another order (the whole graph is checked on NaN, ±inf and -0.0 and verified against
float64 like any other).

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.passes import PassManager, gemm_timing
    >>> from fxopt.passes.fuse_kernels import FuseKernels
    >>> gemm_timing.FORCED = "mkl"
    >>> model = torch.nn.Linear(8, 4).eval()
    >>> gm = PassManager([FuseKernels()]).run(trace(model, (torch.randn(1, 8),))).module
    >>> rows = as_reductions(gm)
    >>> one_row_linears(gm), one_row_linears(rows)
    (1, 0)
    >>> x = torch.randn(1, 8)
    >>> torch.allclose(rows(x), model(x), atol=1e-6)
    True
    >>> gemm_timing.FORCED = None
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxopt.ir import attributes, ops
from fxopt.ir.copying import graph_copy
from fxopt.passes.merge_linears import PACKED_LINEARS

_MKL_LINEAR = torch.ops.mkl._mkl_linear.default


def one_row_linears(gm: fx.GraphModule) -> int:
    """How many GEMM calls of ``gm`` are packed for one row (MKL's packed linear, or
    :mod:`fxopt.passes.merge_linears`' stacked one)."""
    return sum(1 for node in gm.graph.nodes if _one_row(node))


def as_reductions(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its weights) with each one-row GEMM written as a
    multiply and a sum over the weight's rows."""
    out = graph_copy(gm)
    graph = out.graph
    for node in list(graph.nodes):
        if not _one_row(node):
            continue
        arguments = ops.args(node)
        with graph.inserting_before(node):
            if node.target is _MKL_LINEAR:
                x, weight, bias = arguments["X"], arguments["ORI_W"], arguments["B"]
                node.replace_all_uses_with(_reduction(graph, x, weight, bias))
            else:
                _stacked(out, node, arguments)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    out.recompile()
    return out


def _one_row(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is _MKL_LINEAR:
        return ops.args(node)["batch_size"] == 1
    return node.target is PACKED_LINEARS and ops.args(node)["rows"] == 1


def _reduction(graph: fx.Graph, x, weight, bias) -> fx.Node:
    """``(x[..., None, :] * weight).sum(-1) (+ bias)``."""
    row = ops.emit(graph, "unsqueeze", x, -2, level="aten")
    out = ops.emit(graph, "sum", ops.emit(graph, "mul", row, weight, level="aten"), [-1])
    return out if bias is None else ops.emit(graph, "add", out, bias, level="aten")


def _stacked(gm: fx.GraphModule, node: fx.Node, arguments: dict) -> None:
    """Each output of a stacked GEMM (read by ``getitem``) as its own reduction."""
    graph, bias, start, pieces = gm.graph, arguments["bias"], 0, []
    for weight in arguments["weights"]:
        columns = attributes.get(gm, weight.target).shape[0]
        part = None
        if bias is not None:
            part = ops.emit(graph, "slice", bias, 0, start, start + columns, level="aten")
        pieces.append(_reduction(graph, arguments["x"], weight, part))
        start += columns
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(pieces[ops.args(user)["index"]])
            graph.erase_node(user)
