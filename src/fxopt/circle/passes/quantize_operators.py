"""quantize-operators: an operator between DEQUANTIZEs and a QUANTIZE runs on the integers.

    q_x → DEQUANTIZE → x ─┐
    W  (float, on a grid) ─┼→ CONV_2D → y → QUANTIZE → q_y
    b  (float) ────────────┘

becomes ``CONV_2D(q_x, W_int, b_int32) → q_y``: the weight stored as the integers of its
grid (:class:`~fxopt.circle.graph.Grid`, exact), the bias as int32 at scale
``s_x · s_W`` per output channel (the scale of the accumulator it is added to), the
output written straight into the QUANTIZE's integer tensor. int8 weights beside uint8
activations are moved to uint8 like the activations were (zero point + 128, exact).

It applies only where the result is known to run: the operator is measured to run in the
activations' integer type (:mod:`fxopt.circle.onert_quantized`), and its kernel's demands
hold — the same parameters in and out for pools, concatenation and padding, the fixed
output parameters of LOGISTIC and SOFTMAX. A FULLY_CONNECTED with per-channel weights,
which onert computes wrong, becomes a 1×1 CONV_2D between two RESHAPEs. Everything else
stays in float between its DEQUANTIZE and QUANTIZE, which is exact, and each near miss is
reported with its reason.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph, Quantization
    >>> g = CircleGraph()
    >>> q8 = Quantization((0.1,), (128,))
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> xq = g.add_tensor("xq", (2, 3), np.uint8, quantization=q8)
    >>> xf = g.add_tensor("xf", (2, 3), np.float32)
    >>> y = g.add_tensor("y", (2, 3), np.float32)
    >>> yq = g.add_tensor("yq", (2, 3), np.uint8, quantization=Quantization((0.2,), (128,)))
    >>> out = g.add_tensor("out", (2, 3), np.float32)
    >>> g.add_op("QUANTIZE", [x], [xq])
    >>> g.add_op("DEQUANTIZE", [xq], [xf])
    >>> g.add_op("ADD", [xf, xf], [y])
    >>> g.add_op("QUANTIZE", [y], [yq])
    >>> g.add_op("DEQUANTIZE", [yq], [out])
    >>> g.inputs, g.outputs = [x], [out]
    >>> QuantizeOperators()(g).stats
    {'quantized': 1, 'fully_connected_as_conv': 0}
    >>> g.operators[2].code, g.operators[2].inputs, g.operators[2].outputs
    ('ADD', [1, 1], [4])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from circle_schema.v0_10.circle import Conv2DOptions, Padding, ReshapeOptions

from fxopt.circle.graph import CircleGraph, Grid, Operator, Quantization
from fxopt.circle.onert_quantized import runs, target
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class Form:
    """Where an operator's operands are, and what its quantized kernel demands."""

    data: tuple[int, ...] | None = (0,)  # activation positions; None: every input
    weight: int | None = None  # a float constant on a grid
    bias: int | None = None  # a float constant, stored as int32
    channel_axis: int = 0  # the weight's output-channel axis, in Circle's layout
    same_params: bool = False  # the output's parameters must be the inputs'
    # scheme → output parameters the kernel requires (TFLite's fixed-range kernels).
    fixed_output: dict[str, tuple[float, int]] | None = None
    # The constant is data, not weights: stored in the activations' type, and the output
    # keeps its parameters (GATHER of an embedding table).
    table: bool = False


# fmt: off
FORMS: dict[str, Form] = {
    "CONV_2D": Form(weight=1, bias=2, channel_axis=0),  # filter OHWI
    "DEPTHWISE_CONV_2D": Form(weight=1, bias=2, channel_axis=3),  # filter 1HWC
    "FULLY_CONNECTED": Form(weight=1, bias=2, channel_axis=0),  # weights [out, in]
    "ADD": Form((0, 1)),
    "SUB": Form((0, 1)),
    "MUL": Form((0, 1)),
    "MAXIMUM": Form((0, 1), same_params=True),
    "MAX_POOL_2D": Form(same_params=True),
    "AVERAGE_POOL_2D": Form(same_params=True),
    "MEAN": Form(),
    "PAD": Form(same_params=True),
    "RESHAPE": Form(same_params=True),
    "TRANSPOSE": Form(same_params=True),
    "CONCATENATION": Form(None, same_params=True),
    "GATHER": Form((), weight=0, table=True),  # an embedding table on its grid
    "LOGISTIC": Form(fixed_output={"uint8": (1 / 256, 0), "int16": (1 / 32768, 0)}),
    "SOFTMAX": Form(fixed_output={"uint8": (1 / 256, 0), "int16": (1 / 32768, 0)}),
    "TANH": Form(fixed_output={"uint8": (1 / 128, 128), "int16": (1 / 32768, 0)}),
}
# fmt: on

_INTEGER_RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-32768, 32767)}
#: activation scheme → (weight type, bias type): 16-bit activations take 8-bit weights and
#: 64-bit biases ("16x8", as TFLite's kernels define it).
_WEIGHT_AND_BIAS_TYPES = {
    "uint8": ("uint8", np.int32),
    "int8": ("int8", np.int32),
    "int16": ("int8", np.int64),
}


@dataclass(frozen=True)
class QuantizedOperator:
    op: int  # operator index
    quantize: int  # the QUANTIZE it writes through
    operands: tuple[int, ...]  # its inputs after the rewrite (-1 kept for a missing bias)
    weight: tuple | None = None  # (position, integers, Quantization) to store
    bias: tuple | None = None  # (position, int32 values, Quantization)
    as_conv: bool = False  # per-channel FULLY_CONNECTED → 1×1 CONV_2D


@dataclass(frozen=True)
class QuantizePlan(Plan):
    rewrites: tuple[QuantizedOperator, ...] = ()


class QuantizeOperators(Pass[QuantizePlan]):
    name = "quantize-operators"
    description = "operators between DEQUANTIZE and QUANTIZE run on the integer tensors"
    graph_kind = CIRCLE
    idempotent = True

    def analyze(self, graph: CircleGraph) -> QuantizePlan:
        producers, readers = graph.producers(), graph.consumers()
        position = {id(op): i for i, op in enumerate(graph.operators)}
        rewrites, skipped = [], []
        for index, op in enumerate(graph.operators):
            form = FORMS.get(op.code)
            if form is None or len(op.outputs) != 1:
                continue
            quantize = graph.sole_reader(op.outputs[0], readers)
            if quantize is None or quantize.code != "QUANTIZE":
                continue  # not between quantized tensors: nothing to gain
            found = _rewrite(graph, (index, position[id(quantize)]), op, form, producers)
            if isinstance(found, str):
                skipped.append(Skip(f"{op.code} {graph.tensors[op.outputs[0]].name}", found))
            else:
                rewrites.append(found)
        return QuantizePlan(tuple(skipped), tuple(rewrites))

    def transform(self, graph: CircleGraph, plan: QuantizePlan) -> PassResult:
        dropped = set()
        as_conv = []
        for rewrite in plan.rewrites:
            op = graph.operators[rewrite.op]
            quantize = graph.operators[rewrite.quantize]
            inputs = list(rewrite.operands)
            for slot in (rewrite.weight, rewrite.bias):
                if slot is not None:
                    position, values, quantization = slot
                    source = graph.tensors[op.inputs[position]]
                    inputs[position] = graph.add_tensor(
                        f"{source.name}_q",
                        values.shape,
                        values.dtype,
                        values,
                        quantization=quantization,
                    )
            op.inputs = inputs
            op.outputs = [quantize.outputs[0]]
            int16 = graph.tensors[quantize.outputs[0]].dtype == np.int16
            if int16 and hasattr(op.options, "potScaleInt16"):  # ADD, SUB
                # The general int16 kernel: the other one demands power-of-two scales.
                op.options.potScaleInt16 = False
            dropped.add(id(quantize))
            if rewrite.as_conv:
                as_conv.append(op)
        graph.operators = [op for op in graph.operators if id(op) not in dropped]
        for op in as_conv:
            _fully_connected_as_conv(graph, op)
        stats = {"quantized": len(plan.rewrites), "fully_connected_as_conv": len(as_conv)}
        return PassResult(bool(plan.rewrites), stats, plan.skipped)

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).rewrites
        assert not left, f"{len(left)} operator(s) left to quantize"


def _rewrite(graph, indices, op, form: Form, producers) -> QuantizedOperator | str:
    """The rewrite of ``op`` (and the QUANTIZE after it, ``indices``) into its quantized
    form, or why there is none."""
    out = graph.tensors[graph.operators[indices[1]].outputs[0]]
    scheme = out.dtype.name
    found = _integer_operands(graph, op, form, producers, scheme)
    if isinstance(found, str):
        return found
    operands, data_params = found
    weights = _weight_and_bias(graph, op, form, data_params[0] if data_params else None, scheme)
    if isinstance(weights, str):
        return weights
    weight, bias = weights
    if form.same_params and any(p != out.quantization for p in data_params):
        return "its kernel needs the same scale and zero point in and out"
    if form.table and weight[2] != out.quantization:
        return "its table and its output have different scales or zero points"
    if form.fixed_output is not None:
        if scheme not in form.fixed_output:
            return f"no fixed output range known for {scheme}"
        scale, zero_point = form.fixed_output[scheme]
        if out.quantization != Quantization((scale,), (zero_point,)):
            return f"its kernel needs output scale {scale:g} and zero point {zero_point}"
    code, as_conv = op.code, False
    per_channel = weight is not None and weight[2].per_channel
    if code == "FULLY_CONNECTED" and per_channel and not runs(f"{code} per-channel", scheme):
        if any(graph.tensors[i].shape_signature for i in (op.inputs[0], op.outputs[0])):
            return "per-channel FULLY_CONNECTED with a dynamic shape"
        code, as_conv = "CONV_2D", True
    if not runs(code, scheme):
        return f"{target(scheme)} has no {scheme} {code} kernel"
    return QuantizedOperator(*indices, tuple(operands), weight, bias, as_conv)


def _integer_operands(graph, op, form: Form, producers, scheme: str) -> tuple | str:
    """``op``'s inputs with each activation read from its integer tensor (the input of
    the DEQUANTIZE that feeds it), and those tensors' parameters; or why not."""
    positions = range(len(op.inputs)) if form.data is None else form.data
    operands = list(op.inputs)
    params = []
    for position in positions:
        dequantize = producers.get(op.inputs[position])
        if dequantize is None or dequantize.code != "DEQUANTIZE":
            what = "a constant" if graph.tensors[op.inputs[position]].data is not None else "float"
            return f"operand {position} is {what}, not a dequantized tensor"
        integer = graph.tensors[dequantize.inputs[0]]
        if integer.dtype.name != scheme:
            return f"operand {position} is {integer.dtype.name}, the output {scheme}"
        operands[position] = dequantize.inputs[0]
        params.append(integer.quantization)
    return operands, params


def _weight_and_bias(graph, op, form: Form, x: Quantization | None, scheme: str) -> tuple | str:
    """(weight slot, bias slot) to store as integers — None each where ``op`` has none."""
    if form.weight is None:
        return None, None
    found = _integer_weight(graph.tensors[op.inputs[form.weight]], form, scheme)
    if isinstance(found, str):
        return found
    weight = (form.weight, *found)
    has_bias = form.bias is not None and form.bias < len(op.inputs) and op.inputs[form.bias] >= 0
    if not has_bias:
        return weight, None
    bias_tensor = graph.tensors[op.inputs[form.bias]]
    if bias_tensor.data is None:
        return "its bias is computed"
    bias_type = _WEIGHT_AND_BIAS_TYPES[scheme][1]
    bias = _integer_bias(bias_tensor.data, x, found[1], bias_type)
    if isinstance(bias, str):
        return bias
    return weight, (form.bias, *bias)


def _integer_weight(tensor, form: Form, scheme: str) -> tuple[np.ndarray, Quantization] | str:
    """The integers of a float weight on its grid, in ``scheme``'s type."""
    grid: Grid | None = tensor.grid
    if tensor.data is None:
        return "its weight is computed at run time"
    if grid is None:
        return "its weight is float (not dequantized from integers)"
    q = grid.quantization
    if q.per_channel and (q.axis != form.channel_axis or len(q.scale) != tensor.shape[q.axis]):
        return "its weight's per-channel axis is not the output channels"
    shape = [1] * tensor.data.ndim
    if q.per_channel:
        shape[q.axis] = len(q.scale)
    scale = np.asarray(q.scale, np.float64).reshape(shape)
    zero_point = np.asarray(q.zero_point, np.int64).reshape(shape)
    values = tensor.data.astype(np.float64)
    steps = np.round(values / scale) + zero_point
    back = (steps - zero_point) * scale
    if not np.allclose(back, values, rtol=1e-6, atol=1e-12) or steps.min() < grid.qmin:
        return "its weight is not on its quantization grid (changed after dequantize)"
    if steps.max() > grid.qmax:
        return "its weight is not on its quantization grid (changed after dequantize)"
    zero_points = tuple(int(z) for z in q.zero_point)
    weight_type = scheme if form.table else _WEIGHT_AND_BIAS_TYPES[scheme][0]
    if weight_type == "uint8" and grid.signed:  # beside uint8 activations: the same values
        steps, zero_points = steps + 128, tuple(z + 128 for z in zero_points)
    low, high = _INTEGER_RANGE[weight_type]
    if steps.min() < low or steps.max() > high:
        return f"its weight's integers do not fit {weight_type}"
    return steps.astype(weight_type), Quantization(q.scale, zero_points, q.axis)


def _integer_bias(
    values, x: Quantization, w: Quantization, dtype: type = np.int32
) -> tuple[np.ndarray, Quantization] | str:
    """The bias at the accumulator's scale ``s_x · s_w`` (per output channel), zero point 0,
    as ``dtype`` (int32 beside 8-bit activations, int64 beside 16-bit ones); or why not."""
    scales = np.asarray(x.scale[0] * np.asarray(w.scale, np.float64))
    steps = np.round(values.astype(np.float64) / np.broadcast_to(scales, values.shape))
    bounds = np.iinfo(dtype)
    if steps.size and (steps.min() < bounds.min or steps.max() > bounds.max):
        # clamping would change the result: the operator stays float instead
        return f"its bias does not fit {np.dtype(dtype).name} at scale s_x·s_w"
    steps = steps.astype(dtype)
    scale = tuple(float(s) for s in np.broadcast_to(scales, values.shape))
    if not w.per_channel:
        scale = (scale[0],)
    return steps, Quantization(scale, (0,) * len(scale), 0)


def _fully_connected_as_conv(graph: CircleGraph, op: Operator) -> None:
    """FULLY_CONNECTED(x [.., K], W [O, K]) → RESHAPE x to [M, 1, 1, K], CONV_2D with the
    filter [O, 1, 1, K], RESHAPE back: the same sums, in the kernel onert computes right."""
    x, weight, bias = op.inputs[0], op.inputs[1], op.inputs[2] if len(op.inputs) > 2 else -1
    out = op.outputs[0]
    w = graph.tensors[weight]
    out_channels, depth = w.shape
    rows = math.prod(graph.tensors[x].shape) // depth
    filt = graph.add_tensor(
        f"{w.name}_1x1",
        (out_channels, 1, 1, depth),
        w.dtype,
        w.data.reshape(out_channels, 1, 1, depth),
        quantization=w.quantization,
    )
    result = graph.tensors[out]
    if bias < 0:
        scale = tuple(graph.tensors[x].quantization.scale[0] * s for s in w.quantization.scale)
        bias_type = _WEIGHT_AND_BIAS_TYPES[result.dtype.name][1]
        bias = graph.add_tensor(
            f"{w.name}_bias",
            (out_channels,),
            bias_type,
            np.zeros(out_channels, bias_type),
            quantization=Quantization(scale, (0,) * len(scale), 0),
        )
    x4 = _reshape(graph, x, (rows, 1, 1, depth))
    y4 = graph.add_tensor(
        f"{result.name}_4d",
        (rows, 1, 1, out_channels),
        result.dtype,
        quantization=result.quantization,
    )
    options = Conv2DOptions.Conv2DOptionsT()
    options.padding = Padding.Padding.VALID
    options.strideH = options.strideW = 1
    options.dilationHFactor = options.dilationWFactor = 1
    options.fusedActivationFunction = getattr(op.options, "fusedActivationFunction", 0)
    at = next(i for i, candidate in enumerate(graph.operators) if candidate is op)
    conv = Operator("CONV_2D", [x4[1], filt, bias], [y4], options)
    shape = graph.add_tensor(
        "shape", (len(result.shape),), np.int32, np.asarray(result.shape, np.int32)
    )
    back = Operator("RESHAPE", [y4, shape], [out], _reshape_options(result.shape))
    graph.operators[at : at + 1] = [x4[0], conv, back]


def _reshape(graph: CircleGraph, index: int, shape) -> tuple[Operator, int]:
    source = graph.tensors[index]
    out = graph.add_tensor(
        f"{source.name}_4d", shape, source.dtype, quantization=source.quantization
    )
    const = graph.add_tensor("shape", (len(shape),), np.int32, np.asarray(shape, np.int32))
    return Operator("RESHAPE", [index, const], [out], _reshape_options(shape)), out


def _reshape_options(shape) -> ReshapeOptions.ReshapeOptionsT:
    options = ReshapeOptions.ReshapeOptionsT()
    options.newShape = [int(d) for d in shape]
    return options
