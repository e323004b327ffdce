"""merge-linears: linears that read the same input, on MKL's packed GEMM, as one GEMM over
their weights stacked.

    q = x @ Wqᵀ,  k = x @ Wkᵀ,  v = x @ Wvᵀ   →   q, k, v = split(x @ [Wq; Wk; Wv]ᵀ)

A decode step at batch 1 multiplies one row by each weight: its GEMMs only stream their
weights from memory, and a small weight streams at half the rate a large one does (1 MiB
at 9 GB/s, 65 MiB at 20 GB/s: AMD EPYC, 1 thread). A Llama layer's q/k/v projections and
its gate/up pair read one input each; over the step's 28 projections (hidden 512, 4
layers) the stacked GEMMs took 0.5-0.8 ms less than one per weight, 7-12 % of the step.
``torch.compile`` does not do it on CPU by default (Inductor's ``concat_linear`` is off).

It runs after :mod:`fxopt.passes.fuse_kernels`, on the linears that pass put on MKL's
packed GEMM (``mkl._mkl_linear``) with the same input node, row count, dtype and bias or
no bias, where :func:`fxopt.passes.gemm_timing.stacked_is_faster` times the stacked GEMM
faster for the group's shapes (cold for a model whose weights exceed the cache).

The stacked weight exists only packed: the dense weights stay the model's own tensors
(nothing copied beyond the packed form each linear had already; their separate packed
copies go). MKL's packed GEMM holds for the row count it was packed for; any other calls
each linear on its own dense weight (:func:`packed_linears`), as ``mkl._mkl_linear`` itself
falls back to its dense weight. Each output is contiguous, as the linear's was.

Exact as the kernels it replaces: each output element is the same dot product, on the same
GEMM (summation order, hence rounding, is the kernel's), NaN, ±inf and -0.0 included.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.passes import PassManager, gemm_timing
    >>> from fxopt.passes.fuse_kernels import FuseKernels
    >>> class QKV(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    ...     def forward(self, x):
    ...         return self.q(x) * 2, self.k(x) + 1
    >>> gemm_timing.FORCED, gemm_timing.FORCED_STACKING = "mkl", True
    >>> x = torch.randn(1, 8)
    >>> gm = trace(QKV().eval(), (x,))
    >>> result = PassManager([FuseKernels(), MergeLinears()]).run(gm)
    >>> result.records[-1].stats["merged"], result.records[-1].stats["linears"]
    (1, 2)
    >>> gemm_timing.FORCED, gemm_timing.FORCED_STACKING = None, None
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.ir.weights import note_derived
from fxopt.passes import cpu_kernels, gemm_timing
from fxopt.passes.base import Pass, PassResult, Plan, Skip
from fxopt.passes.fuse_kernels import delete_unused_submodules

_MKL_LINEAR = torch.ops.mkl._mkl_linear.default

_LIBRARY = torch.library.Library("fxopt", "FRAGMENT")
_LIBRARY.define(
    "packed_linears(Tensor x, Tensor packed, Tensor[] weights, Tensor? bias, int rows) -> Tensor[]"
)


def packed_linears(x, packed, weights, bias, rows):
    """``[x @ w.T + b for w, b in zip(weights, bias split)]``: on MKL's GEMM packed from
    the weights stacked, for ``rows`` rows of ``x``; for any other row count, each weight
    by torch's own linear."""
    columns = [w.shape[0] for w in weights]
    if x.numel() == rows * x.shape[-1]:
        whole = _sized_like(sum(columns), x.shape[-1], x)
        out = torch.ops.mkl._mkl_linear(x, packed, whole, bias, rows)
        return [piece.contiguous() for piece in out.split(columns, -1)]
    biases = bias.split(columns) if bias is not None else (None,) * len(weights)
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


def _sized_like(rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """A (rows, columns) tensor that owns one element: MKL's packed GEMM reads the stacked
    weight's sizes from its dense-weight argument, not its values (nothing writes it, so
    calls share one per size)."""
    key = (rows, columns, like.dtype, like.device)
    if key not in _SIZED:
        _SIZED[key] = like.new_zeros(()).expand(rows, columns)
    return _SIZED[key]


_SIZED: dict[tuple, torch.Tensor] = {}


def _packed_linears_fake(x, packed, weights, bias, rows):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


# Opaque to Inductor (its call is one Python call in a compiled graph): Inductor copies a
# constant into a dense buffer before it calls MKL's kernel on it, so an expanded
# placeholder became 1.5-5.6 MiB of zeros written on every call.
_LIBRARY.impl("packed_linears", packed_linears, "CompositeExplicitAutograd")
torch.library.register_fake("fxopt::packed_linears", _packed_linears_fake, lib=_LIBRARY)
PACKED_LINEARS = torch.ops.fxopt.packed_linears.default


class PackedLinears(cpu_kernels.PackedBuffers):
    """The weights of sibling linears (the model's own tensors) and, packed for MKL's GEMM
    at ``rows`` rows, the weights stacked.

        >>> w = PackedLinears([torch.randn(4, 3), torch.randn(2, 3)], None, rows=1)
        >>> w.packed.is_mkldnn, [tuple(t.shape) for t in w.weights()]
        (True, [(4, 3), (2, 3)])
    """

    def __init__(self, weights: Sequence[torch.Tensor], bias: torch.Tensor | None, rows: int):
        super().__init__()
        self.count = len(weights)
        for index, weight in enumerate(weights):
            self.register_buffer(f"weight_{index}", weight.detach())
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.rows = rows
        self._pack()

    def weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight_{i}") for i in range(self.count)]

    def _pack(self) -> None:
        stacked = torch.cat(self.weights())  # freed once packed
        packed = torch.ops.mkl._mkl_reorder_linear_weight(stacked, self.rows)
        self.register_buffer("packed", packed, persistent=False)


@dataclass(frozen=True)
class LinearGroups(Plan):
    #: each group: the ``mkl._mkl_linear`` calls to merge, in graph order
    groups: tuple[tuple[fx.Node, ...], ...] = ()


class MergeLinears(Pass[LinearGroups]):
    name = "merge-linears"
    description = "inference, CPU: linears of one input on MKL's packed GEMM as one GEMM"
    adds_parameters = True
    freezes_parameters = True  # packed weights; the kernels have no autograd

    def analyze(self, gm: fx.GraphModule) -> LinearGroups:
        alias = AliasAnalysis.of(gm)
        siblings: dict[tuple, list[fx.Node]] = {}
        for node in gm.graph.nodes:
            key = _sibling_key(gm, node)
            if key is not None:
                siblings.setdefault(key, []).append(node)
        cold = cpu_kernels.weights_stream(gm)
        groups, skipped = [], []
        for (_, rows, *_), members in siblings.items():
            if len(members) < 2:
                continue
            x = ops.args(members[0])["X"]  # the others read its value (maybe another view)
            if len({alias.version(ops.args(m)["X"], at=m) for m in members}) > 1:
                reason = f"{x.name} is written in place between the linears that read it"
                skipped.append(Skip(members[0].name, reason))
                continue
            weights = [_module_of(gm, m).dense for m in members]
            if not gemm_timing.stacked_is_faster(weights, rows, cold=cold):
                reason = "one GEMM over the stacked weights is not faster here (timed)"
                skipped.append(
                    Skip(members[0].name, f"{len(members)} linears of {x.name}: {reason}")
                )
                continue
            groups.append(tuple(members))
        return LinearGroups(skipped=tuple(skipped), groups=tuple(groups))

    def transform(self, gm: fx.GraphModule, plan: LinearGroups) -> PassResult:
        if not plan.groups:
            return PassResult(False, {"merged": 0}, plan.skipped)
        for members in plan.groups:
            _merge(gm, members)
        delete_unused_submodules(gm)
        stats = {"merged": len(plan.groups), "linears": sum(len(g) for g in plan.groups)}
        return PassResult(True, stats, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [g[0].name for g in self.analyze(gm).groups]
        assert not left, f"mergeable linears left: {left[:8]}"


def _sibling_key(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """(input, rows, dtype, columns, has a bias) of an ``mkl._mkl_linear`` call on a packed
    weight of :mod:`cpu_kernels`, else None: linears with one key merge."""
    if node.op != "call_function" or node.target is not _MKL_LINEAR:
        return None
    module = _module_of(gm, node)
    if module is None:
        return None
    arguments = ops.args(node)
    dense = module.dense
    value = _same_value(arguments["X"], gm)
    return (value, arguments["batch_size"], dense.dtype, dense.shape[1], arguments["B"] is not None)


def _same_value(x: fx.Node, gm: fx.GraphModule) -> object:
    """What identifies ``x``'s value: an ATen graph gives each linear its own
    ``view(input, [rows, columns])`` of the same input, which compute one value."""
    if ops.is_call(x, "view", gm) or ops.is_call(x, "reshape", gm):
        view = ops.args(x)
        return (ops.info(x, gm).name, _hashable(sorted(view.items())))
    return x


def _hashable(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _module_of(gm: fx.GraphModule, node: fx.Node) -> cpu_kernels.PackedWeight | None:
    packed = ops.args(node)["MKL_W"]
    if not isinstance(packed, fx.Node) or packed.op != "get_attr":
        return None
    owner = gm.get_submodule(packed.target.rpartition(".")[0])
    return owner if isinstance(owner, cpu_kernels.PackedWeight) else None


def _merge(gm: fx.GraphModule, members: tuple[fx.Node, ...]) -> None:
    graph = gm.graph
    modules = [_module_of(gm, m) for m in members]
    first = ops.args(members[0])
    x, bias, rows = first["X"], first["B"], first["batch_size"]
    stacked_bias = None if bias is None else torch.cat([m.bias for m in modules])
    weights = [m.dense for m in modules]
    name = cpu_kernels.free_name(gm)
    gm.add_module(name, PackedLinears(weights, stacked_bias, rows))
    note_derived(gm, [*weights, *(m.bias for m in modules)], by=MergeLinears.name)
    with graph.inserting_before(members[0]):
        packed = graph.get_attr(f"{name}.packed")
        dense = [graph.get_attr(f"{name}.weight_{i}") for i in range(len(members))]
        bias_node = graph.get_attr(f"{name}.bias") if bias is not None else None
        call = graph.call_function(PACKED_LINEARS, (x, packed, dense, bias_node, rows))
        if all("val" in m.meta for m in members):
            call.meta["val"] = [m.meta["val"] for m in members]
        for index, member in enumerate(members):
            piece = graph.call_function(operator.getitem, (call, index))
            piece.meta.update(member.meta)
            member.replace_all_uses_with(piece)
    for member in members:
        reads = [n for n in member.all_input_nodes if n.op == "get_attr"]
        graph.erase_node(member)
        for node in reads:
            if not node.users:
                graph.erase_node(node)
        # Its packed copy goes now, not after every group: held until then, the separate
        # and the stacked copies would all be in memory at once.
        if all(not node.users for node in reads):
            gm.delete_submodule(reads[0].target.rpartition(".")[0])
