"""bmm-to-matmul: torch.export's expand → view → bmm → view chains back to one matmul."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxopt.capture import trace
from fxopt.passes import PassManager
from fxopt.passes.bmm_to_matmul import BmmToMatmul

_MATMUL = torch.ops.aten.matmul.default
_BMM = torch.ops.aten.bmm.default


def _run(model: nn.Module, inputs: tuple, mode: str = "export", dynamic="batch"):
    gm = trace(model.eval(), inputs, mode=mode, dynamic=dynamic)
    result = PassManager([BmmToMatmul()]).run(gm)
    return result.module, result.records[0]


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same(model, rewritten, *inputs):
    with torch.no_grad():
        torch.testing.assert_close(rewritten(*inputs), model(*inputs), rtol=0, atol=0)


class Scores(nn.Module):
    """softmax(q kᵀ) v on (batch, heads, tokens, dim): two 4-D matmuls."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v


def _qkv(batch: int, tokens: int = 5):
    return tuple(torch.randn(batch, 2, tokens, 4) for _ in range(3))


def test_both_4d_matmuls_become_matmul_and_compute_the_same_bits():
    model, inputs = Scores(), _qkv(2)
    rewritten, record = _run(model, inputs)
    assert record.stats["folded"] == 2
    assert _BMM not in _targets(rewritten) and _targets(rewritten).count(_MATMUL) == 2
    # The same bmm kernel on the same numbers: equal to the last bit, at another batch too.
    _same(model, rewritten, *inputs)
    _same(model, rewritten, *_qkv(3))


def test_module_level_graphs_have_no_bmm_chains_and_stay_unchanged():
    model, inputs = Scores(), _qkv(2)
    rewritten, record = _run(model, inputs, mode="fx")
    assert not record.changed
    _same(model, rewritten, *_qkv(4))


class ExplicitBmm(nn.Module):
    """The chain written by hand at the module level: folded there too."""

    def __init__(self, broadcast: bool = False, other_view: bool = False):
        super().__init__()
        self.broadcast, self.other_view = broadcast, other_view

    def forward(self, a, b):
        batch, heads, m, k = a.shape
        n = b.shape[-1]
        left = a.expand(batch, heads, m, k).reshape(batch * heads, m, k)
        if self.broadcast:
            b = b[:, :1]  # one head, broadcast to all by the expand
        right = b.expand(batch, heads, k, n).reshape(batch * heads, k, n)
        out = torch.bmm(left, right)
        if self.other_view:
            return out.reshape(batch, heads * m, n)
        return out.reshape(batch, heads, m, n)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_hand_written_chain_is_folded_at_both_levels(mode):
    model = ExplicitBmm()
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    rewritten, record = _run(model, (a, b), mode=mode)
    assert record.changed, record.skipped
    _same(model, rewritten, a, b)
    _same(model, rewritten, torch.randn(4, 3, 4, 5), torch.randn(4, 3, 5, 6))


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("broadcast", "broadcasts"),
        ("other_view", "does not split (batch, heads) back"),
    ],
)
def test_near_misses_stay_and_say_why(kind, reason):
    model = ExplicitBmm(**{kind: True})
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    rewritten, record = _run(model, (a, b))
    assert not record.changed
    assert any(reason in s.reason for s in record.skipped), record.skipped
    _same(model, rewritten, a, b)


class WritesBetween(nn.Module):
    """The left operand is written in place after the chain copied it, before the bmm."""

    def forward(self, a, b):
        batch, heads, m, k = a.shape
        left = a.expand(batch, heads, m, k).clone().view(batch * heads, m, k)
        right = b.expand(batch, heads, k, b.shape[-1]).reshape(batch * heads, k, b.shape[-1])
        a.mul_(2)  # the chain copied a before this write: a matmul at the end would not
        out = torch.bmm(left, right).view(batch, heads, m, b.shape[-1])
        return out, a


def test_an_operand_written_in_place_inside_the_chain_is_left_alone():
    model = WritesBetween()
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    rewritten, record = _run(model, (a.clone(), b), mode="fx")
    assert not record.changed
    assert any("written in place" in s.reason for s in record.skipped), record.skipped
    with torch.no_grad():
        expected = model(a.clone(), b)
        actual = rewritten(a.clone(), b)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


class SharedScores(nn.Module):
    """The bmm result read twice: through the view and directly."""

    def forward(self, a, b):
        batch, heads, m, k = a.shape
        n = b.shape[-1]
        out = torch.bmm(
            a.expand(batch, heads, m, k).reshape(batch * heads, m, k),
            b.expand(batch, heads, k, n).reshape(batch * heads, k, n),
        )
        return out.reshape(batch, heads, m, n), out.sum()


def test_a_bmm_read_other_than_through_its_view_is_left_alone():
    model = SharedScores()
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 5, 6)
    rewritten, record = _run(model, (a, b), mode="fx")
    assert not record.changed
    assert any("inside the match is also read by" in s.reason for s in record.skipped), (
        record.skipped
    )
    _same(model, rewritten, a, b)
