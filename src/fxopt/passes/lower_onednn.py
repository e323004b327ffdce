"""Lower convolutions and linears to oneDNN's fused CPU kernels with pre-packed weights.

    x ── conv2d(W, b) ── relu ──────────── y    x ── _convolution_pointwise(x, W*, b, "relu") ── y
    x ── conv2d(W, b) ── add(·, r) ── relu ─ y  x ── _convolution_pointwise.binary(x, r, W*, b,
                                                      "add", unary="relu") ────────────────── y
    x ── linear(W, b) ───────────────────── y   x ── mkl._mkl_linear(x, W*, W, b, rows) ────── y

``W*`` is the weight reordered once, at lowering time, into oneDNN's blocked format
(``mkldnn._reorder_convolution_weight`` for the example's input shape) or MKL's packed
GEMM format for the example's row count (``mkl._mkl_reorder_linear_weight``; builds
without MKL use oneDNN's ``_linear_pointwise`` with a fused activation instead): eager
PyTorch reorders it on every call. The activation
(relu, relu6, hardtanh, silu, sigmoid, tanh, hardswish, gelu, leaky_relu) and a residual
``add`` (with an optional relu after it) run inside the convolution kernel, as oneDNN
post-ops. These are the kernels ``torch.compile`` uses on CPU after freezing. Measured
here (1 thread, 224 px, 128 tokens, speedup over eager; benchmarks/inference.py):
ResNet-50 1.49×/1.50× at batch 1/8 against 1.06×/1.11× for the graph passes alone,
MobileNetV2 1.78×/2.29× against 1.16×/1.23×; BERT-base at batch 1 1.19× with MKL's
packed linear against 0.99× (a one-off comparison, not the benchmark).

Inference only, CPU float32 only: the kernels have no autograd formula, so this is not a
pass of any preset. The layout step (:mod:`fxopt.layout`) builds it as the ``onednn``
candidate and keeps it only when it verifies and measures faster. Packed weights live in
:class:`PackedWeight` modules, which keep the dense weight as a buffer (it is what
``state_dict()`` shows) and re-pack after unpickling.

Not lowered (each with its reason in ``--explain``): Conv1d/Conv3d and transposed convs,
non-zero padding modes, string padding, non-float32 or non-CPU weights, modules with hooks
or parametrizations, inputs of unknown shape.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.utils import parametrize

from fxopt.ir import attributes, facts, meta, ops
from fxopt.passes.base import Pass, PassResult, Plan, Skip

_CONV = torch.ops.mkldnn._convolution_pointwise.default
_CONV_BINARY = torch.ops.mkldnn._convolution_pointwise.binary
_LINEAR = torch.ops.mkldnn._linear_pointwise.default
_MKL_LINEAR = torch.ops.mkl._mkl_linear.default
# fp32 linears go to MKL's packed GEMM when this build has MKL: on BERT-base (128 tokens,
# 1 thread) it measured 1.19x eager at batch 1 where oneDNN's packed linear gave 1.03x and
# jit.freeze 1.02x. It fuses no activation, so the activation stays a separate op.
_USE_MKL_LINEAR = torch._C.has_mkl
_PREFIX = "_fxopt_onednn"


class PackedWeight(nn.Module):
    """A weight pre-packed for oneDNN, beside the dense weight it was packed from.

    The packed tensor is opaque (it has no storage to copy or pickle): deep copies share
    it (nothing ever writes into it), and pickling keeps the dense weight and packs again.

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
        # A buffer, so fx's get_attr finds it; not persistent: state_dict() has the dense
        # weight, which is what a checkpoint of the folded model should hold.
        self.register_buffer("packed", _pack(dense, recipe), persistent=False)

    @classmethod
    def for_linear(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, rows: int | None = None
    ) -> PackedWeight:
        recipe = ("mkl_linear", rows) if rows is not None else ("linear",)
        return cls(weight.detach().clone(), _copy(bias), recipe)

    @classmethod
    def for_conv(cls, weight, bias, padding, stride, dilation, groups, input_size):
        recipe = ("conv", list(padding), list(stride), list(dilation), groups, list(input_size))
        return cls(weight.detach().clone(), _copy(bias), recipe)

    def __deepcopy__(self, memo: dict) -> PackedWeight:
        copy = PackedWeight.__new__(PackedWeight)
        nn.Module.__init__(copy)
        memo[id(self)] = copy
        copy.register_buffer("dense", self.dense.clone())
        copy.register_buffer("bias", _copy(self.bias))
        copy.recipe = self.recipe
        copy.register_buffer("packed", self.packed, persistent=False)  # opaque, never written
        copy.train(self.training)
        return copy

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_buffers"] = {k: v for k, v in self._buffers.items() if k != "packed"}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.register_buffer("packed", _pack(self.dense, self.recipe), persistent=False)


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().clone()


def _pack(dense: torch.Tensor, recipe: tuple) -> torch.Tensor:
    if recipe[0] == "mkl_linear":
        return torch.ops.mkl._mkl_reorder_linear_weight(dense, recipe[1])
    if recipe[0] == "linear":
        return torch.ops.mkldnn._reorder_linear_weight(dense, None)
    _, padding, stride, dilation, groups, input_size = recipe
    return torch.ops.mkldnn._reorder_convolution_weight(
        dense, padding, stride, dilation, groups, input_size
    )


@dataclass(frozen=True)
class Site:
    kind: str  # "conv" | "linear" | "mkl_linear"
    node: fx.Node  # the conv / linear call
    weight: torch.Tensor
    bias: torch.Tensor | None
    #: conv: (padding, stride, dilation, groups, input size); mkl_linear: (rows,)
    kernel_args: tuple
    #: the nodes the fused kernel replaces after ``node``, in graph order (activation,
    #: or add [+ activation]); the last one's users get the kernel's output.
    fused: tuple[fx.Node, ...]
    unary: tuple[str, tuple, str]  # (attr, scalars, algorithm)
    #: position (0 or 1) in the fused add of its other operand, read at rewrite time
    #: (an earlier rewrite may have replaced that operand's node).
    residual: int | None


@dataclass(frozen=True)
class LowerPlan(Plan):
    sites: tuple[Site, ...] = ()


_NO_ACTIVATION = ("none", (), "")


class LowerOneDnn(Pass[LowerPlan]):
    name = "lower-onednn"
    description = "inference, CPU: conv2d/linear (+activation, +residual add) → oneDNN kernels"
    adds_parameters = True
    freezes_parameters = True  # packed weights; the kernels have no autograd

    def analyze(self, gm: fx.GraphModule) -> LowerPlan:
        table = ops.table(gm)
        sites: list[Site] = []
        skipped: list[Skip] = []
        if not torch.backends.mkldnn.is_available():
            return LowerPlan(skipped=(Skip("(graph)", "this PyTorch build has no oneDNN"),))
        claimed: set[fx.Node] = set()  # post-ops already fused into an earlier site
        for node in gm.graph.nodes:
            name = table[node].name
            if name == "conv_transpose":
                skipped.append(Skip(node.name, "transposed convolution is not lowered"))
                continue
            if name not in ("conv", "linear"):
                continue
            found = _site(gm, node, name, table, claimed)
            if isinstance(found, Site):
                sites.append(found)
                claimed.update(found.fused)
            else:
                skipped.append(Skip(node.name, found))
        return LowerPlan(skipped=tuple(skipped), sites=tuple(sites))

    def transform(self, gm: fx.GraphModule, plan: LowerPlan) -> PassResult:
        if not plan.sites:
            return PassResult(False, {"lowered": 0}, plan.skipped)
        graph = gm.graph
        index = 0
        for site in plan.sites:
            # On the root, not in a container: the generated code reads self.<name>.packed
            # on every call, and each nn.Module attribute level costs a __getattr__.
            while hasattr(gm, f"{_PREFIX}_{index}"):
                index += 1
            prefix = f"{_PREFIX}_{index}"
            gm.add_module(prefix, _packed_weight(site))
            last = site.fused[-1] if site.fused else site.node
            with graph.inserting_before(last):
                weight = graph.get_attr(f"{prefix}.packed")
                bias = graph.get_attr(f"{prefix}.bias") if site.bias is not None else None
                dense = graph.get_attr(f"{prefix}.dense") if site.kind == "mkl_linear" else None
                new = graph.call_function(*_kernel_call(site, weight, bias, dense))
            new.meta.update(last.meta)
            last.replace_all_uses_with(new)
            inputs = site.node.all_input_nodes
            for node in (*reversed(site.fused), site.node):
                graph.erase_node(node)
            for node in inputs:  # an ATen conv's weight and bias attributes
                if node.op == "get_attr" and not node.users:
                    graph.erase_node(node)
        gm.delete_all_unused_submodules()
        fused = sum(bool(s.fused) for s in plan.sites)
        stats = {"lowered": len(plan.sites), "fused_post_ops": fused}
        return PassResult(True, stats, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [s.node.name for s in self.analyze(gm).sites]
        assert not left, f"lowerable convs/linears left: {left[:8]}"


def _site(gm, node: fx.Node, name: str, table, claimed: set) -> Site | str:
    found = _weights(gm, node, name)
    if isinstance(found, str):
        return found
    weight, bias, kernel_args = found
    if weight.dtype != torch.float32 or not weight.is_cpu:
        return f"weight is {weight.dtype} on {weight.device}; oneDNN kernels here are CPU float32"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_cpu):
        return "bias is not a CPU float32 tensor"
    x = _input_of(node)
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
    kind = "conv" if name == "conv" else "mkl_linear" if _USE_MKL_LINEAR else "linear"
    if kind == "conv":
        kernel_args = (*kernel_args, list(shape))
    if kind == "mkl_linear":
        kernel_args = (math.prod(shape[:-1]),)  # the rows the weight is packed for
    fused, unary, residual = _post_ops(gm, node, kind, table, claimed)
    return Site(kind, node, weight, bias, kernel_args, fused, unary, residual)


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


def _as_list(value):
    return list(value) if isinstance(value, tuple) else value


def _input_of(node: fx.Node) -> object:
    return node.args[0] if node.args else node.kwargs.get("input")


def _pair(value) -> list:
    """A conv2d geometry argument as two values (``stride=1`` means ``[1, 1]``)."""
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return value * 2 if len(value) == 1 else value


def _post_ops(gm, node: fx.Node, kind: str, table, claimed: set):
    """The nodes after ``node`` that oneDNN can run as post-ops, and how.

    In a residual block both convs may feed the add; the first one in graph order takes it.
    """
    user = _only_user(node)
    if user is None or user in claimed or kind == "mkl_linear":
        return (), _NO_ACTIVATION, None
    unary = _unary(gm, user, table, kind)
    if unary is not None:
        return (user,), unary, None
    if kind != "conv":
        return (), _NO_ACTIVATION, None
    residual = _residual(node, user, table)
    if residual is None:
        return (), _NO_ACTIVATION, None
    after = _only_user(user)
    unary = _unary(gm, after, table, kind) if after is not None else None
    if unary is not None and unary[0] == "relu":  # the binary kernel's unary post-ops
        return (user, after), unary, residual
    return (user,), _NO_ACTIVATION, residual


def _only_user(node: fx.Node) -> fx.Node | None:
    if len(node.users) != 1:
        return None
    user = next(iter(node.users))
    return user if ops.is_compute(user) else None


def _unary(gm, node: fx.Node, table, kind: str) -> tuple[str, tuple, str] | None:
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


def _residual(conv: fx.Node, add: fx.Node, table) -> int | None:
    """Position of ``other`` in ``conv + other`` when oneDNN can add it in the kernel."""
    if table[add].name != "add" or add.kwargs or len(add.args) != 2:
        return None
    if (
        add.op == "call_function"
        and add.target not in (operator.add, torch.add)
        and not isinstance(add.target, torch._ops.OpOverload)
    ):
        return None
    if table[add].inplace:
        return None
    left, right = add.args
    position = 1 if left is conv else 0 if right is conv else None
    other = add.args[position] if position is not None else None
    if not isinstance(other, fx.Node) or other is conv:
        return None
    # Same shape and dtype as the conv output, for every allowed batch: the kernel adds
    # elementwise, no broadcast.
    if not facts.same_shape(other, conv):
        return None
    if meta.dtype(other) != meta.dtype(conv):
        return None
    return position


def _packed_weight(site: Site) -> PackedWeight:
    if site.kind == "mkl_linear":
        return PackedWeight.for_linear(site.weight, site.bias, rows=site.kernel_args[0])
    if site.kind == "linear":
        return PackedWeight.for_linear(site.weight, site.bias)
    return PackedWeight.for_conv(site.weight, site.bias, *site.kernel_args)


def _kernel_call(site: Site, weight: fx.Node, bias: fx.Node | None, dense: fx.Node | None) -> tuple:
    x = _input_of(site.node)
    attr, scalars, algorithm = site.unary
    if site.kind == "mkl_linear":
        return _MKL_LINEAR, (x, weight, dense, bias, site.kernel_args[0])
    if site.kind == "linear":
        return _LINEAR, (x, weight, bias, attr, list(scalars), algorithm)
    padding, stride, dilation, groups, _ = site.kernel_args
    geometry = (list(padding), list(stride), list(dilation), groups)
    if site.residual is not None:
        unary = attr if attr != "none" else None
        other = site.fused[0].args[site.residual]
        args = (x, other, weight, bias, *geometry, "add", 1.0, unary, [], "")
        return _CONV_BINARY, args
    return _CONV, (x, weight, bias, *geometry, attr, list(scalars), algorithm)
