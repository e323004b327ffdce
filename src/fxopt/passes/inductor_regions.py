"""Regions of pure ATen ops between a graph's kernels, run by code Inductor generates.

    graph ── partition the ops Inductor fuses ── compile each region ── check it on
             NaN, ±inf and -0.0 ── a call of the region where its ops were

A decode step of a language model spends as much time calling the ~200 small ATen ops
between its matmuls (RMSNorm is 6 ops, RoPE 7 per query and key, SwiGLU 2) as in those
ops: each is a trip through fx's generated Python and the dispatcher. torch ships no
kernel for RMSNorm or RoPE, so these regions are compiled by Inductor, torch's own code
generator (``compile_fx_inner``, after Inductor's own decompositions): one C++ call per
region. The kernels the layout step chose (MKL's packed linears, attention, embedding
lookups) stay as they are, between the regions.

What a region may hold: ops (ATen's, or torch functions and methods in a module-level
graph) the op table knows as pure (nothing written in place,
nothing random, no state), on float32, float64, integer or bool values (Inductor computes
float16/bfloat16 in float32 and rounds once, where eager rounds after every op), that are
not a matmul, convolution, attention or embedding. A region ending in a view of its input
would hand back a copy where eager hands back the input's storage, so trailing views
stay outside. A region with fewer than :data:`MIN_COMPUTE_OPS` ops that compute is not
worth its call.

Exact by default. Inductor builds its C++ with ``-fno-signed-zeros`` and rewrites
arithmetic, so every region is run on its example inputs with NaN, ±inf and -0.0 written
in, and on their negated zeros, beside its own fx graph; one whose NaN, infinities or
signs of zero differ, or whose finite values differ by more than float32 rounding, is
left to eager, with the reason. Found so: Inductor's GELU gives NaN at -inf (eager
-0.0), and its LayerNorm loses -0.0. With ``fast_math`` a region that differs only on
such values is kept, and listed in the report.

Sizes. A region is compiled for the example's sizes, strides and dtypes; each call
compares its inputs with them and runs the region's fx graph on any other (a decode
step's norms and projections keep one size while its cache grows; what reads the cache
then runs eager). A whole graph (:func:`compile_whole`) is compiled with the sizes the
captured graph lets vary symbolic where the example's is 2 or more, and runs each call
its shape environment's guards accept. (Sizes of 0 and 1 are specialised: compiled for
an exported graph's symbolic batch of 1, a region returned batch 1 for batch 8.)

    >>> import torch
    >>> from fxopt.capture import trace
    >>> class Norm(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    >>> gm = trace(Norm(), (torch.randn(2, 8),), mode="export")
    >>> report = compile_regions(gm, (torch.randn(2, 8),))
    >>> report.regions, report.ops
    (1, 5)
"""

from __future__ import annotations

import contextlib
import operator
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from fxopt.ir import meta, ops
from fxopt.ir.compiled import (
    CompiledRegion,
    SymbolicLayouts,
    calling,
    flat_graph,
    inline,
    input_leaves,
    layout_of,
    returns_a_tuple,
)
from fxopt.passes import cpu_kernels, gemm_timing, row_reductions

#: A region with fewer ops that compute (views do not count) stays eager.
MIN_COMPUTE_OPS = 2
#: Set to "0" to leave every region eager (the layout step then builds no such candidate).
ENV_SWITCH = "FXOPT_INDUCTOR_REGIONS"
#: Ops that stay the layout step's kernels: Inductor would call the same extern kernels.
KERNELS = frozenset(
    {
        "linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "conv", "conv_transpose",
        "embedding", "scaled_dot_product_attention",
    }
)  # fmt: skip
_EXACT_DTYPES = (torch.float32, torch.float64)
#: Finite outputs of a compiled region may differ from eager's by float32 rounding of a
#: different summation order, no more.
_RTOL, _ATOL = 1e-5, 1e-6


@dataclass
class RegionReport:
    """What :func:`compile_regions` did: regions compiled, the ATen ops inside them, the
    seconds compiling took, and each region left eager with the reason."""

    regions: int = 0
    ops: int = 0
    seconds: float = 0.0
    left: dict[str, str] = field(default_factory=dict)
    #: Regions compiled with ``fast_math`` although NaN, ±inf or -0.0 change their answer.
    inexact: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = {
            "regions": self.regions,
            "ops": self.ops,
            "compile_s": round(self.seconds, 2),
            "left_eager": dict(self.left),
        }
        if self.inexact:
            out["exact_for_finite_inputs_only"] = dict(self.inexact)
        return out


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def compile_regions(
    gm: fx.GraphModule, example_inputs: Sequence, *, min_ops: int = 0, fast_math: bool = False
) -> RegionReport:
    """Rewrite ``gm`` in place: each region of pure ATen ops between its kernels becomes a
    call of a :class:`~fxopt.ir.compiled.CompiledRegion`. ``gm`` is called on
    ``example_inputs`` once (the regions' inputs are recorded for compiling and checking).
    Nothing is compiled when the regions hold fewer than ``min_ops`` ops that compute.
    ``fast_math`` also keeps a region whose answer differs from its ATen ops only where
    an input is NaN, ±inf or -0.0 (listed in the report). Returns what was compiled and
    what was left eager, and why."""
    started = time.perf_counter()
    report = RegionReport()
    kinds = _value_kinds(gm, example_inputs)
    support = _Support(gm, kinds)
    partitions = CapabilityBasedPartitioner(
        gm, support, allows_single_node_partition=True
    ).propose_partitions()
    chosen = [p for p in (_without_trailing_views(p, gm) for p in partitions) if p]
    chosen = [p for p in chosen if _compute_ops(p, gm) >= MIN_COMPUTE_OPS]
    total = sum(_compute_ops(p, gm) for p in chosen)
    if total < min_ops:
        report.left["(graph)"] = f"{total} ops in regions, fewer than {min_ops}"
        chosen = []
    if not chosen:
        report.seconds = time.perf_counter() - started
        return report
    fuse_by_partitions(gm, [dict.fromkeys(p) for p in chosen], prefix="_fxopt_region_")
    sites = [n for n in gm.graph.nodes if n.op == "call_module" and "_fxopt_region_" in n.target]
    recorded = _region_inputs(gm, sites, example_inputs)
    for node in sites:
        sub = gm.get_submodule(node.target)
        region = _compiled(sub, node, recorded[node.target], report, fast_math)
        if region is None:
            continue  # the fx submodule stays: eager, inlined below
        setattr(gm, node.target, region)
    for node in sites:
        if not isinstance(gm.get_submodule(node.target), CompiledRegion):
            inline(gm, node)  # left eager: a submodule call would cost what it saves
    gm.recompile()
    report.seconds = time.perf_counter() - started
    return report


WHOLE_NAME = "_fxopt_whole_graph"


def compile_whole(
    base: fx.GraphModule, regions: fx.GraphModule, example_inputs: Sequence
) -> tuple[fx.GraphModule | None, str, float]:
    """``base`` (a graph of the layout step's kernels and ATen ops) compiled whole by
    Inductor, kernels included: one call instead of one per region and one per kernel
    between them; for the example's sizes, those the graph lets vary symbolic (of 2 or
    more: :func:`_whole_region`). ``regions`` (``base`` after :func:`compile_regions`,
    which compiled every one of its regions exactly) runs any call the guards refuse.
    With one-row GEMMs it is compiled a second time with them as reductions
    (:mod:`fxopt.passes.row_reductions`), and the faster on the example is kept.

    Only for a graph with nothing Inductor could compute differently from eager beyond
    what the regions' checks covered: every region compiled exactly, no random, stateful
    or in-place op. The whole graph is checked like a region (NaN, ±inf and -0.0 written
    into the example). Returns (the module, "", seconds) or (None, why not, seconds).
    """
    started = time.perf_counter()
    why_not = _not_whole(base, example_inputs)
    if why_not:
        return None, why_not, 0.0
    flat_base, flat_regions = flat_graph(base), flat_graph(regions)
    leaves = input_leaves(base, example_inputs)
    variants = {"gemms": flat_base}
    if row_reductions.one_row_linears(flat_base) and cpu_kernels.weights_stream(base):
        variants["reductions"] = row_reductions.as_reductions(flat_base)
    built, problems = {}, {}
    for name, graph in variants.items():
        try:
            built[name] = _whole_region(graph, flat_regions, leaves)
        except Exception as error:  # Inductor cannot compile it: the regions graph stays
            problems[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
            continue
        # Finite values: the layout step's verification, which judges a whole graph's
        # rounding against float64.
        problem = _special_values_differ(flat_base, built[name], tuple(leaves), check_finite=False)
        if problem:
            problems[name] = problem
            del built[name]
    seconds = time.perf_counter() - started
    if not built:
        return None, problems["gemms"], seconds
    chosen, note = _faster_variant(built, problems, leaves)
    whole = calling(regions, built[chosen], WHOLE_NAME)
    if note:
        whole.meta[ONE_ROW_KEY] = note
    return whole, "", seconds


#: GraphModule.meta key: how a whole graph runs its one-row linears, and the times.
ONE_ROW_KEY = "fxopt.one_row_linears"
#: Reductions replace the GEMMs only when the whole graph takes under this share of the
#: time with them (timing is noisy).
REDUCTIONS_MARGIN = 0.97


def _whole_region(graph: fx.GraphModule, regions: fx.GraphModule, leaves: list):
    """``graph`` compiled by Inductor, as a region whose other calls run ``regions``: for
    the example's sizes, but with the sizes the graph lets vary (a KV cache's length)
    symbolic where the example's is 2 or more, under the guards Inductor's shape
    environment collected (:class:`SymbolicLayouts`)."""
    kept = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def tensors_only(*tensors):
        full = list(leaves)
        for index, tensor in zip(kept, tensors):
            full[index] = tensor
        return graph(*full)

    varying = _varying_dims(graph, leaves)
    dims = [varying.get(i, ()) for i in kept]
    code, symbolic = _inductor(tensors_only, [leaves[i] for i in kept], dims)
    layouts: object = tuple(map(layout_of, leaves))
    if symbolic is not None:
        fakes, shape_env = symbolic
        layouts = SymbolicLayouts(leaves, kept, fakes, shape_env)
    return CompiledRegion(
        regions, lambda values: code([values[i] for i in kept]), layouts, single=False
    )


def _varying_dims(graph: fx.GraphModule, leaves: list) -> dict[int, tuple[int, ...]]:
    """{input position: its dims the graph lets vary (symbolic sizes in its placeholders'
    fake values) whose size in the example is 2 or more} (sizes 0 and 1 would be
    specialised by Inductor's shape environment, and stay the example's)."""
    found = {}
    placeholders = graph.graph.find_nodes(op="placeholder")
    for position, (node, leaf) in enumerate(zip(placeholders, leaves)):
        value = node.meta.get("val")
        if not isinstance(leaf, torch.Tensor) or not isinstance(value, torch.Tensor):
            continue
        pairs = enumerate(zip(value.shape, leaf.shape))
        dims = tuple(d for d, (size, n) in pairs if not isinstance(size, int) and n >= 2)
        if dims:
            found[position] = dims
    return found


def _faster_variant(built: dict, problems: dict, leaves: list) -> tuple[str, str]:
    """The variant to keep (the GEMMs unless one-row reductions are timed faster) and
    the note for the report."""
    if "reductions" not in built:
        why = problems.get("reductions")
        return "gemms", f"on their GEMMs (as reductions: {why})" if why else ""
    if "gemms" not in built:
        return "reductions", f"as reductions (on their GEMMs: {problems['gemms']})"
    times = _timed_calls({name: built[name] for name in ("gemms", "reductions")}, leaves)
    ratio = times["reductions"] / times["gemms"]
    kept = "reductions" if ratio < REDUCTIONS_MARGIN else "gemms"
    ms = {name: f"{t * 1e3:.2f}" for name, t in times.items()}
    return kept, (
        f"{'as reductions' if kept == 'reductions' else 'on their GEMMs'}: "
        f"{ms['reductions']} ms a call as reductions, {ms['gemms']} on GEMMs"
    )


def _timed_calls(calls: dict, leaves: list, rounds: int = 15, budget_s: float = 3.0) -> dict:
    """Median seconds of each compiled whole graph on the example, called in turn."""
    with torch.inference_mode():
        samples = gemm_timing.interleaved(
            [partial(call, *leaves) for call in calls.values()], rounds, budget_s
        )
    return {name: statistics.median(t) for name, t in zip(calls, samples)}


_SIZES = (torch.SymInt, torch.SymBool, torch.SymFloat, int, float, bool)


def _not_whole(base: fx.GraphModule, example_inputs: Sequence) -> str:
    """Why ``base`` is not compiled whole: an op Inductor could run differently from eager
    that no region's check covered; else ""."""
    table = ops.table(base)
    kinds = _value_kinds(base, example_inputs)
    for node in base.graph.nodes:
        if isinstance(node.meta.get("val"), _SIZES):
            continue  # arithmetic on sizes (a sliding window's sym_max): Inductor's to trace
        op = table[node] if ops.is_compute(node) else None
        # (detach_ writes autograd's flag, no value: a constant export lifts gets one)
        written = op is not None and op.inplace and op.name != "detach"
        if op is not None and (op.random or op.stateful or written or not op.known):
            return f"{node.name} is random, stateful, in place or unknown"
        low = [
            k
            for k in _kinds_of(node, kinds)
            if isinstance(k, torch.dtype) and k.is_floating_point and k not in _EXACT_DTYPES
        ]
        if op is not None and low:
            # Inductor computes them in float32 and rounds once; eager after each op
            return f"{node.name} computes in {low[0]}"
    return ""


class _Support(OperatorSupportBase):
    def __init__(self, gm: fx.GraphModule, kinds: dict[fx.Node, object]):
        self.table = ops.table(gm)
        self.kinds = kinds

    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        if node.op not in ("call_function", "call_method"):
            return False
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace != "aten":
            return False
        op = self.table[node]
        if not op.known or not op.pure or op.name in KERNELS:
            return False
        if op.name == "cat" and any(user.op == "output" for user in node.users):
            # A grown KV cache: copying is all its work, and ATen's cat copies each
            # operand with memcpy (2x Inductor's loop at symbolic sizes, measured).
            return False
        found = _kinds_of(node, self.kinds)
        if any(not isinstance(kind, torch.dtype) for kind in found):
            return False  # a size, None: not a region's value
        return not any(kind.is_floating_point and kind not in _EXACT_DTYPES for kind in found)


def _kinds_of(node: fx.Node, kinds: dict[fx.Node, object]) -> list:
    """The dtype of ``node``'s value (each, for an op returning several tensors) and of
    each tensor it reads."""
    found = []
    for value in (node, *ops.tensor_args(node)):
        kind = kinds.get(value)
        found.extend(kind if isinstance(kind, tuple) else [kind])
    return found


def _value_kinds(gm: fx.GraphModule, example_inputs: Sequence) -> dict[fx.Node, object]:
    """Each node's value's dtype (None when it is not one tensor), from its shape
    metadata; filled from a run on the example when a node a pass added has none."""
    if any(ops.is_compute(n) and not _has_metadata(n) for n in gm.graph.nodes):
        from fxopt.capture import propagate_shapes

        propagate_shapes(gm, example_inputs)
    return {node: _kind(node) for node in gm.graph.nodes}


def _kind(node: fx.Node) -> object:
    """A tensor's dtype; a tuple of dtypes for an op returning tensors (LayerNorm's
    output, mean and rstd); None for anything else."""
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    if isinstance(value, (tuple, list)) and value:
        kinds = tuple(getattr(v, "dtype", None) for v in value)
        return kinds if all(isinstance(k, torch.dtype) for k in kinds) else None
    return meta.dtype(node)


def _has_metadata(node: fx.Node) -> bool:
    return "val" in node.meta or "tensor_meta" in node.meta


def _without_trailing_views(partition: Partition, gm: fx.GraphModule) -> list[fx.Node]:
    """The partition's nodes, less the views whose value only leaves it (repeatedly: a
    view of a view)."""
    table = ops.table(gm)
    nodes = set(partition.nodes)
    changed = True
    while changed:
        changed = False
        for node in list(nodes):
            # Only a view that no node of the region reads: taking out one that a node of
            # the region reads too would make the region depend on itself.
            picked = node.target is operator.getitem  # a result of a multi-tensor op
            if table[node].view and not picked and not any(u in nodes for u in node.users):
                nodes.discard(node)
                changed = True
    if any(
        isinstance(n.meta.get("val"), (tuple, list)) and not n.users.keys() <= nodes for n in nodes
    ):
        return []  # a multi-tensor value would leave the region whole: left eager
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def _compute_ops(nodes: list[fx.Node], gm: fx.GraphModule) -> int:
    table = ops.table(gm)
    return sum(not table[n].view for n in nodes)


def _region_inputs(gm: fx.GraphModule, sites: list[fx.Node], example_inputs: Sequence) -> dict:
    """Each region's arguments on a call of ``gm`` on the example (real values)."""
    recorded: dict[str, tuple] = {}
    handles = []
    for node in sites:
        sub = gm.get_submodule(node.target)

        def hook(module, args, name=node.target):
            recorded[name] = tuple(
                a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args
            )

        handles.append(sub.register_forward_pre_hook(hook))
    gm.recompile()
    try:
        with torch.no_grad():
            gm(*example_inputs)
    finally:
        for handle in handles:
            handle.remove()
    return recorded


def _compiled(
    sub: fx.GraphModule,
    node: fx.Node,
    inputs: tuple | None,
    report: RegionReport,
    fast_math: bool = False,
) -> CompiledRegion | None:
    name = node.target
    if inputs is None:
        report.left[name] = "not reached on the example"
        return None
    single = returns_a_tuple(sub)
    count = sum(1 for n in sub.graph.nodes if ops.is_compute(n))
    try:
        code, _ = _inductor(sub, list(inputs))
        region = CompiledRegion(sub, code, tuple(map(layout_of, inputs)), single=single)
    except Exception as error:  # Inductor cannot compile it: the region stays eager
        report.left[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        return None
    inexact = _special_values_differ(sub, region, inputs)
    if inexact:
        finite = _outputs_differ(sub, region, inputs)
        if fast_math and not finite:
            report.inexact[name] = inexact
        else:
            hint = "" if finite else " (exact for finite inputs: fast_math keeps it)"
            report.left[name] = f"{finite or inexact}{hint}"
            return None
    report.regions += 1
    report.ops += count
    return region


def _inductor(sub: fx.GraphModule, inputs: list, dynamic: Sequence = ()) -> tuple:
    """(Inductor's code for ``sub``, None) at the sizes, strides and dtypes of ``inputs``,
    after Inductor's own decompositions (what ``torch.compile`` hands it). With
    ``dynamic`` (for each input, the dims to make symbolic), (code, (the fake inputs, their
    shape environment)): the code holds where that environment's guards do."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    _register_missing_fakes()
    table = select_decomp_table()
    if not any(dynamic):
        graph = make_fx(sub, decomposition_table=table)(*inputs)
        with _unpinned_code():
            return compile_fx_inner(graph, inputs), None
    fakes, shape_env = _symbolic_inputs(inputs, dynamic)
    graph = make_fx(sub, decomposition_table=table, tracing_mode="fake")(*fakes)
    with _unpinned_code():
        return compile_fx_inner(graph, fakes), (fakes, shape_env)


def _symbolic_inputs(inputs: list, dynamic: Sequence) -> tuple[list, object]:
    """Fake copies of ``inputs`` whose ``dynamic`` dims are symbolic, in one fake mode that
    lets the graph read real tensors (its weights)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    fakes = []
    for tensor, dims in zip(inputs, dynamic):
        sizes = [
            DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(tensor.dim())
        ]
        context = StatelessSymbolicContext(dynamic_sizes=sizes)
        fakes.append(mode.from_tensor(tensor, symbolic_context=context))
    return fakes, shape_env


_LINEAR_ADD = "mkldnn::_linear_pointwise.binary"


def _register_missing_fakes() -> None:
    """oneDNN's linear with a fused add has an Inductor lowering but, in torch 2.13, no
    fake kernel (its unary form has one): Inductor refused every whole graph holding it
    (UnsupportedOperatorException), and a Llama decode step whose residual adds ran in it
    fell back to its regions, 8.9 ms against 7.2 compiled whole. Registered once, and
    only where torch has none."""
    if not torch.backends.mkldnn.is_available():
        return
    if torch._C._dispatch_has_kernel_for_dispatch_key(_LINEAR_ADD, "Meta"):
        return
    from torch._library.simple_registry import singleton

    if singleton.find(_LINEAR_ADD).fake_impl.kernel is None:
        torch.library.register_fake(_LINEAR_ADD)(_linear_add_fake)


def _linear_add_fake(x, other, weight, bias, attr):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@contextlib.contextmanager
def _unpinned_code() -> Iterator[None]:
    """Inductor keeps every Python module it generates in ``PyCodeCache.modules`` and
    ``sys.modules`` for the life of the process, with the constants it compiled in as
    module attributes: a whole graph's packed weights and the model's own (0.75 GiB on a
    0.7 GiB Llama) stayed in memory after the optimized module was gone, and kept a deleted
    model's weights alive. The modules generated inside are taken off those lists: the
    compiled code holds its module's globals, and they go with it. (Internals of torch
    2.13; where they differ, the modules stay listed, as they would under torch.compile.)"""
    from torch._inductor.codecache import PyCodeCache

    listed = getattr(PyCodeCache, "modules", None)
    before = {id(module) for module in listed} if isinstance(listed, list) else None
    try:
        yield
    finally:
        if before is not None:
            new = [module for module in listed if id(module) not in before]
            listed[:] = [module for module in listed if id(module) in before]
            for module in new:
                if sys.modules.get(module.__name__) is module:
                    del sys.modules[module.__name__]


def _special_values_differ(
    sub: fx.GraphModule, region: CompiledRegion, inputs: tuple, *, check_finite: bool = True
) -> str:
    """Why ``region`` is not exact (empty when it is): its outputs against ``sub``'s on
    the example with NaN, ±inf and -0.0 written in, and on the example's negated zeros.
    ``check_finite=False`` leaves the finite values to another check (a whole graph's rounding
    adds up over its layers)."""
    for probe in (_with_special_values(inputs), _with_negative_zeros(inputs)):
        with torch.no_grad():
            expected = sub(*probe)
            got = region.compiled(list(probe))
        for index, (want, have) in enumerate(zip(expected, got)):
            problem = _differs(want, have, check_finite=check_finite)
            if problem:
                return f"not exact: output {index} {problem}"
    return ""


def _outputs_differ(sub: fx.GraphModule, region: CompiledRegion, inputs: tuple) -> str:
    """Why ``region`` differs from ``sub`` on the example itself (finite values)."""
    with torch.no_grad():
        pairs = zip(sub(*inputs), region.compiled(list(inputs)))
    return next((problem for want, have in pairs if (problem := _differs(want, have))), "")


def _with_special_values(inputs: tuple) -> tuple:
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0])
    out = []
    for value in inputs:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            value = value.clone()
            flat = value.view(-1) if value.is_contiguous() else None
            if flat is not None:
                count = min(flat.numel(), special.numel())
                flat[:count] = special[:count].to(value.dtype)
        out.append(value)
    return tuple(out)


def _with_negative_zeros(inputs: tuple) -> tuple:
    return tuple(
        value * -0.0 if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        for value in inputs
    )


def _differs(want: object, have: object, *, check_finite: bool = True) -> str:
    if not isinstance(want, torch.Tensor):
        return "" if want == have else "differs"
    if not isinstance(have, torch.Tensor):
        return f"is a {type(have).__name__}, not a tensor"
    if want.dtype != have.dtype or want.shape != have.shape:
        return (
            f"is {have.dtype} {tuple(have.shape)} where eager's is {want.dtype} {tuple(want.shape)}"
        )
    if not want.is_floating_point():
        return "" if torch.equal(want, have) else "differs"
    if not torch.equal(want.isnan(), have.isnan()):
        return "has NaN where eager has none, or none where eager has one"
    finite, infinite = want.isfinite(), want.isinf()
    if not torch.equal(finite, have.isfinite()) or not torch.equal(want[infinite], have[infinite]):
        return "has other infinities"
    zeros = want == 0
    same_signs = torch.equal(want[zeros].signbit(), have[zeros].signbit())
    if not torch.equal(zeros, have == 0) or not same_signs:
        return "has +0.0 where eager has -0.0 (or the reverse)"
    if check_finite and not torch.allclose(have[finite], want[finite], rtol=_RTOL, atol=_ATOL):
        return "differs beyond float32 rounding"
    return ""
