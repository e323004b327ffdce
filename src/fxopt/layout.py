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
* ``original``: the model itself, unmodified, called from the graph's placeholders (behind
  the same input guard once installed). When nothing beats it, the result runs exactly
  as fast as the model: a graph of many small ATen ops run by fx's generated Python can
  be slower than the module it came from (Hugging Face transformers captured by export).
* ``channels_last``: 4-D conv weights stored channels-last, 4-D float inputs converted on
  entry, 4-D outputs converted back to contiguous on exit (values never change, only
  strides; callers that ``.view`` an output keep working);
* ``mkldnn``: oneDNN layout for runs of supported ops, conversions at their edges, via
  ``torch.fx.experimental.optimization.optimize_for_inference`` with its own conv/BN
  fusion and dropout removal turned off (fxopt already did those, correctly). CPU float32
  module-level (``fx``) graphs only.
* ``onednn``: the fused CPU kernels torch ships, chosen by the tiler
  (:mod:`fxopt.passes.fuse_kernels`): conv/linear with pre-packed weights and their
  activations and residual adds fused in, attention as scaled_dot_product_attention (the
  kernels ``torch.compile`` uses on CPU). CPU float32; the result has no autograd.
* ``onednn_inductor``: ``onednn`` with each region of pure ATen ops between its kernels
  (RMSNorm, RoPE, SwiGLU, residual adds) run by code Inductor generates for it
  (:mod:`fxopt.passes.inductor_regions`): one call per region instead of one per op.
  Built from ``onednn``'s module (its packed weights shared), when the regions hold at
  least :data:`INDUCTOR_MIN_OPS` ops; ``FXOPT_INDUCTOR_REGIONS=0`` turns it off. A region
  whose code changes NaN, ±inf or -0.0 stays eager unless ``fast_math``.
* ``onednn_channels_last``: the same kernels on channels-last activations, so that no
  reorder runs between consecutive convolutions.

``mkldnn`` is not measured unless asked for, and ``channels_last`` only when neither fused
candidate could be built: the fused kernels were faster on every model and batch of the
inference benchmark, and each candidate costs its verification and timing runs.

    >>> import torch
    >>> from fxopt.layout import autotune
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> choice = autotune(gm, model, (torch.randn(1, 3, 16, 16),), budget_s=0.2)
    >>> choice.name in CANDIDATES
    True
"""

from __future__ import annotations

import contextlib
import copy
import operator
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxopt import bench, caches, memory, verify
from fxopt.errors import UserInputError
from fxopt.ir import meta, ops
from fxopt.ir.copying import (
    graph_copy,
    isolated,
    may_change_state,
    own_written_buffers,
    shared_copy,
)
from fxopt.ir.weights import DERIVED_KEY, note_derived
from fxopt.passes.cpu_kernels import sampled_gain

CANDIDATES = (
    "plain", "original", "channels_last", "mkldnn", "onednn", "onednn_inductor",
    "plain_inductor", "onednn_channels_last",
)  # fmt: skip
#: What :func:`autotune` measures by default, in this order.
DEFAULT_CANDIDATES = (
    "plain", "original", "onednn", "onednn_inductor", "plain_inductor", "onednn_channels_last",
    "channels_last",
)  # fmt: skip
#: ``onednn_inductor`` is built only when its regions hold at least this many ATen ops that
#: compute: Inductor's compiling (seconds per distinct region) is setup time users wait
#: for, and a few ops save microseconds.
INDUCTOR_MIN_OPS = 24
#: A candidate measured only when none of these was built: channels-last alone lost to the
#: fused kernels on every model and batch of the inference benchmark, and each candidate
#: costs verification and timing runs (setup time is part of what users compare).
FALLBACK_FOR = {
    "channels_last": ("onednn", "onednn_channels_last"),
    # Inductor's code for the plain graph: no weight copied (the kernels are torch's own).
    "plain_inductor": ("onednn",),
}
#: A packed-kernel candidate that copies at least this many bytes of weights is built only
#: when its kernels, timed on a sample of the graph's shapes, save at least
#: :data:`COPY_MIN_GAIN` of a call: a second copy of a large model's weights is what decides
#: whether a job fits (and what the memory check promises: optimize's peak beside the
#: model does not grow with it), so it is paid for a clear gain only. Measured: packing
#: saves 26% of a Llama decode step (batch 1) in the sample; 4% of a 0.7 GiB Llama's
#: 32-token prefill and 0.7% of BERT-base's call, which plain_inductor runs without a copy.
COPY_NEEDS_GAIN_BYTES = 256 * 2**20
COPY_MIN_GAIN = 0.10
#: A first-round gain above this is not timed again (noise here is a few percent).
CLEAR_GAIN = 0.15
#: After a third of the timing rounds, a candidate this much slower than the fastest is
#: dropped from the rest (it cannot win; its calls would be wasted setup time).
DROP_MARGIN = 0.10
#: A call at least this long (s) needs no warm-up round before timing: it ran in its
#: verification already, and its own one-time costs are a small part of it.
LONG_CALL_S = 0.5
ORIGINAL_NAME = "_fxopt_original"
#: GraphModule.meta key of a fused candidate's fuse-kernels record (stats, skipped sites).
KERNELS_KEY = "fxopt_fuse_kernels"
#: GraphModule.meta key of ``onednn_inductor``'s regions record (RegionReport.to_dict).
INDUCTOR_KEY = "fxopt_inductor_regions"
#: GraphModule.meta key: True on a candidate with kernels that have no gradient.
INFERENCE_ONLY_KEY = "fxopt.inference_only"


@dataclass
class LayoutChoice:
    name: str
    module: nn.Module
    #: median ms per candidate that verified; failures map to their reason.
    median_ms: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        out = {
            "chosen": self.name,
            "median_ms": {k: round(v, 4) for k, v in self.median_ms.items()},
            "rejected": dict(self.rejected),
            "autotune_s": round(self.seconds, 3),
        }
        record = getattr(self.module, "meta", {}).get(KERNELS_KEY)
        if record is not None:
            out["kernels"] = record["stats"].get("kernels", "")
            if "gemms" in record["stats"]:  # which GEMM the linears run (gemm_timing)
                out["gemms"] = record["stats"]["gemms"]
            if "merged" in record:  # linears of one input run as one GEMM (merge-linears)
                merged = record["merged"]
                out["merged_linears"] = f"{merged['linears']} in {merged['merged']} GEMMs"
            out["fused_ops"] = record["stats"].get("fused_ops", 0)
            out["kernel_skipped"] = record["skipped"]
            if record.get("inexact"):
                out["inexact"] = dict(record["inexact"])
        regions = getattr(self.module, "meta", {}).get(INDUCTOR_KEY)
        if regions is not None:
            out["inductor_regions"] = regions
            finite_only = len(regions.get("exact_for_finite_inputs_only", {}))
            if finite_only:
                inexact = out.setdefault("inexact", {})
                inexact["Inductor region (NaN, ±inf, -0.0)"] = finite_only
        if self.name == "original":
            out["note"] = (
                "no candidate was faster than the model itself: the result calls the "
                "unmodified model behind the input guard"
            )
        return out


def has_convolutions(gm: fx.GraphModule) -> bool:
    return any(
        ops.is_call(n, "conv", gm) or ops.is_call(n, "conv_transpose", gm) for n in gm.graph.nodes
    )


def has_linears(gm: fx.GraphModule) -> bool:
    return any(ops.is_call(n, "linear", gm) for n in gm.graph.nodes)


def to_channels_last(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """A copy of ``gm`` whose 4-D weights and activations are channels-last (its code not
    generated again with ``recompile=False``, for a caller that rewrites it further and
    recompiles: 5 s on a 100k-node graph). Its other weights are ``gm``'s own."""
    out = shared_copy(gm)
    with torch.no_grad():
        for tensor in [*out.parameters(), *out.buffers()]:
            if tensor.dim() == 4:
                note_derived(out, [tensor], by="the channels-last layout")
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    graph = out.graph
    for node in list(graph.nodes):
        if node.op == "placeholder" and _is_4d_float(node):
            with graph.inserting_after(node):
                converted = graph.call_method(
                    "contiguous", (node,), {"memory_format": torch.channels_last}
                )
            # Same shape and dtype (the strides differ): what the kernels' checks read.
            converted.meta.update({k: v for k, v in node.meta.items() if k == "val"})
            node.replace_all_uses_with(
                converted, delete_user_cb=lambda user, new=converted: user is not new
            )
        elif node.op == "output":
            node.args = (
                fx.node.map_arg(
                    node.args[0], lambda n, out=node: _back_to_contiguous(graph, out, n)
                ),
            )
    if recompile:
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
        out = optimize_for_inference(
            shared_copy(gm), pass_config={"conv_bn_fuse": False, "remove_dropout": False}
        )
    # Its weights are oneDNN copies (fxopt.ir.weights).
    note_derived(out, [*gm.parameters(), *gm.buffers()], by="the mkldnn layout")
    return inference_only(out)


def inference_only(module: nn.Module) -> nn.Module:
    """Mark ``module`` (a candidate of its own: its parameter objects are not the model's
    nor another candidate's) as running kernels without autograd, and freeze what is left
    of its parameters, so no output of it carries a gradient it could only get in part:
    a call that needs gradients is refused by its guard
    (:class:`fxopt.ir.contract.ModuleState`)."""
    for parameter in module.parameters():
        parameter.requires_grad_(False)
    if isinstance(module, fx.GraphModule):
        module.meta[INFERENCE_ONLY_KEY] = True
    return module


def to_onednn(
    gm: fx.GraphModule,
    *,
    in_place: bool = False,
    fast_math: bool = False,
    share_weights: bool = False,
) -> nn.Module:
    """A copy of ``gm`` with its conv2d/linear calls on oneDNN's fused, pre-packed kernels
    (``gm`` itself, rewritten, with ``in_place=True``: for a graph nobody else holds).
    ``fast_math`` also fuses what is exact for finite inputs only
    (:data:`fxopt.passes.cpu_kernels.INEXACT`). ``share_weights``: no packed copy, only
    linears where oneDNN's kernel on the model's dense weight is the faster."""
    from fxopt.passes import PassManager
    from fxopt.passes.bmm_to_matmul import BmmToMatmul
    from fxopt.passes.fuse_kernels import FuseKernels
    from fxopt.passes.merge_linears import MergeLinears

    # ATen's bmm chains back to matmul first: the attention patterns are written on it.
    passes = [BmmToMatmul(), FuseKernels(fast_math=fast_math, share_weights=share_weights)]
    if not share_weights:  # merged linears are packed copies too
        passes.append(MergeLinears())
    result = PassManager(passes, copy=not in_place).run(gm)
    records = {record.name: record for record in result.records}
    fused = records[FuseKernels.name]
    if not fused.changed:
        reasons = [str(s) for s in fused.skipped][:3]
        raise ValueError(f"nothing to lower: {'; '.join(reasons) or 'no conv2d or linear'}")
    # What the tiler chose and left out, for the report and --explain.
    result.module.meta[KERNELS_KEY] = fused.to_dict()
    merged = records.get(MergeLinears.name)
    if merged is not None and merged.changed:
        result.module.meta[KERNELS_KEY]["merged"] = merged.stats
    return inference_only(result.module)


def to_onednn_channels_last(gm: fx.GraphModule, *, fast_math: bool = False) -> nn.Module:
    """:func:`to_onednn` on :func:`to_channels_last`'s graph (a copy already: rewritten
    in place, which on a 100k-node model spares a deep copy of 15 s)."""
    channels_last = to_channels_last(gm, recompile=False)
    return to_onednn(channels_last, in_place=True, fast_math=fast_math)


def calling_original(
    gm: fx.GraphModule, model: nn.Module, *, share: bool = False
) -> fx.GraphModule:
    """A GraphModule with ``gm``'s inputs and outputs whose body calls ``model``, so an input
    guard installs on it like on any candidate: a :func:`~fxopt.ir.copying.shared_copy` of
    it with buffers of its own (the model's weights, its own state), or with ``share=True``
    the model itself (for a caller that runs it isolated and throws it away).

    ``gm`` is a capture of ``model``: module-level fx (placeholders are ``forward``'s
    positional parameters) or torch.export (placeholders are the flattened inputs, rebuilt
    with the graph's input spec; outputs flattened with its output spec).
    """
    graph = fx.Graph()
    # The same calling convention: export graphs flatten their inputs and outputs.
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    placeholders = [
        graph.node_copy(node, lambda n: n) for node in gm.graph.find_nodes(op="placeholder")
    ]
    root = nn.Module()  # gm's parameters are not needed (nor copied): only the model's
    copied: list[torch.Tensor] = []
    if not share:
        model = shared_copy(model)
        copied = own_written_buffers(model)
    root.add_module(ORIGINAL_NAME, model)
    in_spec, out_spec = _specs(gm)
    if in_spec is None:
        call = graph.call_module(ORIGINAL_NAME, tuple(placeholders))
        result: object = call
    elif not (_plain_containers(in_spec) and _plain_containers(out_spec)):
        # A transformers cache (or output class) is rebuilt from tensors, which graph
        # nodes are not: the call rebuilds the arguments when it runs, and flattens its
        # result.
        root.add_module(ORIGINAL_NAME, _CalledFromLeaves(model, in_spec, out_spec))
        call = graph.call_module(ORIGINAL_NAME, tuple(placeholders))
        result = [
            graph.call_function(operator.getitem, (call, i)) for i in range(out_spec.num_leaves)
        ]
    else:
        args, kwargs = pytree.tree_unflatten(placeholders, in_spec)
        call = graph.call_module(ORIGINAL_NAME, tuple(args), dict(kwargs))
        result = _flattened(graph, call, out_spec)
    graph.output(result)
    out = fx.GraphModule(root, graph)
    out.meta.update(gm.meta)
    # It reads the model's weights, not gm's; its buffers are copies of the model's,
    # which do not follow the model's changes (fxopt.ir.weights).
    out.meta.pop(DERIVED_KEY, None)
    note_derived(out, copied, by="the copy of the model's buffers")
    return out


def _plain_containers(spec: pytree.TreeSpec | None) -> bool:
    """True when ``spec`` nests tuples, lists and dicts only (graph nodes can be put in
    them and taken out by indexing)."""
    if spec is None or spec.is_leaf():
        return True
    return spec.type in (tuple, list, dict) and all(map(_plain_containers, spec.children()))


class _CalledFromLeaves(nn.Module):
    """``model`` called with the arguments ``in_spec`` rebuilds from the tensors it is
    given, its result returned as the leaves ``out_spec`` orders. A transformers cache is
    rebuilt holding the given tensors (:func:`fxopt.caches.returned_without_copies`: its
    own rebuild copies them)."""

    def __init__(self, model: nn.Module, in_spec: pytree.TreeSpec, out_spec: pytree.TreeSpec):
        super().__init__()
        self.model = model
        self.in_spec = caches.returned_without_copies(in_spec)
        self.leaves = out_spec.num_leaves

    def forward(self, *leaves) -> tuple:
        args, kwargs = pytree.tree_unflatten(list(leaves), self.in_spec)
        out = pytree.tree_leaves(self.model(*args, **kwargs))
        if len(out) != self.leaves:
            raise ValueError(
                f"the model returned {len(out)} tensors and values, its graph {self.leaves}"
            )
        return tuple(out)


def _specs(gm: fx.GraphModule):
    codegen = getattr(gm.graph, "_codegen", None)
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return None, None
    return info.in_spec, info.out_spec


def _flattened(graph: fx.Graph, value: fx.Node, spec) -> list:
    """``value``'s leaves in ``spec``'s order, as getitem nodes (tuple/list/dict outputs)."""
    if spec is None or spec.num_children == 0 or spec.is_leaf():
        return [value]
    keys = spec.context if isinstance(spec.context, (list, tuple)) else range(spec.num_children)
    leaves: list = []
    for key, child in zip(keys, spec.children()):
        item = graph.call_function(operator.getitem, (value, key))
        leaves += _flattened(graph, item, child)
    return leaves


#: Why the ``mkldnn`` candidate is fast_math only (torch's optimize_for_inference runs
#: activations on oneDNN tensors, whose ReLU maps NaN to 0 like the fused post-op).
_MKLDNN_INEXACT = "torch's oneDNN layout runs ReLU on oneDNN tensors, which maps NaN to 0"

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "channels_last": to_channels_last,
    "mkldnn": to_mkldnn,
    "onednn": to_onednn,
    "onednn_channels_last": to_onednn_channels_last,
}


def autotune(
    gm: fx.GraphModule,
    reference: nn.Module,
    example_inputs: Sequence,
    *,
    candidates: Sequence[str] = DEFAULT_CANDIDATES,
    budget_s: float = 1.5,
    min_gain: float = 0.03,
    extra_inputs: Sequence[Sequence] = (),
    fast_math: bool = False,
    only: str | None = None,
    _expected_cache: dict | None = None,
    _call_s: float | None = None,
) -> LayoutChoice:
    """Build, verify and time each candidate layout of ``gm``; return the fastest (or, with
    ``only``, that candidate once it built and verified, untimed: UserInputError if not).

    ``budget_s`` bounds the timing of each candidate (at least 3 calls each). Every
    candidate is verified on the example and each of ``extra_inputs`` (random values at
    other sizes of dynamic dims: a kernel packed for the example's shape must still be
    right for them), or on the example and a random input of its shapes when there are
    none; ``original`` on the smallest of them (what is checked is its call from the
    graph's inputs). Timing runs on copies of the candidates that could change their
    own state (:func:`fxopt.ir.copying.may_change_state`), so the module returned is as
    it was built; ``original`` is built again when it wins.

    A winner less than ``min_gain`` faster than ``original`` (``plain`` when the model
    cannot be called from the graph) is not taken, and that baseline is returned; one
    less than :data:`CLEAR_GAIN` faster is timed again against it before it is, unless
    each of its calls was faster than each of the baseline's. A candidate clearly behind
    after a third of the rounds is not timed further (:data:`DROP_MARGIN`).
    Two speed knobs for fxopt's own caller: ``_call_s``, the seconds of one call of ``gm``
    it measured, spares a call that estimates it when it is long; ``_expected_cache`` is
    :func:`fxopt.verify.check_outputs`'s (the reference's outputs). ``fast_math`` lets the
    fused candidates use kernels exact for finite inputs only
    (:data:`fxopt.passes.cpu_kernels.INEXACT`; the oneDNN layout of ``mkldnn`` is one).
    """
    if only is not None:
        candidates = ("plain",) if only == "plain" else ("plain", *_NEEDED.get(only, ()), only)
    unknown = [c for c in candidates if c not in CANDIDATES]
    if unknown:
        raise UserInputError(f"unknown layout {unknown[0]!r}; known: {', '.join(CANDIDATES)}")
    start = time.perf_counter()
    built: dict[str, nn.Module] = {"plain": gm}
    rejected: dict[str, str] = {}
    if not has_convolutions(gm):
        # Layout matters for convolutions; pre-packed kernels for linears and attention.
        without = "no convolutions"
        dropped = ("channels_last", "mkldnn", "onednn_channels_last")
        rejected.update({c: without for c in candidates if c in dropped})
        candidates = tuple(c for c in candidates if c not in dropped)
    expected = {} if _expected_cache is None else _expected_cache
    if not fast_math and "mkldnn" in candidates:
        rejected["mkldnn"] = f"fast_math only: {_MKLDNN_INEXACT}"
        candidates = tuple(c for c in candidates if c != "mkldnn")
    built.update(
        _build(
            gm,
            reference,
            example_inputs,
            candidates,
            extra_inputs,
            rejected,
            expected,
            call_s=_call_s,
            fast_math=fast_math,
        )
    )
    if only is not None and only not in built:
        raise UserInputError(f"layout '{only}' cannot be used here: {rejected[only]}")
    if only is not None:
        module = calling_original(gm, reference) if only == "original" else built[only]
        return LayoutChoice(only, module, {}, rejected, time.perf_counter() - start)
    if len(built) == 1:
        return LayoutChoice("plain", gm, {}, rejected, time.perf_counter() - start)
    with _Racers(built) as timed:
        choice = _choose(
            gm, reference, example_inputs, timed, rejected, start, budget_s, min_gain, _call_s
        )
    if choice.name == "original":
        # The built ``original`` ran in the check and the race, isolated; the one handed
        # back is built now that the model is as it was, and has never run.
        choice.module = calling_original(gm, reference)
    return choice


def _choose(
    gm: fx.GraphModule,
    reference: nn.Module,
    example_inputs: Sequence,
    timed: _Racers,
    rejected: dict[str, str],
    start: float,
    budget_s: float,
    min_gain: float,
    call_s: float | None,
) -> LayoutChoice:
    """Time the candidates in ``timed`` and choose one (see :func:`autotune`)."""
    if call_s is not None and call_s >= LONG_CALL_S:
        # A call as long as the one already measured needs no separate estimate.
        runs, per_call = _runs_for(budget_s, call_s), call_s
    else:
        runs, per_call = _runs_within(budget_s, timed["plain"], example_inputs)
    # Warm-up: every candidate already ran at the example's size in its verification (the
    # packing and primitive creation are behind it); small models still get two rounds for
    # the allocator and caches, long calls none (their one-time costs are noise).
    warmup = 0 if per_call > LONG_CALL_S else 1 if per_call > 0.2 else 2
    # What a candidate must beat: the model itself when it could be called, so the result
    # is never slower than the model; the plain graph otherwise.
    base = "original" if "original" in timed else "plain"
    samples = _race(timed, example_inputs, runs, warmup, base, rejected, min_gain)
    median = {name: statistics.median(values) for name, values in samples.items()}
    # Among the candidates still in the race: one dropped from it is freed already.
    best = min(timed, key=median.__getitem__)
    if best != base and median[best] > median[base] * (1 - min_gain):
        best = base  # not clearly faster
    if (
        best != base
        and median[best] > median[base] * (1 - CLEAR_GAIN)
        and not _separated(samples[best], samples[base], min_gain)
    ):
        # Confirm a small gain whose samples overlap in a second interleaved round: on a
        # loaded machine one round picked channels-last for MobileNetV2 at batch 1, which
        # a longer benchmark then measured 14% slower than plain.
        again = bench.measure_latency(
            {base: timed[base], best: timed[best]}, example_inputs, runs=runs, warmup=1
        )
        confirmed = again[best]["median_ms"] <= again[base]["median_ms"] * (1 - min_gain)
        median[f"{best} (confirmation)"] = again[best]["median_ms"]
        median[f"{base} (confirmation)"] = again[base]["median_ms"]
        if not confirmed:
            rejected[best] = "faster in the first round only; not confirmed"
            best = base
    return LayoutChoice(best, timed.built[best], median, rejected, time.perf_counter() - start)


class _Racers(dict):
    """The built candidates, name → what to call: isolated where a call could change one
    (``original`` is the model itself), so the module returned is as it was built and the
    model as it was. Deleting a name frees that candidate at once (a packed candidate
    holds a copy of the weights it packed); leaving the block ends every session."""

    def __init__(self, built: dict[str, nn.Module]):
        super().__init__()
        self.built = built
        self._sessions: dict[str, contextlib.ExitStack] = {}
        for name, module in built.items():
            session = self._sessions[name] = contextlib.ExitStack()
            self[name] = (
                session.enter_context(isolated(module)) if may_change_state(module) else module
            )

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self._sessions.pop(name).close()
        del self.built[name]

    def __enter__(self) -> _Racers:
        return self

    def __exit__(self, *exc: object) -> None:
        for session in self._sessions.values():
            session.close()


def _build(
    gm: fx.GraphModule,
    reference: nn.Module,
    example_inputs: Sequence,
    candidates: Sequence[str],
    extra_inputs: Sequence[Sequence],
    rejected: dict[str, str],
    expected: dict,
    *,
    call_s: float | None = None,
    fast_math: bool = False,
) -> dict[str, nn.Module]:
    """Each candidate but ``plain`` that builds and verifies; why not into ``rejected``.
    ``expected`` caches the reference's outputs (:func:`fxopt.verify.check_outputs`). A
    fused-kernel candidate is not built when its kernels, timed on a sample of the graph's
    shapes, lose clearly (:func:`_losing`; ``call_s``: one call's seconds, when known)."""
    built: dict[str, nn.Module] = {}
    sampled: dict[str, object] = {}
    for name in candidates:
        if name == "plain":
            continue
        if any(better in built for better in FALLBACK_FOR.get(name, ())):
            rejected[name] = "not measured: the fused-kernel candidates were built"
            continue
        if name in _INDUCTOR:
            base = gm if name == "plain_inductor" else built.get(_NEEDED[name][0])
            args = (reference, example_inputs, extra_inputs, built, rejected, expected)
            _build_inductor(name, base, *args, fast_math=fast_math)
            continue
        options: dict | str = {}
        if name in _FUSED:
            options = _fused_options(name, gm, sampled, call_s, fast_math)
        if isinstance(options, str):
            rejected[name] = options
            continue
        no_room = None if options.get("share_weights") else _no_room_for(name, gm)
        if no_room:
            rejected[name] = no_room
            continue
        try:
            if name == "original":
                # The model itself: what is checked is its call from the graph's inputs
                # and outputs, which no input size changes; on the smallest input set.
                module: nn.Module = calling_original(gm, reference, share=True)
                smallest = min([example_inputs, *extra_inputs], key=_elements)
                check = verify.check_outputs(
                    reference,
                    module,
                    smallest,
                    random_sets=0,
                    _expected_cache=expected,
                    _copy_candidate=False,  # a throwaway: autotune builds it again to return it
                )
            else:
                build = _BUILDERS[name]
                module = build(gm, **options) if name in _FUSED else build(gm)
                check = _checked(reference, module, example_inputs, extra_inputs, expected)
        except Exception as error:  # a candidate that cannot be built is just not chosen
            rejected[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        if not check.ok:
            rejected[name] = f"outputs differ: {check.message}"
            continue
        built[name] = module
    return built


def _build_inductor(
    name: str,
    base: nn.Module | None,
    reference: nn.Module,
    example_inputs: Sequence,
    extra_inputs: Sequence[Sequence],
    built: dict[str, nn.Module],
    rejected: dict[str, str],
    expected: dict,
    fast_math: bool = False,
) -> None:
    """``name`` (``onednn_inductor``, ``plain_inductor``) into ``built`` (or why not into
    ``rejected``): the graph ``base`` (onednn's, sharing its packed weights; the plain
    graph) with its pure-op regions compiled by Inductor."""
    from fxopt.passes import inductor_regions

    if not inductor_regions.enabled():
        rejected[name] = f"turned off ({inductor_regions.ENV_SWITCH}=0)"
        return
    if not isinstance(base, fx.GraphModule):
        rejected[name] = f"needs the {_NEEDED[name][0]} candidate, which was not built"
        return
    module = graph_copy(base)
    try:
        report = inductor_regions.compile_regions(
            module, example_inputs, min_ops=INDUCTOR_MIN_OPS, fast_math=fast_math
        )
        if not report.regions:
            reasons = "; ".join(f"{k}: {v}" for k, v in list(report.left.items())[:2])
            raise ValueError(f"no region compiled ({reasons or 'none found'})")
        module.meta[INDUCTOR_KEY] = report.to_dict()
        check = _checked(reference, module, example_inputs, extra_inputs, expected)
    except Exception as error:  # a candidate that cannot be built is just not chosen
        rejected[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        return
    if not check.ok:
        rejected[name] = f"outputs differ: {check.message}"
        return
    built[name] = _whole_graph(
        base, module, report, reference, example_inputs, extra_inputs, expected
    )


def _whole_graph(
    base: fx.GraphModule,
    regions: fx.GraphModule,
    report,
    reference: nn.Module,
    example_inputs: Sequence,
    extra_inputs: Sequence[Sequence],
    expected: dict,
) -> fx.GraphModule:
    """``regions`` (the onednn_inductor candidate) as one call of code Inductor generated
    for the whole graph at the example's sizes, when every region compiled exactly (else,
    or when it does not verify, ``regions`` itself); the record says which."""
    from fxopt.passes import inductor_regions

    record = regions.meta[INDUCTOR_KEY]
    if report.left:
        record["whole_graph"] = "not tried: some regions stay eager"
        return regions
    try:
        whole, why_not, seconds = inductor_regions.compile_whole(base, regions, example_inputs)
        if whole is not None:
            check = _checked(reference, whole, example_inputs, extra_inputs, expected)
            why_not = "" if check.ok else f"outputs differ: {check.message}"
    except Exception as error:  # the regions candidate stands
        why_not, seconds = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}", 0.0
    record["whole_graph"] = why_not or "compiled"
    if not why_not and inductor_regions.ONE_ROW_KEY in whole.meta:
        record["one_row_linears"] = whole.meta.pop(inductor_regions.ONE_ROW_KEY)
    record["compile_s"] = round(record["compile_s"] + seconds, 2)
    return regions if why_not else whole


def _checked(
    reference: nn.Module,
    module: nn.Module,
    example_inputs: Sequence,
    extra_inputs: Sequence[Sequence],
    expected: dict,
) -> verify.CheckResult:
    """A built candidate checked against the reference on the example and the inputs at
    other sizes (other sizes carry random values already: a random set at the example's
    size would add a call of each candidate and the reference), or on one random set at
    the example's size when there are none."""
    return verify.check_outputs(
        reference,
        module,
        example_inputs,
        random_sets=0 if extra_inputs else 1,
        extra_sets=extra_inputs,
        _expected_cache=expected,
    )


#: What a candidate is built from, built first when it is asked for alone.
_NEEDED = {"onednn_inductor": ("onednn",), "plain_inductor": ("plain",)}
_INDUCTOR = ("onednn_inductor", "plain_inductor")

#: The candidates built on the packed conv/linear kernels.
_FUSED = ("onednn", "onednn_channels_last")


def _losing(gain, call_s: float | None) -> str | None:
    """Why the fused candidates are not built: their kernels, timed on a sample of the
    graph's shapes, lose more than :data:`DROP_MARGIN` of a call (what would drop them
    from the race after a third of its rounds). The sample times conv/linear kernels and
    a fused ReLU only (not other fused activations, residual adds or attention), so a
    smaller loss is left to the race."""
    if gain is None or not call_s or gain.saved_s >= -DROP_MARGIN * call_s:
        return None
    return f"not built: {gain.describe()}, a call takes {call_s * 1e3:.1f} ms"


def _fused_options(
    name: str, gm: fx.GraphModule, sampled: dict, call_s: float | None, fast_math: bool
) -> dict | str:
    """The builder's options for fused candidate ``name``, or why it is not built. Where
    its packed copy is not paid for (:func:`_copy_unpaid`), ``onednn`` is built without
    one: oneDNN's linears read the model's own dense weights (on a 0.7 GiB Llama's 32-token
    prefill, 2 threads, they ran 1.2-1.7x faster than MKL's packed GEMM at 8-128 rows)."""
    if "gain" not in sampled:
        sampled["gain"] = sampled_gain(gm)
    losing = _losing(sampled["gain"], call_s)
    if losing:
        return losing
    unpaid = _copy_unpaid(name, gm, sampled, call_s)
    if unpaid and name != "onednn":
        return unpaid
    copied = _copied_bytes(name, gm)
    if not unpaid and name == "onednn" and call_s and copied >= COPY_NEEDS_GAIN_BYTES:
        # Paid for against the plain graph; against oneDNN on the dense weights too?
        if "shared" not in sampled:
            sampled["shared"] = sampled_gain(gm, shared=True)
        shared = sampled["shared"].saved_s if sampled["shared"] is not None else 0.0
        unpaid = (sampled["gain"].saved_s - shared) / call_s < COPY_MIN_GAIN
    return {"fast_math": fast_math, **({"share_weights": True} if unpaid else {})}


def _copy_unpaid(name: str, gm: fx.GraphModule, sampled: dict, call_s: float | None) -> str:
    """Why candidate ``name`` is not built: it would copy :data:`COPY_NEEDS_GAIN_BYTES` or
    more of weights, and its sampled kernels save less than :data:`COPY_MIN_GAIN` of a
    call (or could not be sampled); else ""."""
    copied = _copied_bytes(name, gm)
    if copied < COPY_NEEDS_GAIN_BYTES or not call_s:
        return ""
    gain = sampled.get("gain")
    saved = gain.saved_s / call_s if gain is not None else None
    if saved is not None and saved >= COPY_MIN_GAIN:
        return ""
    what = (
        f"its kernels would save {saved:.1%} of a call"
        if saved is not None
        else "its kernels could not be sampled"
    )
    return (
        f"not built: it copies {memory.gib(copied)} of weights and {what} (a copy that size "
        f"is paid for {COPY_MIN_GAIN:.0%} or more)"
    )


def _copied_bytes(name: str, gm: fx.GraphModule) -> int:
    """Weight bytes candidate ``name`` holds a copy of (packed for oneDNN, or laid out
    channels-last)."""
    if name in ("plain", "original", "plain_inductor"):
        return 0
    rank = 4 if name == "channels_last" else 2
    return sum(
        t.numel() * t.element_size()
        for t in (*gm.parameters(), *gm.buffers())
        if t.dim() >= rank and t.layout == torch.strided
    )


def _no_room_for(name: str, gm: fx.GraphModule) -> str | None:
    """Why candidate ``name`` is not built: the weights it would copy (packed for oneDNN,
    or laid out channels-last) do not fit in the memory the machine has free; else None."""
    copied = _copied_bytes(name, gm)
    if not copied:
        return None
    room = memory.available_bytes()
    if room is None or copied < room * ROOM_FRACTION:
        return None
    return (
        f"not built: it copies {memory.gib(copied)} of weights and the machine has "
        f"{memory.gib(room)} free"
    )


#: A candidate is built only if the weights it copies take at most this share of the memory
#: the machine has free (the rest is for the model's activations while it is checked).
ROOM_FRACTION = 0.8


def _elements(inputs: Sequence) -> int:
    return sum(x.numel() for x in pytree.tree_leaves(list(inputs)) if isinstance(x, torch.Tensor))


def _race(
    timed: dict[str, nn.Module],
    inputs: Sequence,
    runs: int,
    warmup: int,
    base: str,
    rejected: dict[str, str],
    min_gain: float,
) -> dict[str, list[float]]:
    """Interleaved per-call times (ms) of each candidate, ``runs`` rounds or fewer.

    After the first third of the rounds, a candidate more than :data:`DROP_MARGIN` slower
    than the fastest so far stops being timed (``base`` never does): it cannot win, and
    on a model whose call takes seconds each of its calls is setup time the user waits for.
    Timing ends early once the outcome is :func:`_decided`.
    """
    clock = time.process_time if bench.default_clock(inputs) == "process" else time.perf_counter
    devices = {x.device for x in pytree.tree_leaves(list(inputs)) if isinstance(x, torch.Tensor)}
    samples: dict[str, list[float]] = {name: [] for name in timed}
    live = timed  # a candidate dropped from the race leaves it (and is freed: _Racers)
    first_stage = max(1, runs // 3)
    call_inputs = caches.per_call(tuple(inputs))
    with torch.inference_mode():
        for _ in range(warmup):
            for module in live.values():
                module(*call_inputs())
        bench.synchronize(devices)
        for round_ in range(runs):
            for name, module in live.items():
                args = call_inputs()
                start = clock()
                module(*args)
                bench.synchronize(devices)
                samples[name].append((clock() - start) * 1e3)
            if round_ + 1 == first_stage and round_ + 1 < runs:
                so_far = {name: statistics.median(samples[name]) for name in live}
                fastest = min(so_far.values())
                for name, value in so_far.items():
                    if name != base and value > fastest * (1 + DROP_MARGIN):
                        rejected[name] = (
                            f"{value / fastest - 1:.0%} slower than the fastest after "
                            f"{first_stage} of {runs} rounds; timing stopped"
                        )
                        del live[name]
            if round_ + 1 < runs and _decided(samples, live, base, min_gain):
                break
    return samples


def _decided(samples: dict[str, list[float]], live: dict, base: str, min_gain: float) -> bool:
    """One candidate left against ``base``, and each of its 2 or more calls faster than
    each of the baseline's by ``min_gain``: more rounds would not change the choice."""
    others = [name for name in live if name != base]
    if len(others) != 1 or base not in live:
        return False
    mine, theirs = samples[others[0]], samples[base]
    return len(mine) >= 2 and max(mine) < min(theirs) * (1 - min_gain)


def _separated(faster: Sequence[float], slower: Sequence[float], min_gain: float) -> bool:
    """Every sample of ``faster`` below every sample of ``slower``: with 3 or more each
    (for 3 against 3 that ordering arises by chance once in 20 when the two are equal), or
    2 or more each and a gap of ``min_gain`` between them (a race ended by _decided)."""
    if min(len(faster), len(slower)) >= 3 and max(faster) < min(slower):
        return True
    return min(len(faster), len(slower)) >= 2 and max(faster) < min(slower) * (1 - min_gain)


def _runs_within(budget_s: float, module: nn.Module, inputs: Sequence) -> tuple[int, float]:
    """Timed calls per candidate within ``budget_s`` (3 to 200), and one call's seconds.

    Sub-millisecond models need many calls: with 25, two timings of the same module
    differed by 15% on a 0.8 ms transformer. A first call of :data:`LONG_CALL_S` or more
    is taken as the estimate (one-time costs are a small part of it); a shorter one is
    called again, its first call having paid them."""
    call_inputs = caches.per_call(tuple(inputs))
    with torch.inference_mode():
        args = call_inputs()
        begin = time.perf_counter()
        module(*args)
        per_call = time.perf_counter() - begin
        if per_call < LONG_CALL_S:
            args = call_inputs()
            begin = time.perf_counter()
            module(*args)
            per_call = time.perf_counter() - begin
    return _runs_for(budget_s, per_call), per_call


def _runs_for(budget_s: float, per_call: float) -> int:
    return max(3, min(200, int(budget_s / max(per_call, 1e-6))))
