"""A BERT encoder (Devlin et al., 2018): embeddings, post-LN transformer layers, pooler.

Attention is written out (Linear q/k/v, matmul, scale, additive mask, softmax, matmul) instead
of calling ``scaled_dot_product_attention``, so that the graph shows the patterns that
attention-fusion passes look for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fxopt.zoo._common import init_transformer_weights, transformer_config


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_positions: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.1
    layer_norm_eps: float = 1e-12


CONFIGS = {
    "base": BertConfig(vocab_size=30522, hidden=768, layers=12, heads=12, intermediate=3072),
    "tiny": BertConfig(
        vocab_size=1000, hidden=64, layers=2, heads=2, intermediate=128, max_positions=128
    ),
}

# Added to the scores of padded keys; large enough that softmax gives them exactly 0, finite
# so that a fully padded row still gives a (uniform) distribution instead of NaN.
MASK_VALUE = -1e9


class BertEmbeddings(nn.Module):
    """word + position + token_type embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden)
        self.layer_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # arange of the traced length, not a sliced buffer: fx cannot slice a buffer by a Proxy.
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
        token_type_ids = torch.zeros_like(input_ids)  # single-segment input
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(position_ids)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.dropout(self.layer_norm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with an additive padding mask, then output projection."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.heads = config.heads
        self.head_dim = config.hidden // config.heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.output = nn.Linear(config.hidden, config.hidden)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.size(0), x.size(1)
        return x.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        q = self._split_heads(self.query(x))
        k = self._split_heads(self.key(x))
        v = self._split_heads(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = self.attn_dropout(torch.softmax(scores + mask_bias, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).contiguous()
        context = context.view(x.size(0), x.size(1), self.heads * self.head_dim)
        return self.output(context)


class BertLayer(nn.Module):
    """Post-LN transformer layer: x = LN(x + attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.attn_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden, config.intermediate)
        self.act = nn.GELU()
        self.ffn_output = nn.Linear(config.intermediate, config.hidden)
        self.ffn_dropout = nn.Dropout(config.dropout)
        self.ffn_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_dropout(self.attention(x, mask_bias)))
        ffn = self.ffn_output(self.act(self.intermediate(x)))
        return self.ffn_norm(x + self.ffn_dropout(ffn))


class BertModel(nn.Module):
    """BERT encoder. ``forward(input_ids, attention_mask)`` returns
    ``(last_hidden_state, pooled_output)`` of shapes (batch, seq, hidden) and (batch, hidden).
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.layers))
        self.pooler = nn.Linear(config.hidden, config.hidden)
        self.pooler_act = nn.Tanh()
        self.apply(init_transformer_weights)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embeddings(input_ids)
        # (batch, seq) 1/0 mask → (batch, 1, 1, seq) additive bias, broadcast over heads/queries
        keep = attention_mask[:, None, None, :].to(x.dtype)
        mask_bias = (1.0 - keep) * MASK_VALUE
        for layer in self.layers:
            x = layer(x, mask_bias)
        pooled = self.pooler_act(self.pooler(x[:, 0]))
        return x, pooled


def build(
    *, config: str = "tiny", batch: int = 2, seq: int = 16, layers: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A BERT encoder and (input_ids, attention_mask), both (batch, seq).

    ``layers`` > 0 overrides the config's number of layers. The last sequence of the batch
    is padded (its final quarter masked out) when batch > 1, so the mask does something.
    """
    cfg = transformer_config(CONFIGS, config, batch=batch, seq=seq, layers=layers)
    model = BertModel(cfg)
    input_ids = torch.randint(0, cfg.vocab_size, (batch, seq), dtype=torch.int64)
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    if batch > 1:
        attention_mask[-1, seq - seq // 4 :] = 0
    return model, (input_ids, attention_mask)
