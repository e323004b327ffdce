"""Models that change their own state when they run, for the tests that the returned
module is never run by fxopt (verification and timing work on copies)."""

import torch
from torch import nn


class CountsCalls(nn.Module):
    """A conv whose forward counts its calls in a buffer (in place)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.conv(x)
