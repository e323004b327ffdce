"""MobileNetV2 (Sandler et al., 2018): inverted residuals, depthwise convs, ReLU6."""

from __future__ import annotations

import torch
from torch import nn

from fxopt.zoo._common import check_positive, randomize_batchnorm

# (expansion t, output channels c, repeats n, first stride s), from the paper's Table 2.
INVERTED_RESIDUAL_SETTING = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
]


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round channels to a multiple of ``divisor``, never going more than 10% below ``value``."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


class ConvBNReLU6(nn.Sequential):
    """Conv2d (optionally depthwise) → BatchNorm2d → ReLU6."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(
            nn.Conv2d(in_ch, out_ch, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """1×1 expand → 3×3 depthwise → 1×1 linear projection, residual when shapes allow."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = round(in_ch * expand_ratio)
        self.use_residual = stride == 1 and in_ch == out_ch
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(ConvBNReLU6(in_ch, hidden, kernel=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            # The projection is linear on purpose: ReLU here destroys low-dim information.
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            nn.BatchNorm2d(out_ch),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_residual:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2. ``width`` scales every layer's channels; the last conv never shrinks."""

    def __init__(self, width: float = 1.0, classes: int = 1000, dropout: float = 0.2):
        super().__init__()
        in_ch = make_divisible(32 * width)
        last_ch = make_divisible(1280 * max(1.0, width))
        features: list[nn.Module] = [ConvBNReLU6(3, in_ch, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            out_ch = make_divisible(c * width)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, t))
                in_ch = out_ch
        features.append(ConvBNReLU6(in_ch, last_ch, kernel=1))
        self.features = nn.Sequential(*features)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last_ch, classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(self.features(x)), 1)
        return self.classifier(x)


def build(
    *, batch: int = 1, image: int = 64, width: float = 1.0, classes: int = 1000
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """MobileNetV2 at ``width`` and an input of shape (batch, 3, image, image)."""
    check_positive(batch=batch, image=image, width=width, classes=classes)
    model = MobileNetV2(width, classes)
    randomize_batchnorm(model)
    return model, (torch.randn(batch, 3, image, image),)
