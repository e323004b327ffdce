"""Quantized models → integer Circle files that run in onert: PT2E graphs (torchao's
prepare_pt2e / convert_pt2e) and fake-quant graphs, the three quantization passes, and the
validation against the quantized model (on the example and on a second input)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fxopt import circle
from fxopt.circle.graph import CircleGraph, Grid, Quantization
from fxopt.circle.passes.propagate_quantization import PropagateQuantization
from fxopt.circle.passes.quantize_operators import QuantizeOperators
from fxopt.circle.passes.quantized_weights import WEIGHT_GRIDS_KEY, QuantizedWeights
from fxopt.circle.passes.remove_dead_ops import RemoveDeadOps
from fxopt.circle.runtime import LiteRTSession, Session, litert_available, onert_available
from fxopt.errors import UserInputError
from tests.quant_models import CASES, MLP, SmallCNN, _init, pt2e

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
F32, U8 = np.float32, np.uint8


@needs_onert
@pytest.mark.parametrize("name", CASES)
def test_pt2e_model_converts_to_an_integer_file_that_onert_runs(name):
    make, shape, integer_ops = CASES[name]
    torch.manual_seed(0)
    example = torch.randn(shape)
    quantized = pt2e(_init(make()), example)
    result = circle.convert(quantized, (example,))  # validated: example and other values
    assert result.validation.validated and result.validation.runtime == "onert"
    summary = result.report["quantization"]
    assert integer_ops <= set(summary["quantized_ops"]), summary
    assert summary["quantize_ops"] >= 1 and summary["dequantize_ops"] >= 1
    # a second input the example is not: a larger spread than calibration saw (clamping)
    other = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 3
    with Session(result.bytes) as session:
        (actual,) = session.run([other.numpy()])
    expected = quantized(other).detach().numpy()
    step = max(result.report["output_steps"])
    assert np.max(np.abs(actual - expected)) <= 2 * step


@needs_onert
def test_quantized_cnn_keeps_one_layout_transpose_and_stores_integer_weights():
    example = torch.randn(2, 3, 8, 8)
    result = circle.convert(pt2e(_init(SmallCNN(64)), example), (example,))
    assert result.op_counts.get("TRANSPOSE", 0) <= 2  # in: NCHW → NHWC; flatten: → NCHW
    assert "DEQUANTIZE" in result.op_counts and result.op_counts["QUANTIZE"] == 1
    float_size = len(circle.convert(_init(SmallCNN(64)), (example,)).bytes)
    assert len(result.bytes) < 0.35 * float_size  # uint8 weights, int32 biases


@needs_onert
class FakeQuant(nn.Module):
    """What QAT leaves: fake-quantized activations (uint8 or int16 ranges) and a weight
    fake-quantized per channel."""

    def __init__(self, bits: int = 8):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        scales = self.fc.weight.detach().abs().amax(1) / 127
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", torch.zeros(4, dtype=torch.int32))
        # (scale, zero point, qmin, qmax) of the input and of the output
        self.x_q, self.y_q = (
            ((0.05, 128, 0, 255), (0.03, 120, 0, 255))
            if bits == 8
            else ((2e-4, 0, -32768, 32767), (1e-4, 0, -32768, 32767))
        )

    def forward(self, x):
        x = torch.fake_quantize_per_tensor_affine(x, *self.x_q)
        w = torch.fake_quantize_per_channel_affine(
            self.fc.weight, self.scales, self.zeros, 0, -127, 127
        )
        return torch.fake_quantize_per_tensor_affine(
            nn.functional.linear(x, w, self.fc.bias), *self.y_q
        )


def test_fake_quant_graph_converts_with_its_weight_on_the_integer_grid():
    result = circle.convert(FakeQuant().eval(), (torch.randn(3, 8),))
    assert result.validation.validated and result.validation.runtime == "onert"
    assert "CONV_2D" in result.report["quantization"]["quantized_ops"]
    assert "FULLY_CONNECTED" not in result.op_counts


@pytest.mark.skipif(not litert_available(), reason="LiteRT is not installed")
def test_int16_fake_quant_graph_runs_16x8_in_litert():
    model = FakeQuant(bits=16).eval()
    result = circle.convert(model, (torch.randn(3, 8),))  # and a second input
    assert result.validation.validated and result.validation.runtime == "litert"
    assert result.report["quantization"]["quantized_ops"] == {"FULLY_CONNECTED": 1}
    x = torch.randn(5, 8)  # another batch size: the file's shape is fixed, so re-convert
    with LiteRTSession(circle.convert(model, (x,)).bytes) as session:
        (out,) = session.run([x.numpy()])
    assert np.max(np.abs(out - model(x).detach().numpy())) <= 2 * 1e-4


@needs_onert
def test_the_float_model_given_with_a_pt2e_graph_is_the_accuracy_reference():
    example = torch.randn(2, 3, 8, 8)
    model = _init(SmallCNN())
    result = circle.convert(pt2e(model, example), (example,), float_model=model)
    vs_float = result.report["quantization"]["vs_float"]
    assert 20 < vs_float["sqnr_db"][0] < 80 and vs_float["top1_agreement"][0] >= 0.5
    with pytest.raises(UserInputError, match="this model is not quantized"):
        circle.convert(model, (example,), float_model=model)


def test_pt2e_graph_module_is_accepted_though_it_says_training():
    example = torch.randn(4, 16)
    quantized = pt2e(_init(MLP()), example)
    assert quantized.training  # what PT2E leaves; convert must not ask for eval()
    result = circle.convert(quantized, (example,), validate=False)
    assert result.report["quantization"]["quantized_ops"]


def test_unsupported_quantization_ops_are_reported_all_at_once():
    import torch.ao.quantization.fx._decomposed  # registers the ops

    decomposed = torch.ops.quantized_decomposed

    class Dynamic(nn.Module):
        def forward(self, x):
            scale, zero_point = decomposed.choose_qparams.tensor(x, -128, 127, 1e-5, torch.int8)
            q = decomposed.quantize_per_tensor.tensor(x, scale, zero_point, -128, 127, torch.int8)
            return torch.atan2(x, x) + decomposed.dequantize_per_tensor.tensor(
                q, scale, zero_point, -128, 127, torch.int8
            )

    with pytest.raises(circle.UnsupportedOpsError) as error:
        circle.convert(Dynamic().eval(), (torch.randn(2, 4),))
    text = str(error.value)
    assert "choose_qparams" in text and "atan2" in text


# --- the passes on hand-built graphs ---------------------------------------------------------


def _dequantized_input(g: CircleGraph, shape: tuple, q: Quantization) -> tuple[int, int, int]:
    """Graph input x → QUANTIZE(q) → xq → DEQUANTIZE → xf: (x, xq, xf)."""
    x = g.add_tensor("x", shape, F32)
    xq = g.add_tensor("xq", shape, U8, quantization=q)
    xf = g.add_tensor("xf", shape, F32)
    g.add_op("QUANTIZE", [x], [xq])
    g.add_op("DEQUANTIZE", [xq], [xf])
    return x, xq, xf


def _quantized_op_graph(op: str, out_q: Quantization):
    """x → QUANTIZE → DEQUANTIZE → ``op`` → QUANTIZE(out_q) → DEQUANTIZE → out."""
    in_q = Quantization((0.1,), (128,))
    g = CircleGraph()
    x, _xq, xf = _dequantized_input(g, (2, 4, 4, 3), in_q)
    y = g.add_tensor("y", (2, 2, 2, 3), F32)
    yq = g.add_tensor("yq", (2, 2, 2, 3), U8, quantization=out_q)
    out = g.add_tensor("out", (2, 2, 2, 3), F32)
    g.add_op(op, [xf], [y], _pool_options())
    g.add_op("QUANTIZE", [y], [yq])
    g.add_op("DEQUANTIZE", [yq], [out])
    g.inputs, g.outputs, g.input_names, g.output_names = [x], [out], ["x"], ["output_0"]
    return g


def _pool_options():
    from circle_schema.v0_10.circle import Padding, Pool2DOptions

    options = Pool2DOptions.Pool2DOptionsT()
    options.padding = Padding.Padding.VALID
    options.strideH = options.strideW = options.filterHeight = options.filterWidth = 2
    return options


def test_quantize_operators_takes_a_pool_with_equal_parameters_and_is_idempotent():
    g = _quantized_op_graph("MAX_POOL_2D", Quantization((0.1,), (128,)))
    assert QuantizeOperators()(g).stats["quantized"] == 1
    pool = next(op for op in g.operators if op.code == "MAX_POOL_2D")
    assert g.tensors[pool.inputs[0]].dtype == U8 and g.tensors[pool.outputs[0]].dtype == U8
    assert QuantizeOperators()(g).stats["quantized"] == 0  # nothing left: idempotent


def test_quantize_operators_near_miss_says_why():
    g = _quantized_op_graph("MAX_POOL_2D", Quantization((0.2,), (128,)))  # requantizes
    result = QuantizeOperators()(g)
    assert not result.changed
    assert "same scale and zero point in and out" in result.skipped[0].reason


@needs_onert
@pytest.mark.parametrize("op", ["MAX_POOL_2D", "AVERAGE_POOL_2D"])
def test_quantized_pool_runs_in_onert_like_the_float_graph(op):
    from fxopt.circle.build import build

    q = Quantization((0.1,), (128,))
    before = build(_quantized_op_graph(op, q))
    g = _quantized_op_graph(op, q)
    QuantizeOperators()(g)
    RemoveDeadOps()(g)
    assert [o.code for o in g.operators] == ["QUANTIZE", op, "DEQUANTIZE"]
    x = np.random.default_rng(0).uniform(-10, 10, (2, 4, 4, 3)).astype(F32)
    with Session(before) as a, Session(build(g)) as b:
        np.testing.assert_allclose(a.run([x])[0], b.run([x])[0], atol=0.1 * 1.01)


def test_quantize_operators_leaves_a_weight_that_left_its_grid():
    g = CircleGraph()
    q = Quantization((0.1,), (128,))
    x, _xq, xf = _dequantized_input(g, (2, 4), q)
    w = g.add_tensor("w", (3, 4), F32, np.full((3, 4), 0.55, F32))  # not 0.5·k
    w_grid = Grid(Quantization((0.5,), (0,)), -127, 127)
    g.tensors[w].grid = w_grid
    b = g.add_tensor("b", (3,), F32, np.zeros(3, F32))
    y = g.add_tensor("y", (2, 3), F32)
    yq = g.add_tensor("yq", (2, 3), U8, quantization=q)
    g.add_op("FULLY_CONNECTED", [xf, w, b], [y])
    g.add_op("QUANTIZE", [y], [yq])
    g.inputs, g.outputs = [x], [yq]
    result = QuantizeOperators()(g)
    assert not result.changed and "not on its quantization grid" in result.skipped[0].reason
    g.tensors[w].data = np.full((3, 4), 1.5, F32)  # 3 steps of 0.5: on the grid
    g.tensors[b].data = np.full(3, 2e8, F32)  # 4e9 steps of 0.05: int32 would clamp it
    result = QuantizeOperators()(g)
    assert not result.changed and "bias does not fit int32" in result.skipped[0].reason
    g.tensors[b].data = np.zeros(3, F32)
    assert QuantizeOperators()(g).changed
    fc = next(op for op in g.operators if op.code == "FULLY_CONNECTED")
    weight, bias = g.tensors[fc.inputs[1]], g.tensors[fc.inputs[2]]
    assert weight.dtype == U8 and int(weight.data[0, 0]) == 3 + 128  # int8 → uint8, exact
    assert weight.quantization.zero_point == (128,)
    assert bias.dtype == np.int32 and bias.quantization.scale == (0.1 * 0.5,)


@needs_onert
def test_propagate_quantization_moves_and_hoists_through_chains():
    from fxopt.circle.build import build

    q = Quantization((0.1,), (128,))
    g = CircleGraph()
    x, _xq, xf = _dequantized_input(g, (2, 3, 4), q)
    t = g.add_tensor("t", (2, 4, 3), F32)
    r = g.add_tensor("r", (8, 3), F32)
    out = g.add_tensor("out", (8, 3), F32)
    perm = g.add_tensor("perm", (3,), np.int32, np.asarray([0, 2, 1], np.int32))
    g.add_op("TRANSPOSE", [xf, perm], [t])
    shape = g.add_tensor("shape", (2,), np.int32, np.asarray([8, 3], np.int32))
    g.add_op("RESHAPE", [t, shape], [r])
    g.add_op("RELU", [r], [out])  # a float reader: the DEQUANTIZE ends before it
    g.inputs, g.outputs = [x], [out]
    g.input_names, g.output_names = ["x"], ["output_0"]
    before = build(g)
    result = PropagateQuantization()(g)
    assert result.stats["moved"] == 2
    RemoveDeadOps()(g)
    assert [op.code for op in g.operators] == [
        "QUANTIZE",
        "TRANSPOSE",
        "RESHAPE",
        "DEQUANTIZE",
        "RELU",
    ]
    assert not PropagateQuantization()(g).changed  # idempotent
    # moving values unchanged on the integers is exact: the same outputs in onert, on an
    # input in range and on a wider one that clamps
    rng = np.random.default_rng(0)
    with Session(before) as a, Session(build(g)) as b:
        for x_value in (rng.uniform(-12, 12, (2, 3, 4)), rng.normal(0, 40, (2, 3, 4))):
            x_value = x_value.astype(F32)
            np.testing.assert_array_equal(a.run([x_value])[0], b.run([x_value])[0])


def test_quantized_weights_records_the_grid_and_keeps_values():
    import torch.ao.quantization.fx._decomposed  # registers the ops

    from fxopt.capture import plain_graph_module

    dq = torch.ops.quantized_decomposed.dequantize_per_channel.default

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randint(-127, 128, (3, 4), dtype=torch.int8))
            self.register_buffer("s", torch.tensor([0.1, 0.2, 0.3]))
            self.register_buffer("z", torch.zeros(3, dtype=torch.int64))

        def forward(self, x):
            return nn.functional.linear(x, dq(self.w, self.s, self.z, 0, -127, 127, torch.int8))

    model, x = M(), torch.randn(2, 4)
    gm = plain_graph_module(torch.export.export(model, (x,)).module())
    before = gm(x)
    assert QuantizedWeights()(gm).stats == {"weights": 1}
    torch.testing.assert_close(gm(x), before, rtol=0, atol=0)
    (grid,) = gm.meta[WEIGHT_GRIDS_KEY].values()
    assert grid.quantization.scale == pytest.approx((0.1, 0.2, 0.3))
    assert (grid.qmin, grid.qmax, grid.quantization.axis) == (-127, 127, 0)
    assert not QuantizedWeights()(gm).changed
    x2 = torch.randn(5, 4)  # another batch: the same weights
    torch.testing.assert_close(gm(x2), model(x2))


@needs_onert
def test_propagate_quantization_moves_a_pad_whose_input_has_other_readers():
    """A residual block's input feeds a padded conv and the shortcut: the PAD runs on the
    integers, the shortcut keeps its DEQUANTIZE."""
    from circle_schema.v0_10.circle.PadOptions import PadOptionsT

    from fxopt.circle.build import build

    q = Quantization((0.1,), (128,))
    g = CircleGraph()
    x, xq, xf = _dequantized_input(g, (1, 2, 2, 3), q)
    pads = np.asarray([[0, 0], [1, 1], [1, 1], [0, 0]], np.int32)
    padded = g.add_tensor("padded", (1, 4, 4, 3), F32)
    shortcut = g.add_tensor("shortcut", (1, 2, 2, 3), F32)
    g.add_op("PAD", [xf, g.add_tensor("pads", (4, 2), np.int32, pads)], [padded], PadOptionsT())
    g.add_op("RELU", [xf], [shortcut])
    g.inputs, g.outputs = [x], [padded, shortcut]
    g.input_names, g.output_names = ["x"], ["output_0", "output_1"]
    before = build(g)
    assert PropagateQuantization()(g).stats["moved"] == 1
    pad = next(op for op in g.operators if op.code == "PAD")
    assert pad.inputs[0] == xq and g.tensors[pad.outputs[0]].dtype == U8
    assert not PropagateQuantization()(g).changed  # idempotent
    value = np.random.default_rng(0).normal(0, 20, (1, 2, 2, 3)).astype(F32)  # clamps
    with Session(before) as a, Session(build(g)) as b:
        for expected, actual in zip(a.run([value]), b.run([value])):
            np.testing.assert_array_equal(expected, actual)  # zeros pad as the zero point


def _padded_max_pool(value: float) -> CircleGraph:
    """x → QUANTIZE → DEQUANTIZE → PADV2(value) → MAX_POOL_2D 3×3 stride 2: a max-pool's
    padding, lowered."""
    q = Quantization((0.1,), (128,))
    g = CircleGraph()
    x, _xq, xf = _dequantized_input(g, (1, 4, 4, 2), q)
    padded = g.add_tensor("padded", (1, 6, 6, 2), F32)
    out = g.add_tensor("out", (1, 2, 2, 2), F32)
    pads = np.asarray([[0, 0], [1, 1], [1, 1], [0, 0]], np.int32)
    fill = g.add_tensor("fill", (), F32, np.asarray(value, F32))
    g.add_op("PADV2", [xf, g.add_tensor("pads", (4, 2), np.int32, pads), fill], [padded])
    options = _pool_options()
    options.filterHeight = options.filterWidth = 3
    g.add_op("MAX_POOL_2D", [padded], [out], options)
    g.inputs, g.outputs, g.input_names, g.output_names = [x], [out], ["x"], ["output_0"]
    return g


@needs_onert
def test_propagate_quantization_moves_a_max_pool_padding_onto_the_integers():
    from fxopt.circle.build import build

    lowest = float(np.finfo(F32).min)
    g = _padded_max_pool(lowest)
    before = build(g)
    assert PropagateQuantization()(g).stats["moved"] == 1
    pad = next(op for op in g.operators if op.code == "PADV2")
    fill = g.tensors[pad.inputs[2]]
    assert g.tensors[pad.outputs[0]].dtype == U8 and fill.dtype == U8 and int(fill.data) == 0
    assert not PropagateQuantization()(g).changed  # idempotent
    value = np.random.default_rng(0).normal(0, 20, (1, 4, 4, 2)).astype(F32)  # clamps too
    with Session(before) as a, Session(build(g)) as b:
        np.testing.assert_array_equal(a.run([value])[0], b.run([value])[0])
    # near miss: a value the grid holds (-5.0 > -12.8) is a real value, not "lowest"
    near = _padded_max_pool(-5.0)
    assert PropagateQuantization()(near).stats["moved"] == 0
