"""quantize-operators on one-operator graphs, operator by operator: after the pass the
operator reads and writes uint8 (integer weights, int32 bias), and onert computes what the
float operator between DEQUANTIZE and QUANTIZE computed, within one output step — on a
first input and on a wider one that clamps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from circle_schema.v0_10.circle import (
    AddOptions,
    ConcatenationOptions,
    DepthwiseConv2DOptions,
    Padding,
    ReducerOptions,
    SoftmaxOptions,
)

from fxopt.circle.build import build
from fxopt.circle.graph import CircleGraph, Grid, Quantization
from fxopt.circle.passes.quantize_operators import QuantizeOperators
from fxopt.circle.passes.remove_dead_ops import RemoveDeadOps
from fxopt.circle.runtime import Session, onert_available

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
F32, U8 = np.float32, np.uint8
Q_IN = Quantization((0.1,), (128,))  # [-12.8, 12.7]


def _mean_options():
    options = ReducerOptions.ReducerOptionsT()
    options.keepDims = True
    return options


def _softmax_options():
    options = SoftmaxOptions.SoftmaxOptionsT()
    options.beta = 1.0
    return options


def _concat_options():
    options = ConcatenationOptions.ConcatenationOptionsT()
    options.axis = 3
    return options


def _depthwise_options():
    options = DepthwiseConv2DOptions.DepthwiseConv2DOptionsT()
    options.padding = Padding.Padding.VALID
    options.strideH = options.strideW = 1
    options.dilationHFactor = options.dilationWFactor = 1
    options.depthMultiplier = 1
    return options


# per-channel symmetric int8 grid on the filter's channel axis (3 in 1HWC)
W_SCALES = (0.01, 0.02, 0.005)
W_GRID = Grid(Quantization(W_SCALES, (0, 0, 0), axis=3), -127, 127)


def _depthwise_constants():
    steps = np.random.default_rng(3).integers(-127, 128, (1, 3, 3, 3))
    weight = (steps * np.asarray(W_SCALES)).astype(F32)  # exactly on the grid
    bias = np.asarray([0.7, -1.3, 0.25], F32)
    return [("w", weight, W_GRID), ("b", bias, None)]


@dataclass(frozen=True)
class Case:
    op: str
    in_shapes: tuple[tuple[int, ...], ...]
    in_qs: tuple[Quantization, ...]  # one per activation input
    out_shape: tuple[int, ...]
    out_q: Quantization
    options: Callable[[], object] | None = None
    # (name, float data, grid or None) appended after the activations
    constants: Callable[[], list] = field(default=list)
    spread: float = 10.0  # the first input is uniform(-spread, spread)


NHWC = (2, 4, 4, 3)
CASES = {
    "MEAN": Case(
        "MEAN",
        ((4, 4, 4, 8),),
        (Q_IN,),
        (4, 1, 1, 8),
        Quantization((0.05,), (120,)),  # parameters of its own: MEAN requantizes
        _mean_options,
        lambda: [("axes", np.asarray([1, 2], np.int32), None)],
    ),
    # the fixed-range kernels saturate beyond about ±4: a narrower first input
    "SOFTMAX": Case(
        "SOFTMAX",
        ((4, 16),),
        (Q_IN,),
        (4, 16),
        Quantization((1 / 256,), (0,)),
        _softmax_options,
        spread=4.0,
    ),
    "CONCATENATION": Case(
        "CONCATENATION", (NHWC, (2, 4, 4, 5)), (Q_IN, Q_IN), (2, 4, 4, 8), Q_IN, _concat_options
    ),
    "PAD": Case(
        "PAD",
        (NHWC,),
        (Q_IN,),
        (2, 6, 7, 3),
        Q_IN,
        None,
        lambda: [("pads", np.asarray([[0, 0], [1, 1], [2, 1], [0, 0]], np.int32), None)],
    ),
    "DEPTHWISE_CONV_2D": Case(
        "DEPTHWISE_CONV_2D",
        ((2, 5, 5, 3),),
        (Q_IN,),
        (2, 3, 3, 3),
        Quantization((0.25,), (128,)),
        _depthwise_options,
        _depthwise_constants,
    ),
    "LOGISTIC": Case(
        "LOGISTIC", ((4, 16),), (Q_IN,), (4, 16), Quantization((1 / 256,), (0,)), spread=6.0
    ),
    "TANH": Case(
        "TANH", ((4, 16),), (Q_IN,), (4, 16), Quantization((1 / 128,), (128,)), spread=3.0
    ),
    "ADD": Case(
        "ADD",
        ((4, 16), (4, 16)),
        (Q_IN, Quantization((0.05,), (100,))),  # the two inputs differ: ADD rescales both
        (4, 16),
        Quantization((0.15,), (130,)),
        AddOptions.AddOptionsT,
    ),
}


def _graph(case: Case) -> CircleGraph:
    """x_i → QUANTIZE → DEQUANTIZE → OP(…, constants) → QUANTIZE(out_q) → DEQUANTIZE → out."""
    g = CircleGraph()
    operands = []
    for i, (shape, q) in enumerate(zip(case.in_shapes, case.in_qs)):
        x = g.add_tensor(f"x{i}", shape, F32)
        xq = g.add_tensor(f"xq{i}", shape, U8, quantization=q)
        xf = g.add_tensor(f"xf{i}", shape, F32)
        g.add_op("QUANTIZE", [x], [xq])
        g.add_op("DEQUANTIZE", [xq], [xf])
        g.inputs.append(x)
        g.input_names.append(f"x{i}")
        operands.append(xf)
    for name, data, grid in case.constants():
        index = g.add_tensor(name, data.shape, data.dtype, data)
        g.tensors[index].grid = grid
        operands.append(index)
    y = g.add_tensor("y", case.out_shape, F32)
    yq = g.add_tensor("yq", case.out_shape, U8, quantization=case.out_q)
    out = g.add_tensor("out", case.out_shape, F32)
    g.add_op(case.op, operands, [y], case.options() if case.options else None)
    g.add_op("QUANTIZE", [y], [yq])
    g.add_op("DEQUANTIZE", [yq], [out])
    g.outputs, g.output_names = [out], ["output_0"]
    return g


def _quantized(case: Case) -> CircleGraph:
    g = _graph(case)
    assert QuantizeOperators()(g).stats["quantized"] == 1
    RemoveDeadOps()(g)
    return g


def _inputs(case: Case, seed: int, wide: bool) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if wide:  # a wider spread than the parameters hold: inputs clamp at 0 and 255
        return [(rng.normal(size=s) * 30).astype(F32) for s in case.in_shapes]
    return [rng.uniform(-case.spread, case.spread, s).astype(F32) for s in case.in_shapes]


def _max_error_in_steps(case: Case, before: bytes, after: bytes, inputs) -> float:
    with Session(before) as a, Session(after) as b:
        (expected,), (actual,) = a.run(inputs), b.run(inputs)
    return float(np.max(np.abs(actual - expected)) / case.out_q.scale[0])


@pytest.mark.parametrize("name", CASES)
def test_quantized_operator_reads_and_writes_uint8(name):
    case = CASES[name]
    g = _quantized(case)
    arity = len(case.in_shapes)
    assert [op.code for op in g.operators] == ["QUANTIZE"] * arity + [case.op, "DEQUANTIZE"]
    op, dequantize = g.operators[arity], g.operators[-1]
    for i, quantize in enumerate(g.operators[:arity]):
        assert op.inputs[i] == quantize.outputs[0]  # reads the integers, not their floats
        assert g.tensors[op.inputs[i]].dtype == U8
        assert g.tensors[op.inputs[i]].quantization == case.in_qs[i]
    assert dequantize.inputs == op.outputs
    out = g.tensors[op.outputs[0]]
    assert out.dtype == U8 and out.quantization == case.out_q
    # the other constants (axes, paddings) are read as they were
    for position, (_, data, grid) in enumerate(case.constants(), arity):
        if grid is None and data.dtype == np.int32:
            np.testing.assert_array_equal(g.tensors[op.inputs[position]].data, data)


def test_depthwise_weights_become_uint8_and_the_bias_int32_per_channel():
    case = CASES["DEPTHWISE_CONV_2D"]
    g = _quantized(case)
    conv = next(op for op in g.operators if op.code == "DEPTHWISE_CONV_2D")
    weight, bias = g.tensors[conv.inputs[1]], g.tensors[conv.inputs[2]]
    (_, float_weight, _), (_, float_bias, _) = case.constants()
    # int8 steps moved to uint8 beside uint8 activations: the same values, zero point 128
    assert weight.dtype == U8 and weight.quantization == Quantization(W_SCALES, (128,) * 3, 3)
    back = (weight.data.astype(np.int64) - 128) * np.asarray(W_SCALES)
    np.testing.assert_allclose(back, float_weight, rtol=1e-6)
    # bias at the accumulator's scale s_x · s_w, per output channel
    scales = Q_IN.scale[0] * np.asarray(W_SCALES)
    assert bias.dtype == np.int32 and bias.quantization.zero_point == (0, 0, 0)
    np.testing.assert_allclose(bias.quantization.scale, scales)
    np.testing.assert_allclose(bias.data * scales, float_bias, atol=0.5 * scales.max())


@pytest.mark.parametrize("name", CASES)
def test_quantize_operators_is_idempotent_on_a_quantized_operator(name):
    g = _quantized(CASES[name])
    ops = [(op.code, list(op.inputs), list(op.outputs)) for op in g.operators]
    result = QuantizeOperators()(g)
    assert result.stats["quantized"] == 0 and not result.changed
    assert [(op.code, list(op.inputs), list(op.outputs)) for op in g.operators] == ops


@pytest.mark.parametrize("name", ["SOFTMAX", "LOGISTIC", "TANH", "PAD", "CONCATENATION"])
def test_operator_whose_kernel_demands_other_output_parameters_stays_float(name):
    case = replace(CASES[name], out_q=Quantization((0.2,), (128,)))
    g = _graph(case)
    result = QuantizeOperators()(g)
    assert not result.changed and result.stats["quantized"] == 0
    assert "its kernel needs" in result.skipped[0].reason
    assert [op.code for op in g.operators].count("DEQUANTIZE") == len(case.in_shapes) + 1


@needs_onert
@pytest.mark.parametrize("name", CASES)
def test_quantized_operator_runs_in_onert_like_the_float_one(name):
    case = CASES[name]
    before, after = build(_graph(case)), build(_quantized(case))
    for seed, wide in ((0, False), (1, True)):
        inputs = _inputs(case, seed, wide)
        if wide:  # beyond the input range on both sides: the QUANTIZE clamps
            assert all(x.min() < -12.8 and x.max() > 12.7 for x in inputs)
        steps = _max_error_in_steps(case, before, after, inputs)
        assert steps <= 1.01, f"{'wide' if wide else 'first'} input: {steps:.2f} steps off"
