"""SimpleMLP: a multi-layer perceptron, 784 → 256 → 256 → 10 with ReLU."""

from __future__ import annotations

import torch
from torch import nn

from fxopt.zoo._common import check_positive


class SimpleMLP(nn.Module):
    """Three Linear layers with ReLU between them (an MNIST-sized classifier)."""

    def __init__(self, input_dim: int = 784, hidden: int = 256, out: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, out)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


def build(*, batch: int = 2, hidden: int = 256) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """SimpleMLP(784, ``hidden``, 10) and an input of shape (batch, 784)."""
    check_positive(batch=batch, hidden=hidden)
    model = SimpleMLP(784, hidden, 10)
    return model, (torch.randn(batch, 784),)
