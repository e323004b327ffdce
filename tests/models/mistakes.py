"""Models given inputs they cannot take, for the user-mistake tests of ``fxopt convert``,
``remat`` and ``tile``. Use as the MODEL spec ``tests/models/mistakes.py:NAME``."""

import torch
from torch import nn

SPEC = __file__


def int64_into_float():
    """A float model given an int64 example (torch.export accepts it; eager does not)."""
    return nn.Sequential(nn.Linear(4, 3)).eval(), (torch.ones(2, 4, dtype=torch.int64),)


def bfloat16_model():
    """A bfloat16 model: Circle has no bfloat16 tensor type."""
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU()).to(torch.bfloat16).eval()
    return model, (torch.randn(2, 4, dtype=torch.bfloat16),)
