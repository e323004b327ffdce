"""The canonical op table: one place that knows every spelling of an operator.

A graph captured at module level spells ReLU as ``call_module`` (``nn.ReLU``),
``call_function`` (``F.relu``, ``torch.relu``), ``call_method`` (``x.relu()``); one captured
with ``torch.export`` spells it ``aten.relu.default``. Every pass, the tiler and the Circle
lowering ask this module what a node *is* instead of keeping their own lists:

    >>> import torch, torch.nn.functional as F
    >>> from fxopt.ir import ops
    >>> gm = torch.fx.symbolic_trace(lambda x: F.relu(x) + x.relu())
    >>> [ops.info(n, gm).name for n in gm.graph.nodes if ops.is_compute(n)]
    ['relu', 'relu', 'add']

Traits (:class:`OpInfo`):

* ``pure``: the output depends only on the inputs and nothing else is touched. Only pure,
  known ops may be merged (CSE) or removed when unused (DCE).
* ``random``: draws from the RNG. Never merged; never removed (that would shift the random
  stream seen by later random ops).
* ``mutates``: the argument positions / keyword names written in place (``x.add_``,
  ``F.relu(x, inplace=True)``, ``torch.add(a, b, out=buf)``, ``aten.copy_``).
* ``stateful``: updates module state (BatchNorm in training mode with running stats).
* ``view``: the output *may* share storage with an input (``view``, ``reshape``,
  ``contiguous``, ``to``...): alias analysis joins them.
* ``commutative``: the first two tensor inputs may be swapped.
* ``known``: the op is in the table (or, for ATen, described by its schema). An unknown op
  is treated as impure and as possibly mutating and aliasing all of its inputs.

ATen overloads carry a schema, so their mutation, aliasing and randomness traits come from
``torch`` itself (``Tensor(a!)`` arguments, ``nondeterministic_seeded`` tag); the table only
adds a canonical name and commutativity.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx
from torch._library.utils import is_impure as node_is_impure

from fxopt.ir.contract import InputGuard

__all__ = [
    "OpInfo",
    "calls",
    "canonical_names",
    "info",
    "is_call",
    "is_compute",
]


@dataclass(frozen=True)
class OpInfo:
    """What a node is: its canonical name and the traits that passes must respect."""

    name: str
    pure: bool = True
    random: bool = False
    stateful: bool = False
    view: bool = False
    commutative: bool = False
    known: bool = True
    compute: bool = True
    mutates: tuple[int | str, ...] = ()

    @property
    def inplace(self) -> bool:
        """True when the op writes into one of its arguments."""
        return bool(self.mutates)

    @property
    def removable(self) -> bool:
        """Safe to delete when its result is unused."""
        return self.known and self.pure and not self.random and not self.stateful

    @property
    def mergeable(self) -> bool:
        """Safe to merge with an identical call on the same inputs (CSE)."""
        return self.removable and self.compute


@dataclass(frozen=True)
class _Spec:
    """One canonical op and its spellings. In-place spellings are derived, not listed."""

    name: str
    functions: tuple = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    aten: tuple[str, ...] = ()
    commutative: bool = False
    view: bool = False
    random: bool = False
    # Position of an `inplace` flag in the functional form (F.relu(x, inplace)), if any.
    inplace_flag: int | None = None
    # Position of a `training` flag that makes the op random (F.dropout(x, p, training)).
    training_flag: int | None = None
    extra: dict = field(default_factory=dict)


def _fns(*names: str, modules=(torch, F)) -> tuple:
    """The functions with these names that exist in torch / torch.nn.functional."""
    found = []
    for name in names:
        for mod in modules:
            fn = getattr(mod, name, None)
            if fn is not None and fn not in found:
                found.append(fn)
    return tuple(found)


# fmt: off
_SPECS: tuple[_Spec, ...] = (
    # Arithmetic. operator.* is how fx records `a + b`; commutativity lets CSE merge b + a.
    _Spec("add", (operator.add, *_fns("add")), ("add", "__add__", "__radd__"), (), ("add",),
          commutative=True),
    _Spec("sub", (operator.sub, *_fns("sub", "subtract")), ("sub", "subtract", "__sub__"),
          (), ("sub",)),
    _Spec("rsub", _fns("rsub"), ("__rsub__",), (), ("rsub",)),
    _Spec("mul", (operator.mul, *_fns("mul", "multiply")), ("mul", "multiply", "__mul__"),
          (), ("mul",), commutative=True),
    _Spec("div", (operator.truediv, *_fns("div", "divide", "true_divide")),
          ("div", "divide", "true_divide", "__truediv__"), (), ("div",)),
    _Spec("floor_divide", (operator.floordiv, *_fns("floor_divide")), ("floor_divide",),
          (), ("floor_divide",)),
    _Spec("remainder", (operator.mod, *_fns("remainder", "fmod")), ("remainder", "fmod"),
          (), ("remainder", "fmod")),
    _Spec("pow", (operator.pow, *_fns("pow")), ("pow", "__pow__"), (), ("pow",)),
    _Spec("neg", (operator.neg, *_fns("neg", "negative")), ("neg", "negative"), (), ("neg",)),
    _Spec("matmul", (operator.matmul, *_fns("matmul")), ("matmul", "__matmul__"), (),
          ("matmul",)),
    _Spec("mm", _fns("mm"), ("mm",), (), ("mm",)),
    _Spec("bmm", _fns("bmm"), ("bmm",), (), ("bmm",)),
    _Spec("addmm", _fns("addmm"), ("addmm",), (), ("addmm",)),
    _Spec("baddbmm", _fns("baddbmm"), ("baddbmm",), (), ("baddbmm",)),
    _Spec("maximum", _fns("maximum"), ("maximum",), (), ("maximum",), commutative=True),
    _Spec("minimum", _fns("minimum"), ("minimum",), (), ("minimum",), commutative=True),
    _Spec("eq", (operator.eq, *_fns("eq")), ("eq", "__eq__"), (), ("eq",), commutative=True),
    _Spec("ne", (operator.ne, *_fns("ne")), ("ne", "__ne__"), (), ("ne",), commutative=True),
    _Spec("lt", (operator.lt, *_fns("lt")), ("lt", "__lt__"), (), ("lt",)),
    _Spec("le", (operator.le, *_fns("le")), ("le", "__le__"), (), ("le",)),
    _Spec("gt", (operator.gt, *_fns("gt")), ("gt", "__gt__"), (), ("gt",)),
    _Spec("ge", (operator.ge, *_fns("ge")), ("ge", "__ge__"), (), ("ge",)),
    _Spec("logical_and", (operator.and_, *_fns("logical_and")), ("logical_and", "__and__"),
          (), ("logical_and", "bitwise_and"), commutative=True),
    _Spec("logical_or", (operator.or_, *_fns("logical_or")), ("logical_or", "__or__"),
          (), ("logical_or", "bitwise_or"), commutative=True),
    _Spec("logical_not", (operator.invert, *_fns("logical_not")), ("logical_not",),
          (), ("logical_not", "bitwise_not")),
    _Spec("where", _fns("where"), ("where",), (), ("where",)),
    _Spec("clamp", _fns("clamp", "clip"), ("clamp", "clip"), (), ("clamp", "clamp_min",
          "clamp_max")),
    _Spec("abs", _fns("abs"), ("abs",), (), ("abs",)),
    _Spec("exp", _fns("exp"), ("exp",), (), ("exp",)),
    _Spec("log", _fns("log"), ("log",), (), ("log",)),
    _Spec("sqrt", _fns("sqrt"), ("sqrt",), (), ("sqrt",)),
    _Spec("rsqrt", _fns("rsqrt"), ("rsqrt",), (), ("rsqrt",)),
    _Spec("reciprocal", _fns("reciprocal"), ("reciprocal",), (), ("reciprocal",)),
    _Spec("erf", _fns("erf"), ("erf",), (), ("erf",)),
    _Spec("sin", _fns("sin"), ("sin",), (), ("sin",)),
    _Spec("cos", _fns("cos"), ("cos",), (), ("cos",)),
    _Spec("floor", _fns("floor"), ("floor",), (), ("floor",)),
    _Spec("ceil", _fns("ceil"), ("ceil",), (), ("ceil",)),
    _Spec("round", _fns("round"), ("round",), (), ("round",)),
    _Spec("sign", _fns("sign"), ("sign",), (), ("sign",)),
    _Spec("cumsum", _fns("cumsum"), ("cumsum",), (), ("cumsum",)),
    # Activations. The inplace flag position is that of torch.nn.functional.
    _Spec("relu", _fns("relu"), ("relu",), (nn.ReLU,), ("relu",), inplace_flag=1),
    _Spec("relu6", _fns("relu6"), (), (nn.ReLU6,), (), inplace_flag=1),
    _Spec("hardtanh", _fns("hardtanh"), (), (nn.Hardtanh,), ("hardtanh",), inplace_flag=3),
    _Spec("leaky_relu", _fns("leaky_relu"), (), (nn.LeakyReLU,), ("leaky_relu",),
          inplace_flag=2),
    _Spec("elu", _fns("elu"), (), (nn.ELU,), ("elu",), inplace_flag=2),
    _Spec("gelu", _fns("gelu"), (), (nn.GELU,), ("gelu",)),
    _Spec("silu", _fns("silu"), (), (nn.SiLU,), ("silu",), inplace_flag=1),
    _Spec("mish", _fns("mish"), (), (nn.Mish,), ("mish",), inplace_flag=1),
    _Spec("sigmoid", _fns("sigmoid"), ("sigmoid",), (nn.Sigmoid,), ("sigmoid",)),
    _Spec("tanh", _fns("tanh"), ("tanh",), (nn.Tanh,), ("tanh",)),
    _Spec("hardswish", _fns("hardswish"), (), (nn.Hardswish,), ("hardswish",),
          inplace_flag=1),
    _Spec("hardsigmoid", _fns("hardsigmoid"), (), (nn.Hardsigmoid,), ("hardsigmoid",),
          inplace_flag=1),
    _Spec("softmax", _fns("softmax"), ("softmax",), (nn.Softmax,), ("softmax", "_softmax")),
    _Spec("log_softmax", _fns("log_softmax"), ("log_softmax",), (nn.LogSoftmax,),
          ("log_softmax", "_log_softmax")),
    # Layers.
    _Spec("linear", _fns("linear"), (), (nn.Linear,), ("linear",)),
    _Spec("conv", _fns("conv1d", "conv2d", "conv3d"), (), (nn.Conv1d, nn.Conv2d, nn.Conv3d),
          ("convolution", "conv1d", "conv2d", "conv3d")),
    _Spec("conv_transpose", _fns("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
          (), (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), ()),
    _Spec("batch_norm", _fns("batch_norm"), (),
          (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
          ("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
           "_native_batch_norm_legit_functional", "native_batch_norm")),
    _Spec("layer_norm", _fns("layer_norm"), (), (nn.LayerNorm,),
          ("layer_norm", "native_layer_norm")),
    _Spec("group_norm", _fns("group_norm"), (), (nn.GroupNorm,),
          ("group_norm", "native_group_norm")),
    _Spec("embedding", _fns("embedding"), (), (nn.Embedding,), ("embedding",)),
    _Spec("max_pool", _fns("max_pool1d", "max_pool2d", "max_pool3d"), (),
          (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
          ("max_pool2d_with_indices", "max_pool3d_with_indices", "max_pool2d")),
    _Spec("avg_pool", _fns("avg_pool1d", "avg_pool2d", "avg_pool3d"), (),
          (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), ("avg_pool2d", "avg_pool3d")),
    _Spec("adaptive_avg_pool", _fns("adaptive_avg_pool1d", "adaptive_avg_pool2d",
          "adaptive_avg_pool3d"), (),
          (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
          ("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "mean_dim")),
    _Spec("interpolate", (F.interpolate,), (), (nn.Upsample,),
          ("upsample_nearest2d", "upsample_bilinear2d", "_upsample_nearest_exact2d")),
    _Spec("pad", (F.pad,), (), (), ("constant_pad_nd", "pad")),
    _Spec("scaled_dot_product_attention", _fns("scaled_dot_product_attention"), (), (),
          ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu")),
    # Dropout is random only when it is active (training=True and p > 0).
    _Spec("dropout", _fns("dropout"), (), (nn.Dropout, nn.Dropout1d, nn.Dropout2d,
          nn.Dropout3d, nn.AlphaDropout), ("dropout", "native_dropout"), random=True,
          inplace_flag=3, training_flag=2),
    _Spec("identity", (), (), (nn.Identity,), ("alias",), view=True),
    # Reductions.
    _Spec("sum", _fns("sum"), ("sum",), (), ("sum",)),
    _Spec("mean", _fns("mean"), ("mean",), (), ("mean",)),
    _Spec("amax", _fns("amax"), ("amax",), (), ("amax",)),
    _Spec("amin", _fns("amin"), ("amin",), (), ("amin",)),
    _Spec("max", _fns("max"), ("max",), (), ("max",)),
    _Spec("min", _fns("min"), ("min",), (), ("min",)),
    _Spec("argmax", _fns("argmax"), ("argmax",), (), ("argmax",)),
    _Spec("var", _fns("var"), ("var",), (), ("var", "var_mean")),
    _Spec("std", _fns("std"), ("std",), (), ("std",)),
    _Spec("topk", _fns("topk"), ("topk",), (), ("topk",)),
    # Shape and layout. `view=True` means "may alias an input": reshape, contiguous and
    # to() return their input itself when nothing needs to change.
    _Spec("view", (), ("view", "view_as"), (), ("view", "_unsafe_view"), view=True),
    _Spec("reshape", _fns("reshape"), ("reshape", "reshape_as"), (), ("reshape",), view=True),
    _Spec("flatten", _fns("flatten"), ("flatten",), (nn.Flatten,), ("flatten",), view=True),
    _Spec("unflatten", _fns("unflatten"), ("unflatten",), (nn.Unflatten,), ("unflatten",),
          view=True),
    _Spec("permute", _fns("permute"), ("permute",), (), ("permute",), view=True),
    _Spec("transpose", _fns("transpose", "swapaxes"), ("transpose", "swapaxes"), (),
          ("transpose",), view=True),
    _Spec("t", _fns("t"), ("t",), (), ("t",), view=True),
    _Spec("expand", (), ("expand", "expand_as"), (), ("expand",), view=True),
    _Spec("squeeze", _fns("squeeze"), ("squeeze",), (), ("squeeze",), view=True),
    _Spec("unsqueeze", _fns("unsqueeze"), ("unsqueeze",), (), ("unsqueeze",), view=True),
    _Spec("slice", _fns("narrow"), ("narrow",), (), ("slice", "narrow"), view=True),
    _Spec("select", _fns("select"), ("select",), (), ("select",), view=True),
    _Spec("split", _fns("split", "chunk", "unbind", "tensor_split"),
          ("split", "chunk", "unbind", "tensor_split"), (),
          ("split", "split_with_sizes", "chunk", "unbind"), view=True),
    _Spec("getitem", (operator.getitem,), ("__getitem__",), (), (), view=True),
    _Spec("contiguous", (), ("contiguous",), (), (), view=True),
    _Spec("to", (), ("to", "type", "float", "double", "half", "bfloat16", "int", "long",
          "bool", "type_as", "cpu", "cuda"), (), ("_to_copy",), view=True),
    _Spec("detach", _fns("detach"), ("detach",), (), ("detach",), view=True),
    _Spec("expand_copy", (), (), (), ("expand_copy",)),
    _Spec("clone", _fns("clone"), ("clone",), (), ("clone",)),
    _Spec("cat", _fns("cat", "concat", "concatenate"), (), (), ("cat",)),
    _Spec("stack", _fns("stack"), (), (), ("stack",)),
    _Spec("index_select", _fns("index_select"), ("index_select",), (), ("index_select",)),
    _Spec("gather", _fns("gather"), ("gather",), (), ("gather",)),
    _Spec("masked_fill", _fns("masked_fill"), ("masked_fill",), (), ("masked_fill",)),
    _Spec("tril", _fns("tril"), ("tril",), (), ("tril",)),
    _Spec("triu", _fns("triu"), ("triu",), (), ("triu",)),
    # Shape queries: pure functions of metadata.
    _Spec("size", (), ("size", "dim", "numel"), (), ("sym_size", "sym_numel")),
    # x.T, x.mT, x.data, x.real: tensor attributes may be views of x.
    _Spec("getattr", (getattr,), (), (), (), view=True),
    # Creation ops: pure (deterministic) unless random.
    _Spec("arange", _fns("arange"), (), (), ("arange",)),
    _Spec("full", _fns("full", "zeros", "ones", "empty", "full_like", "zeros_like",
          "ones_like", "empty_like"), ("new_zeros", "new_ones", "new_full", "new_empty"),
          (), ("full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like",
               "empty_like", "scalar_tensor", "empty_strided", "new_zeros", "new_ones",
               "new_empty", "new_full")),
    _Spec("random", _fns("rand", "randn", "randint", "rand_like", "randn_like",
          "randint_like", "randperm", "bernoulli", "multinomial", "normal", "poisson"),
          ("bernoulli", "multinomial"), (),
          ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
           "bernoulli", "multinomial", "normal", "poisson", "native_dropout"), random=True),
)
# fmt: on

# Ops that fix the layout of their result whatever the layout of their inputs: matrix
# products and embedding lookups return new contiguous tensors, arange has no tensor input,
# .contiguous() returns the memory format it is asked for. Checked in tests/test_facts.py
# on channels-last and transposed inputs. A value computed by one of them does not take its
# layout from the caller's inputs (fxopt.ir.facts). (zeros_like / rand_like are not here:
# they keep their input's layout.)
CONTIGUOUS_RESULT = frozenset(
    ("linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "embedding", "arange", "contiguous")
)

# In-place spellings that Python's operator module records for `x += y` and `x[i] = v`.
_INPLACE_OPERATORS = {
    operator.iadd: "add",
    operator.isub: "sub",
    operator.imul: "mul",
    operator.itruediv: "div",
    operator.ifloordiv: "floor_divide",
    operator.imod: "remainder",
    operator.ipow: "pow",
    operator.iand: "logical_and",
    operator.ior: "logical_or",
    operator.setitem: "setitem",
}


def _build_tables():
    by_function: dict[object, _Spec] = {}
    by_method: dict[str, _Spec] = {}
    by_module: dict[type, _Spec] = {}
    by_aten: dict[str, _Spec] = {}
    for spec in _SPECS:
        for fn in spec.functions:
            by_function.setdefault(fn, spec)
        for name in spec.methods:
            by_method.setdefault(name, spec)
        for cls in spec.modules:
            by_module.setdefault(cls, spec)
        for name in spec.aten:
            by_aten.setdefault(name, spec)
    return by_function, by_method, by_module, by_aten


_BY_FUNCTION, _BY_METHOD, _BY_MODULE, _BY_ATEN = _build_tables()
_SPEC_BY_NAME = {spec.name: spec for spec in _SPECS}
_NON_COMPUTE = {"placeholder", "get_attr", "output"}


def canonical_names() -> list[str]:
    """Every canonical op name the table knows, sorted."""
    return sorted(_SPEC_BY_NAME)


def commutative_names() -> frozenset[str]:
    """Canonical names of the ops whose first two operands commute (``add``, ``mul``...)."""
    return frozenset(spec.name for spec in _SPECS if spec.commutative)


def is_compute(node: fx.Node) -> bool:
    """True for call_function / call_method / call_module nodes."""
    return node.op not in _NON_COMPUTE


def is_call(node: object, name: str, gm: fx.GraphModule | None = None) -> bool:
    """True when ``node`` is a compute node whose canonical name is ``name``."""
    return isinstance(node, fx.Node) and is_compute(node) and info(node, gm).name == name


def calls(gm: fx.GraphModule, name: str) -> Iterator[fx.Node]:
    """The nodes of ``gm`` whose canonical name is ``name``, in graph order."""
    return (n for n in gm.graph.nodes if is_call(n, name, gm))


def info(node: fx.Node, gm: fx.GraphModule | None = None) -> OpInfo:
    """Describe ``node``. ``gm`` is needed to look up ``call_module`` targets."""
    if node.op in _NON_COMPUTE:
        return OpInfo(node.op, compute=False)
    if node.op == "call_module":
        return _module_info(node, gm)
    if node.op == "call_method":
        return _method_info(node)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _aten_info(node, target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _unknown(str(target))
    return _function_info(node, target)


def _unknown(name: str) -> OpInfo:
    # Unknown: assume it may do anything to its inputs (mutate, alias) and keep it.
    return OpInfo(name, pure=False, known=False, view=True, mutates=("*",))


# Traits of calls whose arguments cannot change them (no keyword arguments, no inplace
# or training flag passed, no running stats): computed once per spec (and commutativity).
# ops.info runs for every node in every pass, so this is most of what a pass costs on a
# large graph.
_PLAIN_INFO: dict[tuple[str, bool], OpInfo] = {}


def _with_call_traits(spec: _Spec, node: fx.Node, *, method: bool) -> OpInfo:
    """Traits of a functional or method call, given its spec and actual arguments."""
    plain = (
        not node.kwargs
        and spec.training_flag is None
        and spec.name != "batch_norm"
        and (spec.inplace_flag is None or len(node.args) <= spec.inplace_flag)
    )
    if plain:
        args = node.args
        commutative = spec.commutative and not (
            (len(args) > 0 and _may_be_sequence(args[0]))
            or (len(args) > 1 and _may_be_sequence(args[1]))
        )
        cached = _PLAIN_INFO.get((spec.name, commutative))
        if cached is None:
            cached = _PLAIN_INFO[(spec.name, commutative)] = OpInfo(
                spec.name,
                random=spec.random,
                pure=not spec.random,
                view=spec.view,
                commutative=commutative,
            )
        return cached
    mutates: list[int | str] = []
    if "out" in node.kwargs and node.kwargs["out"] is not None:
        mutates.append("out")
    # F.batch_norm(input, running_mean, running_var, ...) and torch.batch_norm(input, weight,
    # bias, running_mean, running_var, ...) update the running stats in place when training.
    stats_written = (
        _running_stats_written(node, 1 if node.target is F.batch_norm else 3)
        if spec.name == "batch_norm" and not method
        else ()
    )
    mutates.extend(stats_written)
    # x.relu() has self at args[0], like F.relu(x), so flag positions agree.
    flag = spec.inplace_flag
    if flag is not None and (
        node.kwargs.get("inplace") is True or (len(node.args) > flag and node.args[flag] is True)
    ):
        mutates.append(0)
    random = spec.random
    if spec.training_flag is not None:
        training = node.kwargs.get("training", node.kwargs.get("train"))
        if training is None and len(node.args) > spec.training_flag:
            training = node.args[spec.training_flag]
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        # F.dropout defaults to training=True; torch.dropout has no default.
        random = training is not False and p != 0
    return OpInfo(
        spec.name,
        pure=not mutates and not random,
        random=random,
        stateful=bool(stats_written),
        view=spec.view or bool(mutates),
        commutative=spec.commutative
        and "alpha" not in node.kwargs
        and not any(_may_be_sequence(a) for a in node.args[:2]),
        mutates=tuple(mutates),
    )


def _running_stats_written(node: fx.Node, first: int) -> tuple:
    """Positions (or keyword names) of the running stats a training batch norm updates.

    ``first`` is the position of ``running_mean``; ``running_var`` follows it, and the
    training flag is at position 5 in every spelling (F.batch_norm, torch.batch_norm, ATen).
    """
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    if training is False:
        return ()
    written: list[int | str] = []
    for index, name in ((first, "running_mean"), (first + 1, "running_var")):
        value = node.args[index] if len(node.args) > index else node.kwargs.get(name)
        if value is not None:
            written.append(index if len(node.args) > index else name)
    return tuple(written)


# Whether a metadata-less node may produce a sequence, remembered in the node's meta (a
# dict lookup; copies of the node compute the same kind of value): passes ask in graph
# order, so each answer reuses its inputs' answers and costs O(1). A rewrite never turns a
# tensor-producing node into a sequence-producing one, so answers do not go stale.
_SEQUENCE_KEY = "fxopt.may_be_sequence"


def _may_be_sequence(value: object, limit: int = 64) -> bool:
    """True when ``value`` may be a tuple, list or str, which ``+`` concatenates (so
    ``s + (1,)`` and ``(1,) + s`` differ: not commutative).

    Without metadata this follows ``+``/``*`` back through at most ``limit`` unremembered
    nodes and answers True (not commutative: the safe side) beyond that.
    """
    if not isinstance(value, fx.Node):
        return isinstance(value, (tuple, list, str))
    known = value.meta.get(_SEQUENCE_KEY)
    if known is not None:
        return known
    stack, seen, answer = [value], 0, False
    while stack and not answer:
        current = stack.pop()
        if isinstance(current, (tuple, list, str)):
            answer = True
            break
        if not isinstance(current, fx.Node):
            continue
        remembered = current.meta.get(_SEQUENCE_KEY)
        if remembered is not None:
            answer = remembered
            continue
        seen += 1
        if seen > limit:
            answer = True
        elif "tensor_meta" in current.meta:
            continue  # ShapeProp describes tensors only
        elif "val" in current.meta or "type" in current.meta:
            kind = current.meta.get("type")
            answer = isinstance(current.meta.get("val"), (tuple, list, str)) or (
                isinstance(kind, type) and issubclass(kind, (tuple, list, str))
            )
        elif current.op == "call_method" and current.target == "size":
            answer = True  # no metadata: shape queries, and arithmetic on them
        elif current.op == "call_function" and current.target is getattr:
            answer = True
        elif current.op == "call_function" and current.target in (operator.add, operator.mul):
            stack.extend(current.args[:2])
    value.meta[_SEQUENCE_KEY] = answer
    return answer


def _function_info(node: fx.Node, target: object) -> OpInfo:
    if target in _INPLACE_OPERATORS:
        return OpInfo(_INPLACE_OPERATORS[target], pure=False, view=True, mutates=(0,))
    spec = _BY_FUNCTION.get(target)
    if spec is None:
        name = getattr(target, "__name__", None)
        # torch.relu_ / F.relu_: the in-place twin of a known function.
        if name and name.endswith("_") and not name.endswith("__"):
            base = _BY_FUNCTION.get(getattr(torch, name[:-1], None)) or _BY_FUNCTION.get(
                getattr(F, name[:-1], None)
            )
            if base is not None:
                return OpInfo(base.name, pure=False, view=True, mutates=(0,))
        return _unknown(str(name or target))
    return _with_call_traits(spec, node, method=False)


def _method_info(node: fx.Node) -> OpInfo:
    name = str(node.target)
    spec = _BY_METHOD.get(name)
    if spec is not None:
        return _with_call_traits(spec, node, method=True)
    if name.endswith("_") and not name.endswith("__"):
        base = _BY_METHOD.get(name[:-1])
        # x.uniform_(), x.normal_(), x.bernoulli_(): random and in place.
        random = name[:-1] in ("uniform", "normal", "bernoulli", "exponential", "random")
        canonical = base.name if base is not None else name[:-1]
        return OpInfo(canonical, pure=False, random=random, view=True, mutates=(0,), known=True)
    return _unknown(name)


# ATen dropouts, all (input, p, train): random only when train is not False and p != 0.
_DROPOUTS = (
    "native_dropout",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
)


@dataclass(frozen=True)
class _Schema:
    """What an ATen overload's schema and tags say, read once per overload."""

    packet: str
    mutates: tuple[int | str, ...]
    returns_alias: bool
    random: bool
    side_effect: bool
    # Where a `dropout_p` argument sits (attention ops): position, or name if kwarg-only.
    dropout_p: int | str | None = None
    dropout_p_default: object = None


_SCHEMAS: dict[torch._ops.OpOverload, _Schema] = {}


def _schema_of(op: torch._ops.OpOverload) -> _Schema:
    found = _SCHEMAS.get(op)
    if found is None:
        schema = op._schema
        mutates = tuple(
            arg.name if arg.kwarg_only else i
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        returns_alias = any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        # torch's own judgement (asserts, profiler ranges, registered effects); for an
        # overload it depends on the op alone, so it is cached with the schema.
        side_effect = node_is_impure(op, impure_random=False) and not mutates
        dropout_p = next(
            (
                (a.name if a.kwarg_only else i, a.default_value)
                for i, a in enumerate(schema.arguments)
                if a.name == "dropout_p"
            ),
            (None, None),
        )
        found = _SCHEMAS[op] = _Schema(
            op.overloadpacket.__name__,
            mutates,
            returns_alias,
            torch.Tag.nondeterministic_seeded in op.tags,
            side_effect,
            *dropout_p,
        )
    return found


def _aten_info(node: fx.Node, op: torch._ops.OpOverload) -> OpInfo:
    static = _schema_of(op)
    packet, mutates, returns_alias = static.packet, static.mutates, static.returns_alias
    random = static.random
    if packet in _DROPOUTS:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        random = train is not False and (node.args[1] if len(node.args) > 1 else 0.5) != 0
    elif random and static.dropout_p is not None:
        # Attention is tagged random for its dropout; with a literal dropout_p of 0 it
        # draws nothing (CPU SDPA in a training graph of a model without attention dropout).
        where = static.dropout_p
        if isinstance(where, int) and where < len(node.args):
            p = node.args[where]
        else:
            p = node.kwargs.get("dropout_p", static.dropout_p_default)
        random = not (type(p) in (int, float) and p == 0)
    side_effect = static.side_effect
    # The composite aten.batch_norm's schema does not mark the running stats it updates.
    stats_written = _running_stats_written(node, 3) if packet == "batch_norm" else ()
    mutates += tuple(m for m in stats_written if m not in mutates)
    spec = _BY_ATEN.get(packet) or _BY_ATEN.get(packet.rstrip("_"))
    name = spec.name if spec is not None else packet.rstrip("_") or packet
    stateful = bool(stats_written) or (
        packet in ("_native_batch_norm_legit", "native_batch_norm")
        and len(node.args) > 5
        and node.args[5] is True
        and node.args[3] is not None
    )
    return OpInfo(
        name,
        pure=not mutates and not random and not side_effect and not stateful,
        random=random,
        stateful=stateful,
        view=returns_alias or bool(mutates),
        commutative=bool(spec and spec.commutative) and "alpha" not in node.kwargs,
        mutates=mutates,
    )


def _module_info(node: fx.Node, gm: fx.GraphModule | None) -> OpInfo:
    if gm is None:
        raise ValueError(f"ops.info needs the GraphModule to describe call_module '{node}'")
    module = submodule(gm, str(node.target))
    if type(module) is InputGuard:
        return _INPUT_GUARD
    spec = _module_spec(type(module))
    if spec is None:
        return _unknown(type(module).__name__)
    if module._forward_hooks or module._forward_pre_hooks:
        return _unknown(spec.name)  # a hook can do anything to the module's inputs
    # Plain attributes sit in the instance __dict__; getattr with a default would go
    # through nn.Module.__getattr__ and an AttributeError for every module without them.
    state = module.__dict__
    inplace = state.get("inplace", False) is True
    random = spec.random and module.training and state.get("p", 0.5) > 0
    stateful = (
        spec.name == "batch_norm"
        and module.training
        and state.get("track_running_stats", False) is True
    )
    key = (spec.name, spec.view, inplace, random, stateful)
    cached = _MODULE_INFO.get(key)
    if cached is None:
        cached = _MODULE_INFO[key] = OpInfo(
            spec.name,
            pure=not (inplace or random or stateful),
            random=random,
            stateful=stateful,
            view=spec.view or inplace,
            mutates=(0,) if inplace else (),
        )
    return cached


# An optimized graph's input check (fxopt.ir.contract): it reads the inputs, writes and
# returns nothing, and must stay (it raises on inputs the graph was not verified for).
_INPUT_GUARD = OpInfo("input_guard", pure=False, compute=False)

# A module call's OpInfo depends only on its spec and these flags: one object per combination.
_MODULE_INFO: dict[tuple, OpInfo] = {}


def _module_spec(cls: type) -> _Spec | None:
    """The spec of the nearest class in ``cls``'s MRO that the table knows."""
    spec = _SPEC_OF_CLASS.get(cls, _MISSING)
    if spec is _MISSING:
        spec = next((_BY_MODULE[c] for c in cls.__mro__ if c in _BY_MODULE), None)
        _SPEC_OF_CLASS[cls] = spec
    return spec  # type: ignore[return-value]


_MISSING = object()
_SPEC_OF_CLASS: dict[type, object] = {}


def submodule(root: torch.nn.Module, target: str) -> torch.nn.Module:
    """``root.get_submodule(target)``, several times faster on the common path.

    Passes look up the module of every ``call_module`` node in every analysis; walking
    ``_modules`` directly skips ``nn.Module.__getattr__``. Anything unusual (a missing
    name, a non-module attribute) goes to ``get_submodule`` for its error message.
    """
    module = root._modules.get(target)  # a top-level name (names never contain a dot)
    if module is not None:
        return module
    module = root
    for part in target.split("."):
        child = module._modules.get(part)
        if child is None:
            return root.get_submodule(target)
        module = child
    return module


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's direct fx.Node inputs, in argument order, without duplicates."""
    return list(input_nodes(node))


def input_nodes(node: fx.Node) -> Collection[fx.Node]:
    """The node's input nodes in argument order, each once, without copying them.

    fx keeps them as the keys of ``Node._input_nodes``; ``all_input_nodes`` copies that
    into a new list per call, and the analyses ask for every node several times per
    pipeline run (700k lists on a 100k-node speed run). Do not change the graph while
    iterating.
    """
    return node._input_nodes


def mutated_nodes(node: fx.Node, op: OpInfo) -> Iterable[fx.Node]:
    """The input nodes that ``node`` writes into (all inputs for an unknown op)."""
    if "*" in op.mutates:
        return tensor_args(node)
    found = []
    for key in op.mutates:
        if isinstance(key, str):
            value = node.kwargs.get(key)
        else:
            value = node.args[key] if key < len(node.args) else None
        if isinstance(value, fx.Node):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, fx.Node))
    return found
