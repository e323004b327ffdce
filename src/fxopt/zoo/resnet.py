"""ResNet (He et al., 2015) with basic blocks (ResNet-18) or bottlenecks (ResNet-50/152).

The layout follows the torchvision reference (stride on the 3×3 conv of a bottleneck,
"ResNet v1.5"), so graph sizes and parameter counts match what users know.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fxopt.zoo._common import check_positive, randomize_batchnorm


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3×3 convs with a residual connection (ResNet-18/34)."""

    expansion = 1

    def __init__(
        self, in_planes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        self.conv1 = conv3x3(in_planes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3 (strided), 1×1 expand ×4, with a residual connection."""

    expansion = 4

    def __init__(
        self, in_planes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        self.conv1 = conv1x1(in_planes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem (7×7 conv, BN, ReLU, max-pool), four stages of blocks, global pool, Linear."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], layers: list[int], classes: int = 1000
    ):
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * block.expansion, classes)
        self._he_scale_convs()

    @torch.no_grad()
    def _he_scale_convs(self) -> None:
        # PyTorch initializes convs U(±1/sqrt(fan_in)), which shrinks activations layer after
        # layer; ×sqrt(6) makes that He-uniform (variance 2/fan_in). Rescaling costs far less
        # than drawing 60M fresh random numbers for ResNet-152.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.mul_(math.sqrt(6.0))

    def _make_layer(
        self, block: type[BasicBlock | Bottleneck], planes: int, blocks: int, stride: int = 1
    ) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.in_planes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.in_planes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.in_planes, planes, stride, downsample)]
        self.in_planes = planes * block.expansion
        layers += [block(self.in_planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


@torch.no_grad()
def _damp_residual_branches(model: ResNet) -> None:
    # Without this, each block adds O(1) variance and 50 blocks of ResNet-152 blow
    # activations up; a small last-BN scale (as in "zero-init residual", but nonzero so the
    # branch still matters) keeps outputs O(1) at any depth.
    for m in model.modules():
        if isinstance(m, Bottleneck):
            m.bn3.weight.uniform_(0.1, 0.3)
        elif isinstance(m, BasicBlock):
            m.bn2.weight.uniform_(0.1, 0.3)


def _build(
    block: type[BasicBlock | Bottleneck], layers: list[int], batch: int, image: int, classes: int
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    check_positive(batch=batch, image=image, classes=classes)
    model = ResNet(block, layers, classes)
    randomize_batchnorm(model)
    _damp_residual_branches(model)
    return model, (torch.randn(batch, 3, image, image),)


def build_resnet18(
    *, batch: int = 1, image: int = 64, classes: int = 1000
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ResNet-18 (basic blocks [2, 2, 2, 2]) and an input of shape (batch, 3, image, image)."""
    return _build(BasicBlock, [2, 2, 2, 2], batch, image, classes)


def build_resnet50(
    *, batch: int = 1, image: int = 64, classes: int = 1000
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ResNet-50 (bottlenecks [3, 4, 6, 3]) and an input of shape (batch, 3, image, image)."""
    return _build(Bottleneck, [3, 4, 6, 3], batch, image, classes)


def build_resnet152(
    *, batch: int = 1, image: int = 64, classes: int = 1000
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ResNet-152 (bottlenecks [3, 8, 36, 3]) and an input of shape (batch, 3, image, image)."""
    return _build(Bottleneck, [3, 8, 36, 3], batch, image, classes)
