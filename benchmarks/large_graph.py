"""Large generated models for end-to-end runs of the command line:

    fxopt optimize benchmarks/large_graph.py:conv_bn_100k --json

``conv_bn_<n>``: a module-level graph of about n nodes, Conv2d → BatchNorm2d (eval) → ReLU
blocks of 2 channels with a residual add every fourth block (preset_speed.py's conv-bn
family), on a 1×2×4×4 input: a graph as long as a very large model's, with weights too
small to matter, so the run times fxopt, not arithmetic.
"""

from __future__ import annotations

import torch

from preset_speed import build_conv_bn


def _conv_bn(nodes: int):
    module, _ = build_conv_bn(nodes)
    return module, (torch.randn(1, 2, 4, 4),)


def conv_bn_1k():
    return _conv_bn(1_000)


def conv_bn_10k():
    return _conv_bn(10_000)


def conv_bn_100k():
    return _conv_bn(100_000)
