"""The layout step: pick the fastest *verified* memory layout for a graph, by measuring.

Graph cleanup alone leaves most of the CPU speed on the table: a convolution runs faster
when its weights are pre-packed for oneDNN (mkldnn) or when activations are channels-last,
and which one wins depends on the model and the batch size (measured on this project's
machines: MobileNetV2 gains from mkldnn at batch 8 and loses at batch 1; ResNet-50 gains
from both). So the step builds each candidate, checks it computes the same outputs, times
the candidates interleaved, and keeps the fastest — or the plain graph when no candidate
is at least ``min_gain`` faster (timings on shared machines move by a few percent).

Candidates:

* ``plain``: the graph as the passes left it;
* ``channels_last``: 4-D conv weights stored channels-last, 4-D float inputs converted on
  entry, 4-D outputs converted back to contiguous on exit (values never change, only
  strides; callers that ``.view`` an output keep working);
* ``mkldnn``: oneDNN layout for runs of supported ops, conversions at their edges, via
  ``torch.fx.experimental.optimization.optimize_for_inference`` with its own conv/BN
  fusion and dropout removal turned off (fxopt already did those, correctly). CPU float32
  module-level (``fx``) graphs only.
* ``onednn``: conv2d and linear lowered to oneDNN's fused kernels with weights pre-packed
  once, activations and residual adds fused in (:mod:`fxopt.passes.lower_onednn`, the
  kernels ``torch.compile`` uses on CPU). CPU float32; the result has no autograd.

    >>> import torch
    >>> from fxopt.layout import autotune
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> choice = autotune(gm, model, (torch.randn(1, 3, 16, 16),), budget_s=0.2)
    >>> choice.name in ("plain", "channels_last", "mkldnn", "onednn")
    True
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from fxopt import bench, verify
from fxopt.ir import meta, ops
from fxopt.ir.copying import clone_module

CANDIDATES = ("plain", "channels_last", "mkldnn", "onednn")


@dataclass
class LayoutChoice:
    name: str
    module: nn.Module
    #: median ms per candidate that verified; failures map to their reason.
    median_ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "chosen": self.name,
            "median_ms": {k: round(v, 4) for k, v in self.median_ms.items()},
            "rejected": dict(self.rejected),
            "autotune_s": round(self.seconds, 3),
        }


def has_convolutions(gm: fx.GraphModule) -> bool:
    return any(
        ops.is_call(n, "conv", gm) or ops.is_call(n, "conv_transpose", gm) for n in gm.graph.nodes
    )


def has_linears(gm: fx.GraphModule) -> bool:
    return any(ops.is_call(n, "linear", gm) for n in gm.graph.nodes)


def to_channels_last(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose 4-D weights and activations are channels-last."""
    out = clone_module(gm)
    with torch.no_grad():
        for tensor in [*out.parameters(), *out.buffers()]:
            if tensor.dim() == 4:
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    graph = out.graph
    for node in list(graph.nodes):
        if node.op == "placeholder" and _is_4d_float(node):
            with graph.inserting_after(node):
                converted = graph.call_method(
                    "contiguous", (node,), {"memory_format": torch.channels_last}
                )
            node.replace_all_uses_with(
                converted, delete_user_cb=lambda user, new=converted: user is not new
            )
        elif node.op == "output":
            node.args = (
                fx.node.map_arg(
                    node.args[0], lambda n, out=node: _back_to_contiguous(graph, out, n)
                ),
            )
    out.recompile()
    return out


def _is_4d_float(node: fx.Node) -> bool:
    dtype = meta.dtype(node)
    return meta.rank(node) == 4 and dtype is not None and dtype.is_floating_point


def _back_to_contiguous(graph: fx.Graph, output: fx.Node, value: fx.Node) -> fx.Node:
    if not _is_4d_float(value):
        return value
    with graph.inserting_before(output):
        return graph.call_method("contiguous", (value,))


def to_mkldnn(gm: fx.GraphModule) -> nn.Module:
    """oneDNN layout through torch's own pass (its fusion and dropout removal disabled)."""
    from torch.fx.experimental.optimization import optimize_for_inference

    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in gm.parameters()):
        raise ValueError("mkldnn layout needs float32 parameters on the CPU")
    if any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
        for n in gm.graph.nodes
    ):
        raise ValueError("mkldnn layout applies to module-level (fx) graphs, not ATen graphs")
    with warnings.catch_warnings():
        # torch.utils.mkldnn's modules still use torch.jit.script_method (deprecated).
        warnings.simplefilter("ignore", DeprecationWarning)
        return optimize_for_inference(
            clone_module(gm), pass_config={"conv_bn_fuse": False, "remove_dropout": False}
        )


def to_onednn(gm: fx.GraphModule) -> nn.Module:
    """A copy of ``gm`` with its conv2d/linear calls on oneDNN's fused, pre-packed kernels."""
    from fxopt.passes import PassManager
    from fxopt.passes.lower_onednn import LowerOneDnn

    result = PassManager([LowerOneDnn()]).run(gm)
    if not result.changed:
        reasons = [str(s) for s in result.records[0].skipped][:3]
        raise ValueError(f"nothing to lower: {'; '.join(reasons) or 'no conv2d or linear'}")
    return result.module


_BUILDERS: dict[str, Callable[[fx.GraphModule], nn.Module]] = {
    "channels_last": to_channels_last,
    "mkldnn": to_mkldnn,
    "onednn": to_onednn,
}


def autotune(
    gm: fx.GraphModule,
    reference: nn.Module,
    example_inputs: Sequence,
    *,
    candidates: Sequence[str] = CANDIDATES,
    budget_s: float = 3.0,
    min_gain: float = 0.03,
    extra_inputs: Sequence[Sequence] = (),
) -> LayoutChoice:
    """Build, verify and time each candidate layout of ``gm``; return the fastest.

    ``budget_s`` bounds the timing of each candidate (at least 3 calls each). Every
    candidate is verified on the example, a random input and each of ``extra_inputs``
    (other sizes of dynamic dims: a kernel packed for the example's shape must still be
    right for them). Timing runs on copies: the module returned is never run here.
    """
    start = time.perf_counter()
    built: dict[str, nn.Module] = {"plain": gm}
    rejected: dict[str, str] = {}
    if not has_convolutions(gm):
        # Layout matters for convolutions; pre-packed kernels also for linears.
        without = "no convolutions" if has_linears(gm) else "no convolutions or linears"
        kept = ("plain", "onednn") if has_linears(gm) else ("plain",)
        rejected.update({c: without for c in candidates if c not in kept})
        candidates = tuple(c for c in candidates if c in kept)
    for name in candidates:
        if name == "plain":
            continue
        try:
            module = _BUILDERS[name](gm)
            check = verify.check_outputs(
                reference, module, example_inputs, random_sets=1, extra_sets=extra_inputs
            )
        except Exception as error:  # a candidate that cannot be built is just not chosen
            rejected[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        if not check.ok:
            rejected[name] = f"outputs differ: {check.message}"
            continue
        built[name] = module
    if len(built) == 1:
        return LayoutChoice("plain", gm, {}, rejected, time.perf_counter() - start)
    timed = {name: _timing_copy(module) for name, module in built.items()}
    runs = _runs_within(budget_s, timed["plain"], example_inputs)
    timings = bench.measure_latency(timed, example_inputs, runs=runs, warmup=2)
    median = {name: stats["median_ms"] for name, stats in timings.items()}
    best = min(median, key=median.__getitem__)
    if best != "plain" and median[best] > median["plain"] * (1 - min_gain):
        best = "plain"  # not clearly faster: keep the simplest
    if best != "plain":
        # Confirm against plain in a second interleaved round: on a loaded machine one
        # round picked channels-last for MobileNetV2 at batch 1, which a longer benchmark
        # then measured 14% slower than plain.
        again = bench.measure_latency(
            {"plain": timed["plain"], best: timed[best]}, example_inputs, runs=runs, warmup=1
        )
        confirmed = again[best]["median_ms"] <= again["plain"]["median_ms"] * (1 - min_gain)
        median[f"{best} (confirmation)"] = again[best]["median_ms"]
        median["plain (confirmation)"] = again["plain"]["median_ms"]
        if not confirmed:
            rejected[best] = "faster in the first round only; not confirmed"
            best = "plain"
    return LayoutChoice(best, built[best], median, rejected, time.perf_counter() - start)


def _timing_copy(module: nn.Module) -> nn.Module:
    """A copy to time, so the module handed back has never run (a module that updates its
    own buffers would otherwise come back changed by the timing)."""
    try:
        return clone_module(module)
    except Exception:  # opaque packed weights that do not copy: they hold no state either
        return module


def _runs_within(budget_s: float, module: nn.Module, inputs: Sequence) -> int:
    with torch.inference_mode():
        module(*inputs)  # first call pays one-time costs
        begin = time.perf_counter()
        module(*inputs)
        per_call = time.perf_counter() - begin
    return max(3, min(25, int(budget_s / max(per_call, 1e-6))))
