"""A small CNN with BatchNorm: the smallest model on which BN folding has work to do."""

from __future__ import annotations

import torch
from torch import nn

from fxopt.errors import UserInputError
from fxopt.zoo._common import check_positive, randomize_batchnorm


class ConvBNNet(nn.Module):
    """Two Conv2d → BatchNorm2d → ReLU → MaxPool2d stages, then a Linear classifier."""

    def __init__(self, in_channels: int = 3, width: int = 16, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            # bias=True here: folding must merge a conv bias into the BN shift too
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        # Adaptive pooling keeps the classifier's size independent of the image size.
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def build(
    *, batch: int = 2, image: int = 32, width: int = 16, classes: int = 10
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ConvBNNet and an image batch of shape (batch, 3, image, image)."""
    check_positive(batch=batch, image=image, width=width, classes=classes)
    if image < 4:
        raise UserInputError(f"option 'image' must be >= 4 (two 2× pools), got {image}")
    model = ConvBNNet(3, width, classes)
    randomize_batchnorm(model)
    return model, (torch.randn(batch, 3, image, image),)
