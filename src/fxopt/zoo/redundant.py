"""A model that does the same work several times, as a target for common-subexpression
elimination and duplicate-module merging.

Every duplicate is computed from identical inputs and every result reaches the output, so
a correct pass can merge them but must not drop them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxopt.zoo._common import check_positive


class RedundantModel(nn.Module):
    """relu(x) twice, ``self.conv(x)`` twice, ``self.encoder(v)`` twice; all results used."""

    def __init__(self, channels: int = 8, hidden: int = 32):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.encoder = nn.Sequential(
            nn.Linear(channels, hidden), nn.ReLU(), nn.Linear(hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(x)
        b = F.relu(x)  # duplicate of a
        c1 = self.conv(x)
        c2 = self.conv(x)  # duplicate of c1
        h = a * c1 + b * c2
        v = h.mean(dim=(2, 3))
        e1 = self.encoder(v)
        e2 = self.encoder(v)  # duplicate of e1
        return e1 + e2 * torch.sigmoid(e1)


def build(
    *, batch: int = 2, channels: int = 8, image: int = 16, hidden: int = 32
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """RedundantModel and an input of shape (batch, channels, image, image)."""
    check_positive(batch=batch, channels=channels, image=image, hidden=hidden)
    model = RedundantModel(channels, hidden)
    return model, (torch.randn(batch, channels, image, image),)
