"""gqa-attention: repeat_kv before SDPA → SDPA's enable_gqa; and the no-ops a decode step
carries (whole-dim slices, a cat onto an empty cache layer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxopt
from fxopt import zoo
from fxopt.capture import plain_graph_module, trace
from fxopt.passes import PassManager
from fxopt.passes.gqa_attention import GqaAttention
from fxopt.passes.remove_nops import RemoveNops

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """transformers' repeat_kv."""
    batch, heads, length, dim = x.shape
    x = x[:, :, None, :, :].expand(batch, heads, groups, length, dim)
    return x.reshape(batch, heads * groups, length, dim)


class GroupedAttention(nn.Module):
    """Attention with 2 key/value heads for 8 query heads, a mask and a scale."""

    def __init__(self, groups: int = 4, value_groups: int | None = None, dropout: float = 0.0):
        super().__init__()
        self.groups, self.value_groups = groups, value_groups or groups
        self.dropout = dropout

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(
            q,
            _repeat(k, self.groups),
            _repeat(v, self.value_groups),
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            scale=0.3,
        )


def _inputs(batch: int, length: int, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 8, 1, 16, generator=generator)
    k, v = (torch.randn(batch, 2, length, 16, generator=generator) for _ in range(2))
    mask = torch.rand(batch, 1, 1, length, generator=generator) > 0.3
    return q, k, v, mask


def _captured(model: nn.Module, inputs: tuple, mode: str):
    """fx, or torch.export's own ops (what fxopt keeps for transformers' decoders, whose
    core-ATen decomposition fails; the decomposition turns SDPA into its math)."""
    if mode == "fx":
        return trace(model, inputs, mode="fx")
    return plain_graph_module(torch.export.export(model, inputs).module())


def _grouped(model: nn.Module, inputs: tuple, mode: str):
    result = PassManager([RemoveNops(), GqaAttention()]).run(_captured(model, inputs, mode))
    return result.module, result.records[-1]


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_repeated_heads_become_enable_gqa_bit_for_bit(mode):
    model, inputs = GroupedAttention().eval(), _inputs(2, 7)
    grouped, record = _grouped(model, inputs, mode)
    assert record.stats["grouped"] == 1
    code = grouped.code
    assert "expand" not in code and "enable_gqa = True" in code
    # The same kernel on the same numbers: every bit, NaN where eager has it, on another
    # input too (fx graphs take any shape; export's are the example's).
    other = _inputs(3, 11, seed=1) if mode == "fx" else _inputs(2, 7, seed=1)
    other[1][0, 1, 3, 5] = float("nan")
    other[2][1, 0, 2, 0] = float("inf")
    for x in (inputs, other):
        with torch.no_grad():
            torch.testing.assert_close(grouped(*x), model(*x), rtol=0, atol=0, equal_nan=True)


def test_gradients_flow_through_the_grouped_form():
    model, inputs = GroupedAttention().eval(), _inputs(2, 7)
    grouped, _ = _grouped(model, inputs, "fx")
    leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    twins = [t.clone().requires_grad_() for t in inputs[:3]]
    model(*leaves, inputs[3]).sum().backward()
    grouped(*twins, inputs[3]).sum().backward()
    for a, b in zip(leaves, twins):  # the group's sum runs in another order
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)


def test_attention_with_dropout_is_left_alone():
    # Its random draws are the repeated form's; not re-derived here.
    model, inputs = GroupedAttention(dropout=0.5).train(), _inputs(2, 5)
    _, record = _grouped(model, inputs, "fx")
    assert record.stats["grouped"] == 0


def test_query_heads_other_than_kv_times_repeats_are_left_alone():
    # One query head broadcast against 8 repeated key heads: enable_gqa would not do that.
    model, inputs = GroupedAttention(), _inputs(2, 5)
    inputs = (torch.randn(2, 1, 1, 16), *inputs[1:])
    grouped, record = _grouped(model, inputs, "fx")
    assert record.stats["grouped"] == 0
    assert any("query heads" in s.reason for s in record.skipped)
    with torch.no_grad():
        torch.testing.assert_close(grouped(*inputs), model(*inputs), rtol=0, atol=0)


class ReturnsRepeated(nn.Module):
    """The repeated keys are also returned: folding would drop a value the caller gets."""

    def forward(self, q, k, v, mask):
        keys = _repeat(k, 4)
        return F.scaled_dot_product_attention(q, keys, _repeat(v, 4), attn_mask=mask), keys


def test_a_repeated_key_read_elsewhere_keeps_the_repeat():
    model, inputs = ReturnsRepeated(), _inputs(2, 5)
    grouped, record = _grouped(model, inputs, "fx")
    assert record.stats["grouped"] == 0 and record.skipped
    with torch.no_grad():
        for got, want in zip(grouped(*inputs), model(*inputs)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class GrowsEmptyLayer(nn.Module):
    """A DynamicCache layer: an empty tensor, the given cache concatenated onto it, the new
    token after; and ``x[:, :, None]``'s whole-dim slices at the ATen level."""

    def __init__(self):
        super().__init__()
        self.register_buffer("empty", torch.tensor([]))

    def forward(self, cache, new):
        keys = torch.cat([self.empty, cache], dim=-2)
        keys = torch.cat([keys, new], dim=-2)
        return keys[:, 0:] * 2


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_cat_onto_an_empty_tensor_and_whole_slices_go(mode):
    model = GrowsEmptyLayer()
    inputs = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 1, 4))
    gm = trace(model, inputs, mode=mode, dynamic="all" if mode == "export" else None)
    result = PassManager([RemoveNops()]).run(gm)
    rewritten = result.module
    cats = [n for n in rewritten.graph.nodes if "cat" in str(n.target)]
    assert len(cats) == 1, rewritten.code
    assert result.records[0].stats["removed"] >= (2 if mode == "export" else 1)
    for x in (inputs, (torch.randn(3, 2, 9, 4), torch.randn(3, 2, 1, 4))):
        with torch.no_grad():
            torch.testing.assert_close(rewritten(*x), model(*x), rtol=0, atol=0)


class ReturnsCopy(nn.Module):
    """cat([empty, x]) returned: a copy the caller owns, never the input itself."""

    def __init__(self):
        super().__init__()
        self.register_buffer("empty", torch.tensor([]))

    def forward(self, x):
        return torch.cat([self.empty, x])


def test_a_returned_copy_of_an_input_is_kept():
    model, x = ReturnsCopy(), torch.randn(3, 4)
    result = PassManager([RemoveNops()]).run(trace(model, (x,)))
    out = result.module(x)
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(out, x, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_the_zoo_decode_step_reads_the_unrepeated_cache(mode):
    step = zoo.create("llama", step="decode", batch=2, seq=4, cache=8)
    model, inputs = step.model, step.example_inputs
    result = fxopt.optimize(model, inputs, mode=mode, autotune=False)
    grouped = [r for r in result.report["passes"] if r["name"] == "gqa-attention"]
    layers = model.decoder.config.layers
    if mode == "fx":  # (export's core-ATen graph spells SDPA as its math: nothing to fold)
        assert sum(r["stats"].get("grouped", 0) for r in grouped) == layers
    assert result.report["verified"]
    other = list(inputs)
    other[0] = torch.randint(0, model.decoder.config.vocab_size, inputs[0].shape)
    other[1] = torch.tensor([5, 2])
    # fx: the same kernels, every bit; export: ATen's math for SDPA rounds differently.
    exact = {"rtol": 0, "atol": 0} if mode == "fx" else {}
    with torch.no_grad():
        torch.testing.assert_close(result.module(*other), model(*other), **exact)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_under_autocast_the_grouped_form_gives_eagers_answer(mode):
    # Autocast casts q, k and v to bfloat16 before attention either way; repeating a
    # head copies it exactly, so grouping changes no value, in bfloat16 too.
    model, inputs = GroupedAttention().eval(), _inputs(2, 7)
    with torch.autocast("cpu", torch.bfloat16):
        result = fxopt.optimize(model, inputs, mode=mode, benchmark_runs=0, autotune=False)
        grouped = [
            r["stats"]["grouped"] for r in result.report["passes"] if r["name"] == "gqa-attention"
        ]
        assert sum(grouped) == 1
        with torch.no_grad():
            got, want = result.module(*inputs), model(*inputs)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)
