"""A GPT-2-style decoder (Radford et al., 2019): pre-LN blocks, causal self-attention,
GELU MLP, and an LM head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fxopt.zoo._common import init_transformer_weights, transformer_config


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    max_positions: int = 1024
    dropout: float = 0.1
    layer_norm_eps: float = 1e-5


CONFIGS = {
    "small": GPTConfig(vocab_size=50257, hidden=768, layers=12, heads=12),
    "tiny": GPTConfig(vocab_size=1000, hidden=64, layers=2, heads=2, max_positions=128),
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position i attends to positions <= i only."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.hidden = config.hidden
        self.heads = config.heads
        self.head_dim = config.hidden // config.heads
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)  # fused, as in GPT-2's c_attn
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """``causal`` is a (seq, seq) bool tensor, True where query i may attend to key j."""
        batch, seq = x.size(0), x.size(1)
        q, k, v = self.qkv(x).split(self.hidden, dim=2)
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        # -inf is safe: the diagonal is never masked, so no row is all -inf.
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = self.attn_dropout(torch.softmax(scores, dim=-1))
        out = torch.matmul(probs, v).transpose(1, 2).contiguous().view(batch, seq, self.hidden)
        return self.resid_dropout(self.proj(out))


class MLP(nn.Module):
    """Linear (4× wider) → GELU (tanh approximation, as GPT-2) → Linear."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * config.hidden, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN decoder block: x += attn(LN(x)); x += MLP(LN(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), causal)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only language model. ``forward(input_ids)`` returns logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden)
        self.wpe = nn.Embedding(config.max_positions, config.hidden)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.apply(init_transformer_weights)
        # Tied after init so that the shared matrix gets the embedding's init.
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Positions and the causal mask come from tensor ops on the traced length, so that
        # fx and export both see them (fx cannot slice a buffer by a Proxy length).
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        causal = positions[None, :] <= positions[:, None]
        x = self.dropout(self.wte(input_ids) + self.wpe(positions)[None])
        for block in self.blocks:
            x = block(x, causal)
        return self.lm_head(self.ln_f(x))


def build(
    *, config: str = "tiny", batch: int = 2, seq: int = 16, layers: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A GPT decoder and input_ids of shape (batch, seq). ``layers`` > 0 overrides the config."""
    cfg = transformer_config(CONFIGS, config, batch=batch, seq=seq, layers=layers)
    model = GPT(cfg)
    return model, (torch.randint(0, cfg.vocab_size, (batch, seq), dtype=torch.int64),)
