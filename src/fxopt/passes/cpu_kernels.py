"""The fused CPU kernels fxopt emits, and the rewrite of a tile to its kernel.

Each pattern of the ``cpu`` tiling library (fxopt/tiling/library/cpu.yaml) is bound here
to a kernel PyTorch ships; :mod:`fxopt.passes.fuse_kernels` chooses the tiles:

    conv ── act ─────────────── y    _convolution_pointwise(x, W*, b, act)
    conv ── add(·, r) [── relu] ─ y    _convolution_pointwise.binary(x, r, W*, b, "add", relu)
    linear ─────────────────── y    mkl._mkl_linear(x, W*, W, b, rows) or _linear_pointwise
    linear ── act ───────────── y    _linear_pointwise(x, W*, b, act)
    linear ── add(·, r) ──────── y    _linear_pointwise.binary(x, r, W*, b, "add")
    softmax(q @ kᵀ / c [+ m]) @ v    scaled_dot_product_attention(q, k, v, m, scale=1/c)
                                     (at the ATen level after bmm-to-matmul)

``W*`` is the weight reordered once, at rewrite time, into oneDNN's blocked format
(``mkldnn._reorder_convolution_weight`` for the example's input shape, or
``_reorder_linear_weight``) or MKL's packed GEMM format for the example's row count
(``mkl._mkl_reorder_linear_weight``): eager PyTorch reorders it on every call. A linear
gets whichever of the two GEMMs is faster here for its shape (:mod:`gemm_timing`; oneDNN's
in a build without MKL); with MKL's, its post-op runs after it. Activations (relu,
relu6, hardtanh, silu, sigmoid, tanh, hardswish, gelu, leaky_relu) and a residual ``add``
run inside the kernel as oneDNN post-ops. These are the kernels ``torch.compile`` uses on
CPU after freezing.

CPU float32 only, inference only (the oneDNN kernels have no autograd formula). Packed
weights live in :class:`PackedWeight` modules, which keep the dense weight as a buffer
(what ``state_dict()`` shows) and re-pack after unpickling.

Exact by default: every kernel computes what eager computes for every input, NaN, ±inf
and -0.0 included (measured on random inputs full of them: benchmarks and
tests/test_exact.py). Not so, and fused only with ``fast_math=True`` (:data:`INEXACT`):
oneDNN's clamp post-ops (relu, relu6, hardtanh) map NaN to 0 or to their bound; its
hardswish stays finite where eager's overflows to inf; its tanh-GELU turns -0.0 into +0.0;
SDPA returns 0 on a fully masked row where softmax gives NaN, and places NaN otherwise for
non-finite inputs. By default such an activation runs after the fused kernel, in place on
its output (tanh-GELU, which has no in-place form, unfused), and attention runs on SDPA
behind a check of its inputs (:func:`attention`: finite
q/k/v, no fully masked row, scores that cannot overflow), else as eager computes it.

Not bound (each with its reason in ``--explain``): Conv1d/Conv3d and transposed convs,
non-zero padding modes, string padding, non-float32 or non-CPU weights, modules with hooks
or parametrizations, inputs of unknown shape, a residual that broadcasts, attention whose
mask or scale is not a plain tensor / number.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.utils import parametrize

from fxopt.ir import attributes, facts, meta, ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.ir.spec import runtime_helper
from fxopt.ir.weights import note_derived
from fxopt.passes import gemm_timing
from fxopt.tiling.graph import is_elided

_CONV = torch.ops.mkldnn._convolution_pointwise.default
_CONV_BINARY = torch.ops.mkldnn._convolution_pointwise.binary
_LINEAR = torch.ops.mkldnn._linear_pointwise.default
_LINEAR_BINARY = torch.ops.mkldnn._linear_pointwise.binary
_MKL_LINEAR = torch.ops.mkl._mkl_linear.default
# A linear with nothing to fuse goes to MKL's packed GEMM when this build has MKL: on
# BERT-base (128 tokens, 1 thread) it measured 1.19x eager at batch 1 where oneDNN's
# packed linear gave 1.03x and jit.freeze 1.02x. MKL fuses no post-op.
_USE_MKL_LINEAR = torch._C.has_mkl
#: Post-ops whose fused form differs from eager's for some inputs, and how (fast_math only).
INEXACT = {
    "relu": "oneDNN's fused clamp post-ops (relu, relu6, hardtanh) map NaN to 0 or a bound",
    "hardtanh": "oneDNN's fused clamp post-ops (relu, relu6, hardtanh) map NaN to 0 or a bound",
    "hardswish": "oneDNN's fused hardswish stays finite where eager's overflows to inf",
    "gelu-tanh": "oneDNN's fused tanh-GELU turns -0.0 into +0.0",
    "attention": "SDPA gives 0 on a fully masked row (eager NaN) and other NaN for NaN/inf "
    "inputs; without fast_math it runs behind a check of its inputs",
}
_PREFIX = "_fxopt_onednn"
_NEXT_FREE = "fxopt.next_packed_index"  # gm.meta key: where free_name resumes
#: SDPA's ATen op, by name: the rewrite builds it with ``ops.emit`` (with ``fast_math``;
#: else :func:`attention` calls it).
_SDPA = "aten.scaled_dot_product_attention.default"
#: The name of the op each pattern of the ``cpu`` library is rewritten to (tests check that
#: the library and this table agree).
KERNELS = {
    pattern: str(op)
    for pattern, op in {
        "conv": _CONV,
        "conv_relu": _CONV,
        "conv_relu6": _CONV,
        "conv_hardtanh": _CONV,
        "conv_hardswish": _CONV,
        "conv_silu": _CONV,
        "conv_gelu": _CONV,
        "conv_sigmoid": _CONV,
        "conv_tanh": _CONV,
        "conv_leaky_relu": _CONV,
        "conv_add": _CONV_BINARY,
        "conv_add_relu": _CONV_BINARY,
        "linear": _MKL_LINEAR if _USE_MKL_LINEAR else _LINEAR,
        "linear_gelu": _LINEAR,
        "linear_relu": _LINEAR,
        "linear_silu": _LINEAR,
        "linear_tanh": _LINEAR,
        "linear_add": _LINEAR_BINARY,
        "addmm": _MKL_LINEAR if _USE_MKL_LINEAR else _LINEAR,
        "mm": _MKL_LINEAR if _USE_MKL_LINEAR else _LINEAR,
        "addmm_gelu": _LINEAR,
        "addmm_relu": _LINEAR,
        "addmm_silu": _LINEAR,
        "addmm_tanh": _LINEAR,
        "addmm_view_add": _LINEAR_BINARY,
        "addmm_view_gelu": _LINEAR,
        "attention": _SDPA,
    }.items()
}


class PackedBuffers(nn.Module):
    """A module holding dense tensors (the model's own, as buffers) and one packed form of
    them, ``packed``, that :meth:`_pack` makes. The packed tensor may be opaque (no
    storage to copy or pickle): copies share it (nothing ever writes into it), and
    pickling keeps the dense tensors and packs again. Not persistent: ``state_dict()``
    has the dense tensors, which is what a checkpoint of the folded model should hold."""

    def _pack(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}._pack")

    def __deepcopy__(self, memo: dict) -> PackedBuffers:
        copy = type(self).__new__(type(self))
        nn.Module.__init__(copy)
        memo[id(self)] = copy
        for key, value in self.__dict__.items():  # the recipe, counts: immutable values
            if not key.startswith("_") and key != "training":
                copy.__dict__[key] = value
        # Through the memo: a deep copy copies them, a shared_copy aliases them.
        for name, buffer in self._buffers.items():
            if name != "packed":
                copy.register_buffer(name, deepcopy(buffer, memo))
        copy.register_buffer("packed", self.packed, persistent=False)  # never written
        copy.train(self.training)
        return copy

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_buffers"] = {k: v for k, v in self._buffers.items() if k != "packed"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pack()


class PackedWeight(PackedBuffers):
    """A weight pre-packed for oneDNN, beside the dense weight it was packed from (the
    model's own tensor: packing copies the weight once, into the packed form).

        >>> w = PackedWeight.for_linear(torch.randn(4, 3), torch.zeros(4))
        >>> w.packed.is_mkldnn, tuple(w.dense.shape)
        (True, (4, 3))
    """

    def __init__(self, dense: torch.Tensor, bias: torch.Tensor | None, recipe: tuple):
        super().__init__()
        self.register_buffer("dense", dense)
        self.register_buffer("bias", bias)
        # ("conv", padding, stride, dilation, groups, input_size), ("linear",) or
        # ("mkl_linear", rows): MKL packs for a row count; other counts still compute right
        self.recipe = recipe
        self._pack()

    def _pack(self) -> None:
        # A buffer, so fx's get_attr finds it.
        self.register_buffer("packed", _pack(self.dense, self.recipe), persistent=False)

    @classmethod
    def for_linear(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: int | None = None,
        *,
        shared: bool = False,
    ) -> PackedWeight:
        """``shared``: oneDNN's linear reads the dense weight itself, no packed copy."""
        recipe = ("mkl_linear", rows) if rows is not None else ("linear",)
        return cls(weight.detach(), _detached(bias), ("dense",) if shared else recipe)

    @classmethod
    def for_conv(cls, weight, bias, padding, stride, dilation, groups, input_size):
        recipe = ("conv", list(padding), list(stride), list(dilation), groups, list(input_size))
        return cls(weight.detach(), _detached(bias), recipe)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _pack(dense: torch.Tensor, recipe: tuple) -> torch.Tensor:
    if recipe[0] == "dense":  # the weight itself (oneDNN's linear takes a plain tensor)
        return dense
    if recipe[0] == "mkl_linear":
        return torch.ops.mkl._mkl_reorder_linear_weight(dense, recipe[1])
    if recipe[0] == "linear":
        return torch.ops.mkldnn._reorder_linear_weight(dense, None)
    _, padding, stride, dilation, groups, input_size = recipe
    return torch.ops.mkldnn._reorder_convolution_weight(
        dense, padding, stride, dilation, groups, input_size
    )


@dataclass(frozen=True)
class KernelSite:
    """One tile, ready to emit: the kernel, its operands and the nodes it replaces."""

    pattern: str
    kind: str  # "conv" | "linear" | "mkl_linear" | "dense_linear" (shared weight) | "attention"
    #: the tile's nodes in graph order, with the no-ops between them (eval dropout); the
    #: last one's readers read the kernel's output instead.
    nodes: tuple[fx.Node, ...]
    #: pattern id → node: the operands are read from these at emit time, as an earlier
    #: rewrite may have replaced the nodes that computed them.
    roles: Mapping[str, fx.Node]
    #: conv / linear: (weight, bias, kernel arguments: conv (padding, stride, dilation,
    #: groups, input size), mkl_linear (rows,)); attention: (scale,).
    operands: tuple
    unary: tuple[str, tuple, str] = ("none", (), "")  # (attr, scalars, algorithm)
    #: the fused add's operand that is not the kernel's output: 0 its ``input``, 1 its
    #: ``other`` (:data:`_ADD_OPERANDS`).
    residual: int | None = None
    #: the key in :data:`INEXACT` when the site's kernel is exact for finite inputs only
    #: (bound with ``fast_math``).
    inexact: str | None = None
    #: (in-place ATen activation's name, its scalars) run on the kernel's output: the
    #: activation the kernel would fuse inexactly, as eager computes it.
    after: tuple | None = None

    @property
    def output(self) -> fx.Node:
        return self.nodes[-1]


def bind(
    gm: fx.GraphModule,
    pattern: str,
    nodes: Mapping[str, fx.Node],
    table,
    alias: AliasAnalysis,
    *,
    fast_math: bool = False,
    cold: bool = False,
    share_weights: bool = False,
) -> KernelSite | str:
    """The :class:`KernelSite` of a tile of ``pattern`` (pattern id → fx node), or the reason it
    cannot run on the pattern's kernel. A kernel exact for finite inputs only
    (:data:`INEXACT`) is bound only with ``fast_math``."""
    written = _input_written_within(nodes.values(), alias)
    if written is not None:
        # The kernel runs where the tile's last node is: it would read the value after
        # that write instead of before.
        return f"{written.name} is written in place between the tile's nodes"
    if pattern.startswith("attention"):
        site = _bind_attention(pattern, nodes, table, alias.position)
        if isinstance(site, KernelSite) and fast_math:
            site = dataclasses.replace(site, inexact="attention")
        return site
    anchor = nodes["c"] if pattern.startswith("conv") else nodes["l"]
    name = "conv" if pattern.startswith("conv") else "linear"  # addmm binds as a linear
    if share_weights and name == "conv":
        return "the weights are shared: a convolution's kernel needs a packed copy"
    found = _weights(gm, anchor, name)
    if isinstance(found, str):
        return found
    weight, bias, geometry = found
    x = _input_of(anchor)
    shape = _packable(weight, bias, x, name)
    if isinstance(shape, str):
        return shape
    post_ops = _post_ops(gm, anchor, nodes, table)
    if isinstance(post_ops, str):
        return post_ops
    unary, residual = post_ops
    rows = math.prod(shape[:-1])
    mkl = name == "linear" and _linear_on_mkl(weight, rows, cold, share_weights)
    if isinstance(mkl, str):
        return mkl
    apart = _post_op_apart(mkl, post_ops)
    if apart is not None:
        return apart
    exact = _exact_post_op(unary, nodes, fast_math)
    if isinstance(exact, str):
        return exact
    unary, inexact, after = exact
    kind, arguments = _kernel_kind(name, mkl, share_weights, geometry, shape)
    ordered = _with_noops_between(nodes.values(), alias.position)
    roles = dict(nodes)
    operands = (weight, bias, arguments)
    return KernelSite(pattern, kind, ordered, roles, operands, unary, residual, inexact, after)


_NO_ACTIVATION = ("none", (), "")


def _kernel_kind(name: str, mkl: bool, shared: bool, geometry: tuple, shape: tuple):
    """(the site's kind, its kernel arguments): conv (padding, stride, dilation, groups,
    input size), mkl_linear (the rows packed for), linear / dense_linear (none)."""
    if name == "conv":
        return "conv", (*geometry, list(shape))
    if mkl:
        return "mkl_linear", (math.prod(shape[:-1]),)
    return ("dense_linear" if shared else "linear"), ()


def _exact_post_op(unary: tuple, nodes: Mapping[str, fx.Node], fast_math: bool):
    """(the post-op fused, its :data:`INEXACT` key or None, the in-place activation run
    after the kernel or None), or why the tile is not fused. Without ``fast_math``, an
    activation oneDNN fuses inexactly runs after the kernel without it, as eager computes
    it, in place on the kernel's fresh output (out of place it cost 1.1 ms on a 32x112x112
    output, in place 0.03-0.12 ms over the fused kernel's 0.23 ms)."""
    inexact = _inexact_post_op(unary)
    if inexact is None or fast_math:
        return unary, inexact, None
    after = _IN_PLACE.get(unary[0])
    if after is None:
        activation = nodes.get("u", nodes.get("r"))
        return f"{activation.name} is not fused: {INEXACT[inexact]} (fast_math fuses it)"
    return _NO_ACTIVATION, None, (after, unary[1])


def _linear_on_mkl(weight: torch.Tensor, rows: int, cold: bool, shared: bool) -> bool | str:
    """Whether a linear runs on MKL's packed GEMM (else oneDNN's); with ``shared``
    weights (no packed copy) False where oneDNN's linear on the dense weight is faster than
    torch's own, else why it is not lowered."""
    if not shared:
        return _mkl_is_faster(weight, rows, cold)
    if gemm_timing.faster_gemm(weight, rows, cold=cold, shared=True) == "onednn":
        return False
    return "the weights are shared: oneDNN's linear on the dense weight is not faster"


def _mkl_is_faster(weight: torch.Tensor, rows: int, cold: bool) -> bool:
    """Whether MKL's packed GEMM runs this linear faster than oneDNN's here (timed once per
    shape, with the weight out of cache when ``cold``: :mod:`fxopt.passes.gemm_timing`)."""
    return _USE_MKL_LINEAR and gemm_timing.faster_gemm(weight, rows, cold=cold) == "mkl"


def weights_stream(gm: fx.GraphModule) -> bool:
    """Whether ``gm``'s weights exceed the CPU's cache, so that each call reads each from
    memory (its GEMMs are then timed cold). Packed copies a fusion made are not counted:
    the model's own weights are."""
    tensors = {
        id(t): t
        for name, t in (*gm.named_parameters(), *gm.named_buffers())
        if not name.endswith(".packed")
    }
    return gemm_timing.weights_stream(sum(t.nbytes for t in tensors.values()))


def _post_op_apart(mkl: bool, post_ops: tuple) -> str | None:
    """Why a linear's activation or residual add is not fused into its kernel, or None.

    Where MKL's packed GEMM is the faster one for the shape, the post-op runs after it
    (torch.compile's choice for float32 too). Measured on an Intel Xeon, that was faster
    than oneDNN's fused linear in 21 of 25 cases at 16-2048 rows (BERT-base's and a Llama's
    shapes with add, GELU and SiLU; 1 thread; up to 1.38x) and in 45 of 48 at 1, 4 and 8
    rows (ReLU, SiLU, tanh, GELU); where oneDNN's GEMM is faster, it runs the post-op too.
    """
    unary, residual = post_ops
    if not mkl or (residual is None and unary == _NO_ACTIVATION):
        return None
    return "MKL's packed GEMM with the post-op after it is faster than oneDNN's fused linear"


#: The in-place ATen form of each post-op oneDNN fuses inexactly (gelu has none).
_IN_PLACE = {"relu": "relu_", "hardtanh": "hardtanh_", "hardswish": "hardswish_"}


def _inexact_post_op(unary: tuple[str, tuple, str]) -> str | None:
    """The :data:`INEXACT` key of a fused activation that differs from eager's, or None."""
    attr, _, algorithm = unary
    if attr in ("relu", "hardtanh", "hardswish"):
        return attr
    if attr == "gelu" and algorithm == "tanh":
        return "gelu-tanh"
    return None


def _post_ops(gm, anchor: fx.Node, nodes: Mapping[str, fx.Node], table):
    """(unary post-op, position of the residual's other operand or None) of a conv /
    linear tile, or why the kernel cannot run them."""
    unary = _NO_ACTIVATION
    if "u" in nodes or "r" in nodes:
        activation = nodes.get("u", nodes.get("r"))
        unary = _unary(gm, activation, table)
        if unary is None:
            return f"{activation.name}: this form of {table[activation].name} is not a post-op"
    produced = anchor
    if "v" in nodes:  # addmm's 2-D result viewed back to (batch, seq, out)
        produced = nodes["v"]
        if not _splits_rows(produced, anchor):
            return f"{produced.name} does not only split the rows of {anchor.name}"
    residual = None
    if "a" in nodes:
        position = _residual(produced, nodes["a"], table)
        if isinstance(position, str):
            return position
        residual = position
    return unary, residual


def _input_written_within(nodes, alias: AliasAnalysis) -> fx.Node | None:
    """An input of the tile (a value from outside it) whose storage is written between the
    tile node that reads it and the tile's last node, where the kernel will read it."""
    members = set(nodes)
    last = max(members, key=alias.position.__getitem__)
    for node in members:
        for value in node.all_input_nodes:
            if value in members:
                continue
            if alias.version(value, at=node) != alias.version(value, at=last):
                return value
    return None


def _splits_rows(view: fx.Node, matrix: fx.Node) -> bool:
    """True when ``view`` reshapes the 2-D ``matrix`` to (..., columns): rows split only."""
    out, rows = meta.sizes(view), meta.sizes(matrix)
    return (
        out is not None
        and rows is not None
        and len(rows) == 2
        and len(out) >= 2
        and facts.equal(out[-1], rows[-1])
        and len(view.args) == 2
        and not view.kwargs
    )


def _packable(weight, bias, x, name: str) -> tuple[int, ...] | str:
    """The example shape of input ``x`` the weight is packed for, or why it cannot be."""
    if weight.dtype != torch.float32 or not weight.is_cpu:
        return f"weight is {weight.dtype} on {weight.device}; the kernels here are CPU float32"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu):
        return "bias is not a CPU float32 tensor"
    # The example's sizes even where a dim is dynamic: the weight is packed for a typical
    # input, and the kernels compute right for any other (verification checks other sizes).
    shape = meta.hint_shape(x) if isinstance(x, fx.Node) else None
    if shape is None:
        return "input shape unknown (the weight is packed for it)"
    if name == "conv" and len(shape) != 4:
        return f"{len(shape) - 2}-d convolution: only conv2d is lowered"
    if name == "linear" and len(shape) < 2:
        return "1-D linear input"
    if meta.dtype(x) not in (None, torch.float32):
        return f"input is {meta.dtype(x)}"
    return shape


def _weights(gm, node: fx.Node, name: str):
    """(weight, bias, (padding, stride, dilation, groups)) of a plain conv2d/linear, or why
    not."""
    if node.op == "call_module":
        return _module_weights(gm, node)
    return _call_weights(gm, node, name)


def _module_weights(gm, node: fx.Node):
    """_weights of a module call; one with hooks or a parametrized weight is kept (either
    could change what the module computes at call time)."""
    module = ops.submodule(gm, str(node.target))
    if module._forward_hooks or module._forward_pre_hooks:
        return f"{node.name} has forward hooks"
    if parametrize.is_parametrized(module):
        return f"{node.name}'s weight is parametrized"
    if type(module) is nn.Linear:
        return module.weight, module.bias, ()
    if type(module) is not nn.Conv2d:
        return f"{type(module).__name__} is not lowered (only nn.Conv2d and nn.Linear)"
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        return f"padding {module.padding!r} ({module.padding_mode}) is not lowered"
    args = (module.padding, module.stride, module.dilation, module.groups)
    return module.weight, module.bias, tuple(_as_list(a) for a in args)


def _call_weights(gm, node: fx.Node, name: str):
    """_weights of a conv / linear function call (either level): the weight and bias are
    packed ahead of time, so they must be constant attributes."""
    args = ops.args(node)
    if args is None:
        return f"cannot read the arguments of {node.name}"
    if ops.table(gm)[node].name == "addmm":
        return _addmm_weights(gm, node, args)
    if ops.table(gm)[node].name == "mm":
        return _mm_weights(gm, node, args)
    if args.get("transposed"):
        return "transposed convolution is not lowered"
    weight, bias = attributes.constant(gm, args["weight"]), attributes.constant(gm, args["bias"])
    if weight is None or (args["bias"] is not None and bias is None):
        return "weight or bias is not a constant attribute"
    if name == "linear":
        return weight, bias, ()
    if isinstance(args["padding"], str):
        return f"padding {args['padding']!r} is not lowered"
    if weight.dim() != 4:
        return f"{weight.dim() - 2}-d convolution: only conv2d is lowered"
    geometry = (_pair(args[key]) for key in ("padding", "stride", "dilation"))
    return weight, bias, (*geometry, args["groups"])


def _addmm_weights(gm, node: fx.Node, args: dict):
    """addmm(bias, x, Wᵀ) — core ATen's linear, its weight transpose folded to a constant
    — as linear(x, W, bias)."""
    if args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
        return f"{node.name} scales its operands (beta/alpha)"
    transposed, bias = attributes.constant(gm, args["mat2"]), attributes.constant(gm, args["input"])
    if transposed is None or bias is None:
        return "weight or bias is not a constant attribute"
    if transposed.dim() != 2 or bias.shape not in ((transposed.shape[1],),):
        return f"{node.name}'s bias is not one value per output feature"
    return transposed.t().contiguous(), bias, ()


def _mm_weights(gm, node: fx.Node, args: dict):
    """mm(x, Wᵀ) — core ATen's linear without a bias (Llama's projections), its weight
    transpose folded to a constant — as linear(x, W)."""
    transposed = attributes.constant(gm, args["mat2"])
    if transposed is None or transposed.dim() != 2:
        return f"{node.name}'s second operand is not a constant matrix"
    return transposed.t().contiguous(), None, ()


def _as_list(value):
    return list(value) if isinstance(value, tuple) else value


def _input_of(node: fx.Node) -> object:
    """The activation a conv / linear / addmm / mm reads."""
    addmm = ops.table(node.graph.owning_module)[node].name == "addmm"
    return (ops.args(node) or {}).get("mat1" if addmm else "input")


def _pair(value) -> list:
    """A conv2d geometry argument as two values (``stride=1`` means ``[1, 1]``)."""
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return value * 2 if len(value) == 1 else value


def _unary(gm, node: fx.Node, table) -> tuple[str, tuple, str] | None:
    """(attr, scalars, algorithm) of an activation oneDNN fuses, or None."""
    name = table[node].name
    module = ops.submodule(gm, str(node.target)) if node.op == "call_module" else None
    if module is not None and (module._forward_hooks or module._forward_pre_hooks):
        return None

    args = ops.args(node, gm) or {}

    if name == "relu":
        return ("relu", (), "")
    if name in ("sigmoid", "tanh", "hardswish"):
        return (name, (), "")
    if name == "silu":
        return ("swish", (), "")
    if name == "relu6":
        return ("hardtanh", (0.0, 6.0), "")
    if name == "hardtanh":
        low, high = args.get("min_val", -1.0), args.get("max_val", 1.0)
        return ("hardtanh", (float(low), float(high)), "")
    if name == "leaky_relu":
        return ("leaky_relu", (float(args.get("negative_slope", 0.01)),), "")
    if name == "gelu":
        approximate = args.get("approximate", "none")
        return ("gelu", (), approximate) if approximate in ("none", "tanh") else None
    return None


def _bind_attention(
    pattern: str, nodes: Mapping[str, fx.Node], table, order: Mapping[fx.Node, int]
) -> KernelSite | str:
    """softmax(q @ kᵀ / c [+ mask]) @ v as one scaled_dot_product_attention call."""
    kt, scores, divide, softmax, out = (nodes[i] for i in ("kt", "s", "d", "p", "o"))
    k = _transposed_last_two(kt)
    if k is None:
        return f"{kt.name} does not swap the last two dims of a 4-D key"
    copy = nodes.get("pc")  # eval-mode dropout at the ATen level
    if copy is not None and (ops.args(copy) or {}).get("memory_format") not in (
        None,
        torch.preserve_format,
        torch.contiguous_format,
    ):
        return f"{copy.name} is not a plain copy of the probabilities"
    product, weighted = ops.args(scores) or {}, ops.args(out) or {}
    q = product.get("input") if product.get("other") is kt else None
    v = weighted.get("other")
    if not isinstance(q, fx.Node) or not isinstance(v, fx.Node) or scores.kwargs or out.kwargs:
        return "the matmuls' operands are not in (q, kᵀ) and (probabilities, v) order"
    divisor = (ops.args(divide) or {}).get("other") if not divide.kwargs else None
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)) or divisor <= 0:
        return f"{divide.name} does not divide by a positive number"
    dim = (ops.args(softmax) or {}).get("dim")
    if dim not in (-1, 3) or (ops.args(softmax) or {}).get("dtype") is not None:
        return f"{softmax.name} is not a softmax over the last dim"
    if "m" in nodes:
        problem = _mask_problem(nodes["m"], divide, q, table)
        if problem is not None:
            return problem
    for value in (q, k, v):
        if meta.rank(value) != 4 or meta.dtype(value) not in (torch.float32, torch.float64):
            return "q, k and v must be 4-D float tensors (batch, heads, tokens, dim)"
    if not (meta.dtype(q) == meta.dtype(k) == meta.dtype(v)):
        return "q, k and v have different dtypes"
    ordered = _with_noops_between(nodes.values(), order)
    return KernelSite(pattern, "attention", ordered, dict(nodes), (1.0 / float(divisor), divisor))


#: Scores (and mask values) below this cannot overflow float32 when added to each other,
#: so SDPA's scaling order matches eager's ``(q @ kᵀ) / c + mask`` (float32 max: 3.4e38).
_SAFE_SCORE = 1e30


@runtime_helper  # called from ATen graphs too: a helper, not a torch-level rewrite
def attention(q, k, v, mask, divisor):
    """``softmax(q @ kᵀ / divisor + mask) @ v``, on SDPA's fused kernel where it computes
    what that expression does: q, k and v finite, no row of the mask all -inf (or NaN, or
    +inf), and scores too small to overflow; else as the expression itself. The check
    costs a reduction over each of q, k, v and the mask (36 µs on a BERT-base layer)."""
    if _sdpa_is_exact(q, k, v, mask, divisor):
        return F.scaled_dot_product_attention(q, k, v, mask, scale=1.0 / divisor)
    scores = torch.matmul(q, k.transpose(-2, -1)) / divisor
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _sdpa_is_exact(q, k, v, mask, divisor) -> bool:
    # One pass over each operand, the cheapest reductions there are (vector_norm(x, inf),
    # max |x|, took 30x longer than the 2-norm: 0.4 ms per BERT-base attention):
    # |q_i · k_j| <= |q|_F |k|_F bounds every score (NaN when q or k has one; inf when
    # they are huge: then the check says no, conservatively); v is finite when its sum is
    # (an overflowing sum of finite values says no too).
    if 0 in (q.numel(), k.numel(), v.numel()):
        return False
    norm = torch.linalg.vector_norm
    exact = (norm(q) * norm(k) / divisor < _SAFE_SCORE) & torch.isfinite(v.sum())
    if mask is not None:
        if mask.numel() == 0:
            return False
        rows = mask.amax(-1)  # -inf: a fully masked row; NaN and +inf propagate
        exact &= torch.isfinite(rows.sum()) & (rows.amax() < _SAFE_SCORE)
    return bool(exact)


def _mask_problem(add: fx.Node, divide: fx.Node, q: fx.Node, table) -> str | None:
    """Why ``add`` is not scores + an additive mask the kernel can take, or None."""
    operands = ops.args(add)
    if len(add.args) != 2 or add.kwargs or table[add].inplace or operands is None:
        return f"{add.name} is not a plain addition of the mask"
    mask = operands["other"] if operands["input"] is divide else operands["input"]
    if not isinstance(mask, fx.Node) or meta.dtype(mask) != meta.dtype(q):
        return "the mask is not a tensor of the scores' dtype"
    if (meta.rank(mask) or 0) > 4:
        return "the mask has more dims than the scores"
    return None


def _attention_operands(site: KernelSite) -> tuple:
    """(q, k, v, mask) of an attention site, read from its nodes now."""
    roles = site.roles
    q, v = ops.args(roles["s"])["input"], ops.args(roles["o"])["other"]
    k = _transposed_last_two(roles["kt"])
    mask = None
    if "m" in roles:
        add = ops.args(roles["m"])
        mask = add["other"] if add["input"] is roles["d"] else add["input"]
    return (q, k, v, mask)


def _transposed_last_two(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` transposes (or permutes), when it swaps the last two dims of a
    4-D tensor and keeps the others."""
    args = ops.args(node) or {}
    source = args.get("input")
    if not isinstance(source, fx.Node) or meta.rank(source) != 4:
        return None
    if "dims" in args:  # a permute
        dims = args["dims"]
        ok = isinstance(dims, (list, tuple)) and [d % 4 for d in dims] == [0, 1, 3, 2]
        return source if ok else None
    dims = {args.get("dim0"), args.get("dim1")}
    return source if {d % 4 for d in dims if isinstance(d, int)} == {2, 3} else None


def _with_noops_between(nodes, order: Mapping[fx.Node, int]) -> tuple[fx.Node, ...]:
    """``nodes`` in graph order, plus the no-op nodes (eval dropout, identity) between a
    node of the set and its reader in the set: the tiler's graph elides them."""
    members = set(nodes)
    found = set(members)
    for node in members:
        for arg in node.all_input_nodes:
            chain = []
            while arg not in members and _is_noop(arg) and len(arg.users) == 1:
                chain.append(arg)
                source = (ops.args(arg) or {}).get("input")
                arg = source if isinstance(source, fx.Node) else None
                if arg is None:
                    break
            if arg in members:
                found.update(chain)
    return tuple(sorted(found, key=order.__getitem__))


def _is_noop(node: fx.Node) -> bool:
    """A node the tiler's graph elided (eval dropout, identity)."""
    return is_elided(node, ops.info(node, node.graph.owning_module))


#: The operands of an addition, by position (:attr:`KernelSite.residual`).
_ADD_OPERANDS = ("input", "other")


def _residual(anchor: fx.Node, add: fx.Node, table) -> int | str:
    """Position in ``anchor + other`` of ``other`` when the kernel can add it, or why not."""
    operands = ops.args(add)
    if add.kwargs or len(add.args) != 2 or table[add].inplace or operands is None:
        return f"{add.name} is not a plain two-operand addition"
    if (
        add.op == "call_function"
        and add.target not in (operator.add, torch.add)
        and not isinstance(add.target, torch._ops.OpOverload)
    ):
        return f"{add.name} is not a plain two-operand addition"
    left, right = (operands[name] for name in _ADD_OPERANDS)
    position = 1 if left is anchor else 0 if right is anchor else None
    other = operands[_ADD_OPERANDS[position]] if position is not None else None
    if not isinstance(other, fx.Node) or other is anchor:
        return f"{add.name} does not add a tensor to the kernel's output"
    # Same shape and dtype as the output, for every allowed input: the kernel adds
    # elementwise, no broadcast.
    if not facts.same_shape(other, anchor):
        return f"{add.name} broadcasts {other.name} (the kernel adds same-shape tensors only)"
    if meta.dtype(other) != meta.dtype(anchor):
        return f"{add.name}'s operands have different dtypes"
    return position


def emit(gm: fx.GraphModule, site: KernelSite) -> fx.Node:
    """Insert ``site``'s kernel call before its output node, re-route the output's readers
    to it and erase the tile's nodes; returns the kernel call."""
    graph = gm.graph
    with graph.inserting_before(site.output):
        if site.kind == "attention" and site.inexact:
            operands, scale = _attention_operands(site), site.operands[0]
            new = ops.emit(
                graph, "scaled_dot_product_attention", *operands, scale=scale, level="aten"
            )
        elif site.kind == "attention":
            new = graph.call_function(attention, (*_attention_operands(site), site.operands[1]))
        else:
            new = _emit_packed(gm, site)
        if site.after is not None:
            activation, scalars = site.after
            new = ops.emit(graph, activation, new, *scalars, level="aten")
    new.meta.update(site.output.meta)
    site.output.replace_all_uses_with(new)
    inputs = {a for n in site.nodes for a in n.all_input_nodes}
    for node in reversed(site.nodes):
        graph.erase_node(node)
    for node in inputs:  # an ATen conv's weight and bias attributes
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return new


def free_name(gm: fx.GraphModule) -> str:
    """The first ``<prefix>_<i>`` not taken on ``gm``, searched from where the last search
    ended (``gm.meta``): from 0 each time, fusing n kernels made n²/2 attribute lookups,
    hours on a 100k-node graph."""
    index = gm.meta.get(_NEXT_FREE, 0)
    while hasattr(gm, f"{_PREFIX}_{index}"):
        index += 1
    gm.meta[_NEXT_FREE] = index + 1
    return f"{_PREFIX}_{index}"


def _emit_packed(gm: fx.GraphModule, site: KernelSite) -> fx.Node:
    graph = gm.graph
    weight, bias, arguments = site.operands
    x = _input_of(site.roles["c"] if site.kind == "conv" else site.roles["l"])
    # On the root, not in a container: the generated code reads self.<name>.packed on
    # every call, and each nn.Module attribute level costs a __getattr__.
    prefix = free_name(gm)
    gm.add_module(prefix, _packed_weight(site.kind, weight, bias, arguments))
    # The packed copy does not follow the weight's changes (fxopt.ir.weights).
    note_derived(gm, [weight], by="fuse-kernels")
    packed = graph.get_attr(f"{prefix}.packed")
    bias_node = graph.get_attr(f"{prefix}.bias") if bias is not None else None
    attr, scalars, algorithm = site.unary
    other = None
    if site.residual is not None:
        other = ops.args(site.roles["a"])[_ADD_OPERANDS[site.residual]]
    if site.kind == "mkl_linear":
        dense = graph.get_attr(f"{prefix}.dense")
        return graph.call_function(_MKL_LINEAR, (x, packed, dense, bias_node, arguments[0]))
    if site.kind in ("linear", "dense_linear"):
        view = site.roles.get("v")
        if other is not None and view is not None:  # the residual, as the kernel's 2-D rows
            columns = weight.shape[0]
            other = ops.emit(graph, "reshape", other, [-1, columns], level="aten")
        if other is not None:
            out = graph.call_function(_LINEAR_BINARY, (x, other, packed, bias_node, "add"))
        else:
            call = (x, packed, bias_node, attr, list(scalars), algorithm)
            out = graph.call_function(_LINEAR, call)
        if view is not None:
            out = ops.emit(graph, "view", out, ops.args(view)["size"], level="aten")
        return out
    padding, stride, dilation, groups, _ = arguments
    geometry = (list(padding), list(stride), list(dilation), groups)
    if other is not None:
        unary = attr if attr != "none" else None
        call = (x, other, packed, bias_node, *geometry, "add", 1.0, unary, [], "")
        return graph.call_function(_CONV_BINARY, call)
    call = (x, packed, bias_node, *geometry, attr, list(scalars), algorithm)
    return graph.call_function(_CONV, call)


def _packed_weight(kind: str, weight, bias, arguments) -> PackedWeight:
    if kind == "mkl_linear":
        return PackedWeight.for_linear(weight, bias, rows=arguments[0])
    if kind in ("linear", "dense_linear"):
        return PackedWeight.for_linear(weight, bias, shared=kind == "dense_linear")
    return PackedWeight.for_conv(weight, bias, *arguments)


@dataclass(frozen=True)
class SampledGain:
    """What the packed conv/linear kernels would save per call of a graph, timed on one
    site of each of its shapes against torch's own kernels (:func:`sampled_gain`)."""

    saved_s: float  # per call of the whole graph, summed over its sites
    sites: int
    shapes: int
    worst: str  # the most frequent shape, and its fused/unfused time ratio

    def describe(self) -> str:
        return (
            f"on a sample of its {self.shapes} conv/linear shapes ({self.sites} sites) the "
            f"packed kernels would save {self.saved_s * 1e3:+.1f} ms per call ({self.worst})"
        )


#: Shapes timed at most (the most frequent first), and calls per kernel and shape.
SAMPLED_SHAPES = 6
SAMPLED_CALLS = 15


def sampled_gain(gm: fx.GraphModule, *, shared: bool = False) -> SampledGain | None:
    """Time oneDNN's packed kernel against torch's on one site of each conv2d / linear
    shape of ``gm`` (random inputs of the traced shapes, the site's own weights, its ReLU
    fused where one follows), and scale by how often each shape occurs. A cheap estimate
    of what building the fused candidate could win, before building it: on a 100k-node
    graph of tiny convolutions, building took 100 s and the candidate ran 2x slower.
    ``shared``: what the kernels that need no packed copy would win (oneDNN's linear on
    the dense weight, where timed faster). None when nothing in ``gm`` is such a site (or
    a shape is not known)."""
    sites: dict[tuple, list] = {}
    for node in gm.graph.nodes:
        sample = _sample_site(gm, node)
        if sample is not None:
            sites.setdefault(sample[0], []).append(sample[1])
    if not sites:
        return None
    ranked = sorted(sites.items(), key=lambda item: -len(item[1]))[:SAMPLED_SHAPES]
    covered = sum(len(found) for _, found in ranked)
    total = sum(len(found) for found in sites.values())
    saved, worst = 0.0, ""
    cold = weights_stream(gm)
    with torch.inference_mode():
        for index, (key, found) in enumerate(ranked):
            plain, fused = _time_site(*found[0], cold, shared)
            saved += len(found) * (plain - fused) * total / covered
            if index == 0:
                worst = f"{key[0]} {key[1]}: the packed kernel takes {fused / plain:.2f}x the time"
    return SampledGain(saved, total, len(sites), worst)


def _sample_site(gm: fx.GraphModule, node: fx.Node) -> tuple[tuple, tuple] | None:
    """(shape key, what :func:`_time_site` needs) for a conv2d or linear node, or an
    ATen ``mm`` / ``addmm`` by a constant matrix (a linear layer once exported)."""
    if node.op not in ("call_module", "call_function"):
        return None
    name = ops.info(node, gm).name
    if name not in ("conv", "linear", "mm", "addmm"):
        return None
    args = ops.args(node, gm)
    if args is not None and name in ("mm", "addmm"):
        args = _as_linear(gm, args, name)
    if args is None or not isinstance(args.get("input"), fx.Node):
        return None
    shape = _concrete(meta.sizes(args["input"]))
    weight, bias = (_constant(gm, args.get(k)) for k in ("weight", "bias"))
    if shape is None or not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32:
        return None
    if weight.device.type != "cpu" or (args.get("bias") is not None and bias is None):
        return None
    relu = len(node.users) == 1 and ops.info(next(iter(node.users)), gm).name == "relu"
    if name == "conv":
        if weight.dim() != 4 or len(shape) != 4 or args.get("transposed"):
            return None
        geometry = tuple(
            tuple(args[k]) if not isinstance(args[k], int) else (args[k],) * 2
            for k in ("stride", "padding", "dilation")
        )
        groups = int(args.get("groups", 1))
        key = ("conv", (tuple(weight.shape), shape, geometry, groups, relu))
        return key, ("conv", shape, weight, bias, geometry, groups, relu)
    key = ("linear", (tuple(weight.shape), shape, relu))
    return key, ("linear", shape, weight, bias, (), 1, relu)


def _as_linear(gm: fx.GraphModule, args: dict, name: str) -> dict | None:
    """``mm(x, W)`` / ``addmm(b, x, W)`` with a constant ``W`` as linear's arguments
    (``weight`` = W transposed), or None."""
    matrix = _constant(gm, args.get("mat2"))
    if matrix is None or matrix.dim() != 2:
        return None
    if name == "mm":
        return {"input": args.get("input"), "weight": matrix.t(), "bias": None}
    if args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
        return None
    bias = _constant(gm, args.get("input"))
    if bias is None or bias.dim() != 1:
        return None
    return {"input": args.get("mat1"), "weight": matrix.t(), "bias": bias}


def _concrete(shape: tuple | None) -> tuple[int, ...] | None:
    if shape is None:
        return None
    sizes = []
    for size in shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            if hint is None:
                return None
            size = hint
        sizes.append(int(size))
    return tuple(sizes)


def _constant(gm: fx.GraphModule, value: object) -> torch.Tensor | None:
    if isinstance(value, fx.Node):
        if value.op != "get_attr":
            return None
        value = attributes.get(gm, str(value.target), None)
    return value.detach() if isinstance(value, torch.Tensor) else None


def _time_site(
    kind, shape, weight, bias, geometry, groups, relu, cold, shared=False
) -> tuple[float, float]:
    """Median seconds of (torch's kernel [+ ReLU], the packed kernel with ReLU fused);
    ``shared``: the kernel that needs no packed copy instead (torch's own where there is
    none faster)."""
    import statistics
    import time

    x = torch.randn(shape)
    if kind == "conv" and shared:  # (a convolution's kernel needs a packed copy)
        return 1.0, 1.0
    if kind == "conv":
        plain, fused = _conv_calls(x, weight, bias, geometry, groups, relu)
    else:
        plain, fused = _linear_calls(x.reshape(-1, x.shape[-1]), weight, bias, relu, cold, shared)
    samples: dict = {plain: [], fused: []}
    for _ in range(SAMPLED_CALLS):
        for call in (plain, fused):
            begin = time.perf_counter()
            call()
            samples[call].append(time.perf_counter() - begin)
    return statistics.median(samples[plain]), statistics.median(samples[fused])


def _conv_calls(x, weight, bias, geometry, groups, relu):
    """(torch's conv2d [+ ReLU], oneDNN's packed one with the ReLU fused) on ``x``."""
    stride, padding, dilation = geometry
    packed = torch.ops.mkldnn._reorder_convolution_weight(
        weight, list(padding), list(stride), list(dilation), groups, list(x.shape)
    )

    def plain():
        out = torch.nn.functional.conv2d(x, weight, bias, stride, padding, dilation, groups)
        return torch.relu(out) if relu else out

    def fused():
        geometry = (list(padding), list(stride), list(dilation), groups)
        return _CONV(x, packed, bias, *geometry, "relu" if relu else "none", [], "")

    return plain, fused


def _linear_calls(rows, weight, bias, relu, cold, shared):
    """(torch's linear [+ ReLU], the kernel bind() picks for it) on ``rows``."""

    def plain():
        out = torch.nn.functional.linear(rows, weight, bias)
        return torch.relu(out) if relu else out

    count = rows.shape[0]
    if shared:  # oneDNN's linear on the dense weight where it is faster, else torch's
        if gemm_timing.faster_gemm(weight, count, cold=cold, shared=True) != "onednn":
            return plain, plain
        packed = weight
    elif not relu and _mkl_is_faster(weight, count, cold):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, count)
        return plain, lambda: _MKL_LINEAR(rows, packed, weight, bias, count)
    else:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return plain, lambda: _LINEAR(rows, packed, bias, "relu" if relu else "none", [], "")
