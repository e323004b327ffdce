"""Per-kernel validation of quantized Circle files (fxopt.circle.kernel_check): each
integer operator against its float twin, on the integers the file computed. It must pass
deep files whose outputs drift from the quantized model by integer rounding, and catch a
kernel the runtime computes wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
from torch import nn

from fxopt import circle
from fxopt.circle.graph import CircleGraph, Quantization
from fxopt.circle.kernel_check import check_kernels, integer_operators
from fxopt.circle.runtime import onert_available

pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
from fxopt.quant import quantize

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
F32, U8 = np.float32, np.uint8


def _fully_connected(per_channel: bool) -> CircleGraph:
    """x → QUANTIZE → FULLY_CONNECTED (uint8 weights, per channel or per tensor) →
    DEQUANTIZE: onert 0.1.0 computes the per-channel form wrong (its capability table)."""
    rng = np.random.default_rng(0)
    g = CircleGraph()
    x = g.add_tensor("x", (4, 16), F32)
    xq = g.add_tensor("xq", (4, 16), U8, quantization=Quantization((0.05,), (128,)))
    scales = (0.01, 0.03, 0.002, 0.02, 0.005, 0.04) if per_channel else (0.02,)
    w_q = Quantization(scales, (128,) * len(scales), 0)
    w = g.add_tensor("w", (6, 16), U8, rng.integers(1, 255, (6, 16)).astype(U8), quantization=w_q)
    b_q = Quantization(tuple(0.05 * s for s in scales), (0,) * len(scales), 0)
    b = g.add_tensor(
        "b", (6,), np.int32, rng.integers(-500, 500, 6).astype(np.int32), quantization=b_q
    )
    y = g.add_tensor("y", (4, 6), U8, quantization=Quantization((0.1,), (128,)))
    out = g.add_tensor("out", (4, 6), F32)
    g.add_op("QUANTIZE", [x], [xq])
    g.add_op("FULLY_CONNECTED", [xq, w, b], [y], FullyConnectedOptionsT())
    g.add_op("DEQUANTIZE", [y], [out])
    g.inputs, g.outputs, g.input_names, g.output_names = [x], [out], ["x"], ["out"]
    return g


@needs_onert
def test_a_kernel_the_runtime_computes_wrong_is_caught_and_named():
    x = np.random.default_rng(1).uniform(-6, 6, (4, 16)).astype(F32)
    right = check_kernels(_fully_connected(per_channel=False), [x])
    assert right.passed and right.checked == 1 and right.worst_steps <= 1.0
    wrong = check_kernels(_fully_connected(per_channel=True), [x])
    assert not wrong.passed and wrong.worst_steps > 2
    assert wrong.failures[0].startswith("FULLY_CONNECTED y:")


def test_a_float_graph_has_no_integer_kernel_to_check():
    g = CircleGraph()
    x = g.add_tensor("x", (2,), F32)
    y = g.add_tensor("y", (2,), F32)
    g.add_op("RELU", [x], [y])
    assert integer_operators(g) == [] and not check_kernels(g, []).passed


class DeepCNN(nn.Module):
    """Eight conv + BN + ReLU6 layers: deep enough for integer rounding, carried from
    layer to layer, to take the file's outputs more than two steps from the quantized
    model's."""

    def __init__(self):
        super().__init__()
        layers, width = [], 3
        for i in range(8):
            layers += [nn.Conv2d(width, 16, 3, padding=1, stride=2 if i % 3 == 2 else 1),
                       nn.BatchNorm2d(16), nn.ReLU6()]  # fmt: skip
            width = 16
        self.body = nn.Sequential(*layers)

    def forward(self, x):
        return self.body(x)


@needs_onert
def test_deep_file_validated_per_kernel_when_outputs_drift():
    torch.manual_seed(0)
    model = DeepCNN().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_var.uniform_(0.2, 0.5)  # gains above 1: differences grow with depth
    example = torch.randn(1, 3, 24, 24)
    quantized = quantize(model, (example,), calibration=2)
    result = circle.convert(quantized, (example,))  # the example and a second input
    message = result.validation.message
    assert result.validation.validated, message
    assert message.startswith("every integer kernel matches its float twin in onert"), message
    step = result.report["output_steps"][0]
    assert result.validation.max_abs_error > 2 * step  # the drift the end-to-end check saw
