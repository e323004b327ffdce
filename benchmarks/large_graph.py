"""Large generated models for end-to-end runs of the command line:

    fxopt optimize benchmarks/large_graph.py:conv_bn_100k --json
    python benchmarks/e2e_large.py            # the same, timed, into results/e2e_large.json

``llama_small`` / ``llama_xl``: benchmarks/memory.py's Llama-shaped decoders (0.18 and
5.8 GiB of fp32 weights), for its command-line jobs.

``conv_bn_<n>``: a model whose fx graph has about n nodes: Conv2d → BatchNorm2d (eval) →
ReLU blocks of 2 channels with a residual add every fourth block (preset_speed.py's
conv-bn family), on a 1×2×4×4 input. It is a plain ``nn.Module`` whose ``forward`` loops
over an ``nn.ModuleList`` of blocks, as a user's model is (not a prebuilt GraphModule:
fxopt traces it, copies it and verifies it the way it would a real one). The graph is as
long as a very large model's, with weights too small to matter, so the run times fxopt,
not arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

CHANNELS = 2


class ConvBnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 1)
        self.bn = nn.BatchNorm2d(CHANNELS)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class ConvBnChain(nn.Module):
    """``blocks`` conv-bn-relu blocks, a residual add after every fourth."""

    def __init__(self, blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(ConvBnBlock() for _ in range(blocks))

    def forward(self, x):
        skip = x
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index % 4 == 3:
                x = torch.add(x, skip)
                skip = x
        return x


def _conv_bn(nodes: int):
    blocks = max(1, (nodes - 2) * 4 // 13)  # 3 nodes per block + one add per 4 blocks
    # Seeded, so every run builds the same weights and statistics.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(nodes)
        model = ConvBnChain(blocks).eval()
        for block in model.blocks:
            block.bn.running_mean.uniform_(-1, 1)
            block.bn.running_var.uniform_(0.5, 2)
    return model, (torch.randn(1, 2, 4, 4),)


def conv_bn_1k():
    return _conv_bn(1_000)


def conv_bn_10k():
    return _conv_bn(10_000)


def conv_bn_100k():
    return _conv_bn(100_000)


def _llama(size: str):
    """A Llama-shaped decoder of benchmarks/memory.py's ``size`` (random weights, seeded),
    returning logits for 1 × 32 token ids (needs ``transformers``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from memory import _llama as build

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model, inputs, _ = build(size)
    return model, inputs


def llama_small():
    """0.18 GiB of fp32 weights (hidden 512, 4 layers, vocab 32000)."""
    return _llama("small")


def llama_xl():
    """5.8 GiB of fp32 weights (1.57B parameters: hidden 2048, 28 layers, vocab 32000): the
    command line on a model as big as this machine can hold beside a job."""
    return _llama("xl")
