"""The op table's data: every canonical op, its spellings and its static traits.

One row per canonical op; the logic that reads a node against it is in
:mod:`fxopt.ir.ops`. A row lists the op's spellings at both capture levels (``functions``:
``torch.*`` / ``F.*`` / ``operator.*`` callables; ``methods``: ``Tensor`` method names;
``modules``: ``nn.Module`` classes; ``aten``: ATen overload packet names, the first being
the one :func:`fxopt.ir.ops.emit` builds) and the traits no argument can change. In-place
spellings (``x.relu_()``, ``aten.relu_``) are derived, not listed.

    >>> from fxopt.ir.op_table import Group
    >>> sorted(Group.PERMUTES)
    ['permute', 't', 'transpose']
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.ir.compiled import CompiledRegion


@dataclass(frozen=True)
class Spec:
    """One canonical op and its spellings."""

    name: str
    functions: tuple = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    aten: tuple[str, ...] = ()
    commutative: bool = False
    #: The output *may* share storage with an input (reshape, contiguous and to() return
    #: their input itself when nothing needs to change).
    view: bool = False
    random: bool = False
    #: Position of an ``inplace`` flag in the functional form (``F.relu(x, inplace)``).
    inplace_flag: int | None = None
    #: Position of a ``training`` flag that makes the op random (``F.dropout(x, p, training)``).
    training_flag: int | None = None


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
SPECS: tuple[Spec, ...] = (
    # Arithmetic. operator.* is how fx records `a + b`; commutativity lets CSE merge b + a.
    Spec("add", functions=(operator.add, *_fns("add")), methods=("add", "__add__", "__radd__"),
         aten=("add",), commutative=True),
    Spec("sub", functions=(operator.sub, *_fns("sub", "subtract")),
         methods=("sub", "subtract", "__sub__"), aten=("sub",)),
    Spec("rsub", functions=_fns("rsub"), methods=("__rsub__",), aten=("rsub",)),
    Spec("mul", functions=(operator.mul, *_fns("mul", "multiply")),
         methods=("mul", "multiply", "__mul__"), aten=("mul",), commutative=True),
    Spec("div", functions=(operator.truediv, *_fns("div", "divide", "true_divide")),
         methods=("div", "divide", "true_divide", "__truediv__"), aten=("div",)),
    Spec("floor_divide", functions=(operator.floordiv, *_fns("floor_divide")),
         methods=("floor_divide",), aten=("floor_divide",)),
    Spec("remainder", functions=(operator.mod, *_fns("remainder", "fmod")),
         methods=("remainder", "fmod"), aten=("remainder", "fmod")),
    Spec("pow", functions=(operator.pow, *_fns("pow")), methods=("pow", "__pow__"), aten=("pow",)),
    Spec("neg", functions=(operator.neg, *_fns("neg", "negative")), methods=("neg", "negative"),
         aten=("neg",)),
    Spec("matmul", functions=(operator.matmul, *_fns("matmul")), methods=("matmul", "__matmul__"),
         aten=("matmul",)),
    Spec("mm", functions=_fns("mm"), methods=("mm",), aten=("mm",)),
    Spec("bmm", functions=_fns("bmm"), methods=("bmm",), aten=("bmm",)),
    Spec("addmm", functions=_fns("addmm"), methods=("addmm",), aten=("addmm",)),
    Spec("baddbmm", functions=_fns("baddbmm"), methods=("baddbmm",), aten=("baddbmm",)),
    Spec("maximum", functions=_fns("maximum"), methods=("maximum",), aten=("maximum",),
         commutative=True),
    Spec("minimum", functions=_fns("minimum"), methods=("minimum",), aten=("minimum",),
         commutative=True),
    Spec("eq", functions=(operator.eq, *_fns("eq")), methods=("eq", "__eq__"), aten=("eq",),
         commutative=True),
    Spec("ne", functions=(operator.ne, *_fns("ne")), methods=("ne", "__ne__"), aten=("ne",),
         commutative=True),
    Spec("lt", functions=(operator.lt, *_fns("lt")), methods=("lt", "__lt__"), aten=("lt",)),
    Spec("le", functions=(operator.le, *_fns("le")), methods=("le", "__le__"), aten=("le",)),
    Spec("gt", functions=(operator.gt, *_fns("gt")), methods=("gt", "__gt__"), aten=("gt",)),
    Spec("ge", functions=(operator.ge, *_fns("ge")), methods=("ge", "__ge__"), aten=("ge",)),
    Spec("logical_and", functions=(operator.and_, *_fns("logical_and")),
         methods=("logical_and", "__and__"), aten=("logical_and", "bitwise_and"),
         commutative=True),
    Spec("logical_or", functions=(operator.or_, *_fns("logical_or")),
         methods=("logical_or", "__or__"), aten=("logical_or", "bitwise_or"), commutative=True),
    Spec("logical_not", functions=(operator.invert, *_fns("logical_not")),
         methods=("logical_not",), aten=("logical_not", "bitwise_not")),
    Spec("where", functions=_fns("where"), methods=("where",), aten=("where",)),
    Spec("clamp", functions=_fns("clamp", "clip"), methods=("clamp", "clip"),
         aten=("clamp", "clamp_min", "clamp_max")),
    Spec("abs", functions=_fns("abs"), methods=("abs",), aten=("abs",)),
    Spec("exp", functions=_fns("exp"), methods=("exp",), aten=("exp",)),
    Spec("log", functions=_fns("log"), methods=("log",), aten=("log",)),
    Spec("sqrt", functions=_fns("sqrt"), methods=("sqrt",), aten=("sqrt",)),
    Spec("rsqrt", functions=_fns("rsqrt"), methods=("rsqrt",), aten=("rsqrt",)),
    Spec("reciprocal", functions=_fns("reciprocal"), methods=("reciprocal",),
         aten=("reciprocal",)),
    Spec("erf", functions=_fns("erf"), methods=("erf",), aten=("erf",)),
    Spec("sin", functions=_fns("sin"), methods=("sin",), aten=("sin",)),
    Spec("cos", functions=_fns("cos"), methods=("cos",), aten=("cos",)),
    Spec("floor", functions=_fns("floor"), methods=("floor",), aten=("floor",)),
    Spec("ceil", functions=_fns("ceil"), methods=("ceil",), aten=("ceil",)),
    Spec("round", functions=_fns("round"), methods=("round",), aten=("round",)),
    Spec("sign", functions=_fns("sign"), methods=("sign",), aten=("sign",)),
    Spec("cumsum", functions=_fns("cumsum"), methods=("cumsum",), aten=("cumsum",)),
    # Activations. The inplace flag position is that of torch.nn.functional.
    Spec("relu", functions=_fns("relu"), methods=("relu",), modules=(nn.ReLU,), aten=("relu",),
         inplace_flag=1),
    Spec("relu6", functions=_fns("relu6"), modules=(nn.ReLU6,), inplace_flag=1),
    Spec("hardtanh", functions=_fns("hardtanh"), modules=(nn.Hardtanh,), aten=("hardtanh",),
         inplace_flag=3),
    Spec("leaky_relu", functions=_fns("leaky_relu"), modules=(nn.LeakyReLU,), aten=("leaky_relu",),
         inplace_flag=2),
    Spec("elu", functions=_fns("elu"), modules=(nn.ELU,), aten=("elu",), inplace_flag=2),
    Spec("gelu", functions=_fns("gelu"), modules=(nn.GELU,), aten=("gelu",)),
    Spec("silu", functions=_fns("silu"), modules=(nn.SiLU,), aten=("silu",), inplace_flag=1),
    Spec("mish", functions=_fns("mish"), modules=(nn.Mish,), aten=("mish",), inplace_flag=1),
    Spec("sigmoid", functions=_fns("sigmoid"), methods=("sigmoid",), modules=(nn.Sigmoid,),
         aten=("sigmoid",)),
    Spec("tanh", functions=_fns("tanh"), methods=("tanh",), modules=(nn.Tanh,), aten=("tanh",)),
    Spec("hardswish", functions=_fns("hardswish"), modules=(nn.Hardswish,), aten=("hardswish",),
         inplace_flag=1),
    Spec("hardsigmoid", functions=_fns("hardsigmoid"), modules=(nn.Hardsigmoid,),
         aten=("hardsigmoid",), inplace_flag=1),
    Spec("softmax", functions=_fns("softmax"), methods=("softmax",), modules=(nn.Softmax,),
         aten=("softmax", "_softmax")),
    Spec("log_softmax", functions=_fns("log_softmax"), methods=("log_softmax",),
         modules=(nn.LogSoftmax,), aten=("log_softmax", "_log_softmax")),
    # Quantization: PT2E's interchange ops (quantized_decomposed.*) and the fake-quant ops
    # QAT leaves. One name each for the per-tensor and per-channel forms.
    Spec("quantize", aten=("quantize_per_tensor", "quantize_per_channel")),
    Spec("dequantize", aten=("dequantize_per_tensor", "dequantize_per_channel")),
    Spec("fake_quantize", functions=_fns("fake_quantize_per_tensor_affine",
                                         "fake_quantize_per_channel_affine"),
         aten=("fake_quantize_per_tensor_affine", "fake_quantize_per_channel_affine",
               "fake_quantize_per_tensor_affine_cachemask",
               "fake_quantize_per_channel_affine_cachemask")),
    # Layers.
    Spec("linear", functions=_fns("linear"), modules=(nn.Linear,), aten=("linear",)),
    Spec("conv", functions=_fns("conv1d", "conv2d", "conv3d"),
         modules=(nn.Conv1d, nn.Conv2d, nn.Conv3d),
         aten=("convolution", "conv1d", "conv2d", "conv3d")),
    Spec("conv_transpose",
         functions=_fns("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"),
         modules=(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)),
    Spec("batch_norm", functions=_fns("batch_norm"),
         modules=(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d),
         aten=("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit",
               "_native_batch_norm_legit_functional", "native_batch_norm")),
    Spec("layer_norm", functions=_fns("layer_norm"), modules=(nn.LayerNorm,),
         aten=("layer_norm", "native_layer_norm")),
    Spec("group_norm", functions=_fns("group_norm"), modules=(nn.GroupNorm,),
         aten=("group_norm", "native_group_norm")),
    Spec("embedding", functions=_fns("embedding"), modules=(nn.Embedding,), aten=("embedding",)),
    Spec("max_pool", functions=_fns("max_pool1d", "max_pool2d", "max_pool3d"),
         modules=(nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d),
         aten=("max_pool2d_with_indices", "max_pool3d_with_indices", "max_pool2d")),
    Spec("avg_pool", functions=_fns("avg_pool1d", "avg_pool2d", "avg_pool3d"),
         modules=(nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), aten=("avg_pool2d", "avg_pool3d")),
    Spec("adaptive_avg_pool",
         functions=_fns("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d"),
         modules=(nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d),
         aten=("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "mean_dim")),
    Spec("adaptive_max_pool",
         functions=_fns("adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"),
         modules=(nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d),
         aten=("adaptive_max_pool2d", "adaptive_max_pool3d")),
    Spec("interpolate", functions=(F.interpolate,), modules=(nn.Upsample,),
         aten=("upsample_nearest2d", "upsample_bilinear2d", "_upsample_nearest_exact2d")),
    Spec("pad", functions=(F.pad,), aten=("constant_pad_nd", "pad")),
    Spec("scaled_dot_product_attention", functions=_fns("scaled_dot_product_attention"),
         aten=("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu")),
    # Dropout is random only when it is active (training=True and p > 0).
    Spec("dropout", functions=_fns("dropout"),
         modules=(nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout),
         aten=("dropout", "native_dropout"), random=True, inplace_flag=3, training_flag=2),
    Spec("identity", modules=(nn.Identity,), aten=("alias",), view=True),
    # Generated code for a region of pure ops (fxopt.passes.inductor_regions).
    Spec("compiled_region", modules=(CompiledRegion,)),
    # Reductions.
    Spec("sum", functions=_fns("sum"), methods=("sum",), aten=("sum",)),
    Spec("mean", functions=_fns("mean"), methods=("mean",), aten=("mean",)),
    Spec("amax", functions=_fns("amax"), methods=("amax",), aten=("amax",)),
    Spec("amin", functions=_fns("amin"), methods=("amin",), aten=("amin",)),
    Spec("max", functions=_fns("max"), methods=("max",), aten=("max",)),
    Spec("min", functions=_fns("min"), methods=("min",), aten=("min",)),
    Spec("argmax", functions=_fns("argmax"), methods=("argmax",), aten=("argmax",)),
    Spec("argmin", functions=_fns("argmin"), methods=("argmin",), aten=("argmin",)),
    Spec("var", functions=_fns("var"), methods=("var",), aten=("var", "var_mean")),
    Spec("std", functions=_fns("std"), methods=("std",), aten=("std",)),
    Spec("topk", functions=_fns("topk"), methods=("topk",), aten=("topk",)),
    # Shape and layout. `view=True` means "may alias an input": reshape, contiguous and
    # to() return their input itself when nothing needs to change.
    Spec("view", methods=("view", "view_as"), aten=("view", "_unsafe_view"), view=True),
    Spec("reshape", functions=_fns("reshape"), methods=("reshape", "reshape_as"),
         aten=("reshape",), view=True),
    Spec("flatten", functions=_fns("flatten"), methods=("flatten",), modules=(nn.Flatten,),
         aten=("flatten",), view=True),
    Spec("unflatten", functions=_fns("unflatten"), methods=("unflatten",), modules=(nn.Unflatten,),
         aten=("unflatten",), view=True),
    Spec("permute", functions=_fns("permute"), methods=("permute",), aten=("permute",), view=True),
    Spec("transpose", functions=_fns("transpose", "swapaxes"), methods=("transpose", "swapaxes"),
         aten=("transpose",), view=True),
    Spec("t", functions=_fns("t"), methods=("t",), aten=("t",), view=True),
    Spec("expand", methods=("expand", "expand_as"), aten=("expand",), view=True),
    Spec("squeeze", functions=_fns("squeeze"), methods=("squeeze",), aten=("squeeze",), view=True),
    Spec("unsqueeze", functions=_fns("unsqueeze"), methods=("unsqueeze",), aten=("unsqueeze",),
         view=True),
    Spec("slice", functions=_fns("narrow"), methods=("narrow",), aten=("slice", "narrow"),
         view=True),
    Spec("select", functions=_fns("select"), methods=("select",), aten=("select",), view=True),
    Spec("split", functions=_fns("split", "chunk", "unbind", "tensor_split"),
         methods=("split", "chunk", "unbind", "tensor_split"),
         aten=("split", "split_with_sizes", "chunk", "unbind"), view=True),
    Spec("getitem", functions=(operator.getitem,), methods=("__getitem__",), view=True),
    Spec("contiguous", methods=("contiguous",), view=True),
    Spec("to",
         methods=("to", "type", "float", "double", "half", "bfloat16", "int", "long", "bool",
                  "type_as", "cpu", "cuda"),
         aten=("_to_copy",), view=True),
    Spec("detach", functions=_fns("detach"), methods=("detach",), aten=("detach",), view=True),
    Spec("expand_copy", aten=("expand_copy",)),
    Spec("clone", functions=_fns("clone"), methods=("clone",), aten=("clone",)),
    Spec("cat", functions=_fns("cat", "concat", "concatenate"), aten=("cat",)),
    Spec("stack", functions=_fns("stack"), aten=("stack",)),
    Spec("index_select", functions=_fns("index_select"), methods=("index_select",),
         aten=("index_select",)),
    Spec("gather", functions=_fns("gather"), methods=("gather",), aten=("gather",)),
    Spec("masked_fill", functions=_fns("masked_fill"), methods=("masked_fill",),
         aten=("masked_fill",)),
    Spec("tril", functions=_fns("tril"), methods=("tril",), aten=("tril",)),
    Spec("triu", functions=_fns("triu"), methods=("triu",), aten=("triu",)),
    # Shape queries: pure functions of metadata.
    Spec("size", methods=("size", "dim", "numel"), aten=("sym_size", "sym_numel")),
    # x.T, x.mT, x.data, x.real: tensor attributes may be views of x.
    Spec("getattr", functions=(getattr,), view=True),
    # Creation ops: pure (deterministic) unless random.
    Spec("arange", functions=_fns("arange"), aten=("arange",)),
    Spec("full",
         functions=_fns("full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like",
                        "empty_like"),
         methods=("new_zeros", "new_ones", "new_full", "new_empty"),
         aten=("full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like",
               "empty_like", "scalar_tensor", "empty_strided", "new_zeros", "new_ones",
               "new_empty", "new_full")),
    Spec("random",
         functions=_fns("rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
                        "randperm", "bernoulli", "multinomial", "normal", "poisson"),
         methods=("bernoulli", "multinomial"),
         aten=("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
               "bernoulli", "multinomial", "normal", "poisson", "native_dropout"),
         random=True),
)
# fmt: on

SPEC_BY_NAME: dict[str, Spec] = {spec.name: spec for spec in SPECS}
#: An ATen spelling (``"empty_like"``, ``"bernoulli"``) → the first row that lists it.
SPEC_BY_ATEN: dict[str, Spec] = {}
for _spec in SPECS:
    for _spelling in _spec.aten:
        SPEC_BY_ATEN.setdefault(_spelling, _spec)


def _group(*names: str) -> frozenset[str]:
    """A set of canonical names, each checked against the table (a typo fails at import)."""
    unknown = [name for name in names if name not in SPEC_BY_NAME]
    if unknown:
        raise ValueError(f"not in the op table: {unknown}")
    return frozenset(names)


class Group:
    """Named sets of canonical op names that passes ask about (as tinygrad's ``GroupOp``)."""

    #: ``x + 0``, ``x - 0``, ``x * 1``, ``x / 1`` may be identities.
    ARITHMETIC = _group("add", "sub", "mul", "div")
    #: Reshapes of the same elements in the same order.
    RESHAPES = _group("view", "reshape")
    FLATTENS = _group("view", "reshape", "flatten")
    PERMUTES = _group("permute", "transpose", "t")
    #: Casts: dtype (and, for some spellings, device) changes.
    CASTS = _group("to")
    #: Pure functions of a value's metadata (shape, attributes).
    SHAPE_QUERIES = _group("size", "getattr")
    #: Elementwise activations oneDNN and Circle can fuse after a conv or linear.
    ACTIVATIONS = _group(
        "relu",
        "relu6",
        "hardtanh",
        "leaky_relu",
        "elu",
        "gelu",
        "silu",
        "mish",
        "sigmoid",
        "tanh",
        "hardswish",
        "hardsigmoid",
    )
    #: Every op whose output may share storage with an input.
    VIEWS = frozenset(spec.name for spec in SPECS if spec.view)
    #: Ops whose first two operands commute.
    COMMUTATIVE = frozenset(spec.name for spec in SPECS if spec.commutative)
    #: Ops that fix the layout of their result whatever the layout of their inputs: matrix
    #: products and embedding lookups return new contiguous tensors, arange has no tensor
    #: input, .contiguous() returns the memory format it is asked for. Checked in
    #: tests/test_facts.py on channels-last and transposed inputs. (zeros_like / rand_like
    #: are not here: they keep their input's layout.)
    CONTIGUOUS_RESULT = _group(
        "linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "embedding", "arange", "contiguous"
    )


# The methods that only change the dtype, and the dtype each one gives. (.cpu(), .cuda()
# and .type_as() are casts too, but may move devices.)
CAST_METHOD_DTYPES: dict[str, torch.dtype] = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "int": torch.int32,
    "long": torch.int64,
    "bool": torch.bool,
}

# In-place spellings that Python's operator module records for `x += y` and `x[i] = v`.
INPLACE_OPERATORS = {
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

# Argument names that differ between spellings of one op, and the canonical one: ATen
# calls the tensor a method is called on `self`, and dropout's flag `train`.
CANONICAL_ARGUMENT = {"self": "input", "train": "training"}
