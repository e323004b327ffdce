"""Small float models and their PT2E-quantized versions, shared by the quantization
tests (tests/test_circle_quantize.py, tests/test_quant.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def pt2e(model: nn.Module, example: torch.Tensor, batches: int = 8) -> torch.fx.GraphModule:
    """``model`` quantized as a PT2E user does it: export, XNNPACK's symmetric per-channel
    config, calibration on random batches, convert."""
    quantize_pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")
    quantizer = xnnpack.XNNPACKQuantizer().set_global(
        xnnpack.get_symmetric_quantization_config(is_per_channel=True)
    )
    exported = torch.export.export(model.eval(), (example,))
    prepared = quantize_pt2e.prepare_pt2e(exported.module(), quantizer)
    generator = torch.Generator().manual_seed(1)
    for _ in range(batches):
        prepared(torch.randn(example.shape, generator=generator))
    return quantize_pt2e.convert_pt2e(prepared)


class SmallCNN(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(width * 4 * 4, 10)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class Depthwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.pw = nn.Conv2d(8, 16, 1)

    def forward(self, x):
        return torch.relu(self.pw(torch.relu(self.dw(x))))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        return self.o(torch.softmax(scores, -1) @ self.v(x))


class Head(nn.Module):
    """The operators the five models above leave out: pad, average pool, concatenation,
    mean, softmax, sigmoid, tanh (each with a fixed-range or shared-parameter kernel)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.fc = nn.Linear(16, 6)

    def forward(self, x):
        y = nn.functional.pad(torch.relu(self.conv(x)), (1, 1, 1, 1))
        pooled = nn.functional.avg_pool2d(y, 2), nn.functional.max_pool2d(y, 2)
        m = torch.cat(pooled, 1).mean((2, 3))
        return torch.softmax(self.fc(m), -1), torch.sigmoid(m), torch.tanh(m)


def _init(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics that are not the identity
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


# model, example input, operators that must run on integers
CASES = {
    "cnn": (SmallCNN, (2, 3, 8, 8), {"CONV_2D", "MAX_POOL_2D"}),
    "residual": (Residual, (2, 8, 8, 8), {"CONV_2D", "ADD"}),
    "depthwise": (Depthwise, (2, 8, 8, 8), {"DEPTHWISE_CONV_2D", "CONV_2D"}),
    "mlp": (MLP, (4, 16), {"CONV_2D"}),  # per-channel FC as 1×1 CONV_2D
    "attention": (Attention, (2, 6, 16), {"CONV_2D"}),
}
