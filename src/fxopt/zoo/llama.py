"""Llama-shaped decoders (Touvron et al., 2023) and two relatives: RMSNorm, rotary position
embeddings, grouped-query attention (fewer key/value heads than query heads), a gated MLP.

``family`` picks the variant: ``llama`` (SwiGLU); ``qwen2`` (biases on q, k and v);
``gemma`` (GeGLU with tanh GELU, RMSNorm scaling by ``1 + weight``, embeddings scaled by
sqrt(hidden), the LM head tied to the embedding).

``step`` picks what is called:

* ``prefill``: ``input_ids`` (batch, seq) → logits (batch, seq, vocab), causal attention.
* ``decode``: one token against a static KV cache of ``cache`` slots, the form NPU
  toolchains take (every shape fixed): ``(input_ids (batch, 1), position (batch,) int64,
  keys, values (batch, layers, kv_heads, cache, head_dim))`` → ``(logits (batch, 1,
  vocab), keys, values)`` with the token's key and value written at ``position``; slots after it
  are masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxopt.errors import UserInputError
from fxopt.zoo._common import check_choice, check_positive, init_transformer_weights

FAMILIES = ("llama", "qwen2", "gemma")
STEPS = ("prefill", "decode")


@dataclass(frozen=True)
class DecoderConfig:
    family: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    eps: float = 1e-6


CONFIGS = {
    "tiny": dict(vocab_size=256, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
    "small": dict(vocab_size=32000, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1376),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, plus_one: bool):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(hidden) if plus_one else torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + self.weight) if self.plus_one else x * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: each half of the head dim rotated against the other."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.heads, self.kv_heads = config.heads, config.kv_heads
        self.head_dim = config.hidden // config.heads
        bias = config.family == "qwen2"
        self.q = nn.Linear(config.hidden, config.heads * self.head_dim, bias=bias)
        self.k = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=bias)
        self.v = nn.Linear(config.hidden, config.kv_heads * self.head_dim, bias=bias)
        self.o = nn.Linear(config.heads * self.head_dim, config.hidden, bias=False)

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], heads, self.head_dim).transpose(1, 2)

    def repeat(self, x: torch.Tensor) -> torch.Tensor:
        """Each key/value head shared by heads / kv_heads query heads."""
        batch, _, length, dim = x.shape
        groups = self.heads // self.kv_heads
        x = x[:, :, None].expand(batch, self.kv_heads, groups, length, dim)
        return x.reshape(batch, self.heads, length, dim)

    def forward(self, x, cos, sin, cache=None, write=None, visible=None):
        """Prefill: causal attention over ``x``. Decode: ``cache`` = (keys, values) of one
        layer, ``write`` the slot of the new token, ``visible`` the slots it may read;
        returns the output and the layer's new keys and values."""
        q = rotate(self.split(self.q(x), self.heads), cos, sin)
        k = rotate(self.split(self.k(x), self.kv_heads), cos, sin)
        v = self.split(self.v(x), self.kv_heads)
        if cache is not None:
            k = torch.where(write, k, cache[0])  # (where: exact, and a Circle SELECT)
            v = torch.where(write, v, cache[1])
            out = F.scaled_dot_product_attention(
                q, self.repeat(k), self.repeat(v), attn_mask=visible
            )
        else:
            out = F.scaled_dot_product_attention(q, self.repeat(k), self.repeat(v), is_causal=True)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.o(out), k, v


class GatedMLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.up = nn.Linear(config.hidden, config.intermediate, bias=False)
        self.down = nn.Linear(config.intermediate, config.hidden, bias=False)
        self.gelu = config.family == "gemma"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down(gate * self.up(x))


class Layer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        plus_one = config.family == "gemma"
        self.attn_norm = RMSNorm(config.hidden, config.eps, plus_one)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.eps, plus_one)
        self.mlp = GatedMLP(config)

    def forward(self, x, cos, sin, cache=None, write=None, visible=None):
        out, k, v = self.attn(self.attn_norm(x), cos, sin, cache, write, visible)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), k, v


class Decoder(nn.Module):
    """The decoder; ``forward`` is the prefill, :class:`DecodeStep` the decode step."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.eps, config.family == "gemma")
        self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        head_dim = config.hidden // config.heads
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.apply(init_transformer_weights)
        if config.family == "gemma":
            self.lm_head.weight = self.embed.weight

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape (batch, 1, seq, head_dim) for ``positions`` (batch, seq)."""
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1)[:, None]
        return angles.cos(), angles.sin()

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return x * math.sqrt(self.config.hidden) if self.config.family == "gemma" else x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary(positions.expand(input_ids.shape[0], -1))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)[0]
        return self.lm_head(self.norm(x))


class DecodeStep(nn.Module):
    """One token of a :class:`Decoder` against a static KV cache (see the module doc)."""

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids, position, keys, values):
        decoder = self.decoder
        cos, sin = decoder.rotary(position[:, None])
        slots = torch.arange(keys.shape[3], device=keys.device)
        write = (slots == position[:, None])[:, None, :, None]  # (batch, 1, cache, 1)
        visible = (slots <= position[:, None])[:, None, None, :]  # (batch, 1, 1, cache)
        x = decoder.embed_tokens(input_ids)
        new_keys, new_values = [], []
        for index, layer in enumerate(decoder.layers):
            x, k, v = layer(x, cos, sin, (keys[:, index], values[:, index]), write, visible)
            new_keys.append(k)
            new_values.append(v)
        logits = decoder.lm_head(decoder.norm(x))
        return logits, torch.stack(new_keys, dim=1), torch.stack(new_values, dim=1)


def build(
    *,
    family: str = "llama",
    config: str = "tiny",
    step: str = "prefill",
    batch: int = 1,
    seq: int = 16,
    cache: int = 32,
    layers: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A decoder of ``family`` and its example: ``seq`` tokens for the prefill, one token
    at position ``seq`` of a ``cache``-slot KV cache (the first ``seq`` slots filled) for
    the decode step. ``layers`` > 0 overrides the config's depth."""
    check_choice("family", family, FAMILIES)
    check_choice("config", config, CONFIGS)
    check_choice("step", step, STEPS)
    check_positive(batch=batch, seq=seq, cache=cache)
    if layers < 0:
        raise UserInputError(f"option 'layers' must be >= 0 (0: the config's), got {layers}")
    options = dict(CONFIGS[config], **({"layers": layers} if layers else {}))
    cfg = DecoderConfig(family=family, **options)
    decoder = Decoder(cfg)
    if step == "prefill":
        return decoder, (torch.randint(0, cfg.vocab_size, (batch, seq)),)
    if seq >= cache:
        raise UserInputError(f"option 'seq' ({seq}) must be < 'cache' ({cache}): the slots filled")
    head_dim = cfg.hidden // cfg.heads
    shape = (batch, cfg.layers, cfg.kv_heads, cache, head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    keys[..., seq:, :] = 0  # (slots not yet written)
    values[..., seq:, :] = 0
    token = torch.randint(0, cfg.vocab_size, (batch, 1))
    return DecodeStep(decoder), (token, torch.full((batch,), seq), keys, values)
