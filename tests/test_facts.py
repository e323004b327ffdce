"""fxopt.ir.facts: what holds for every input the contract allows, and nothing more."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.capture import trace
from fxopt.ir import facts, ops


def nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


class Shapes(nn.Module):
    def forward(self, x):
        same = x.reshape(-1, 8)  # [s0, 8]: the same shape for every s0
        other = x.new_zeros(4, 8)  # [4, 8]: equal to x's only when s0 = 4
        return same, other


def test_same_shape_is_a_proof_over_dynamic_dims_not_a_fact_of_the_example():
    gm = trace(Shapes(), torch.randn(4, 8), "fx", dynamic="batch")
    found = nodes(gm)
    x, same, other = found["x"], found["reshape"], found["new_zeros"]
    assert facts.same_shape(x, same)
    assert not facts.same_shape(x, other)  # true for the example (4, 8), not for s0 = 3
    static = nodes(trace(Shapes(), torch.randn(4, 8), "fx"))
    assert facts.same_shape(static["x"], static["new_zeros"])  # with s0 fixed to 4 it is


def test_code_that_needs_the_example_batch_makes_it_static():
    class FixedBatch(nn.Module):
        def forward(self, x):
            return x.reshape(4, 8) + 1

    gm = trace(FixedBatch(), torch.randn(4, 8), "fx", dynamic="batch")
    found = nodes(gm)
    assert facts.same_shape(found["x"], found["reshape"])  # s0 = 4 is now part of the graph
    from fxopt.ir import contract, shapes

    values = shapes.placeholder_values(gm, (torch.randn(4, 8),))
    assert contract.build(gm, values).describe() == "x: float32[4, 8] on cpu"


def test_asking_adds_no_guard():
    gm = trace(Shapes(), torch.randn(4, 8), "fx", dynamic="batch")
    from fxopt.ir.contract import shape_env_of

    env = shape_env_of(gm)
    before = len(env.guards)
    found = nodes(gm)
    facts.same_shape(found["x"], found["new_zeros"])
    facts.is_contiguous(found["new_zeros"])
    assert len(env.guards) == before


class Layouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        t = x.t()
        return t, x + 0, x.expand(2, 8, 8), x @ self.w


def test_layout_facts_read_the_strides():
    gm = trace(Layouts(), torch.randn(8, 8), "fx")
    found = nodes(gm)
    assert facts.is_contiguous(found["x"])
    assert not facts.is_contiguous(found["t"])
    assert facts.same_strides(found["add"], found["x"])
    assert not facts.same_strides(found["expand"], found["x"])


def test_only_values_that_follow_an_input_layout_pin_it():
    gm = trace(Layouts(), torch.randn(8, 8), "fx")
    found = nodes(gm)
    assert facts.follows_input_layout(gm, found["add"])
    assert not facts.follows_input_layout(gm, found["matmul"])
    assert not facts.follows_input_layout(gm, found["w"])
    facts.rely_on_layout(gm, found["matmul"])
    assert facts.pinned_inputs(gm) == frozenset()
    facts.rely_on_layout(gm, found["add"])
    assert facts.pinned_inputs(gm) == {"x"}  # the input whose layout x + 0 follows
    facts.pin_every_input(gm)
    assert facts.pinned_inputs(gm) is True


# The table entries of ops.CONTIGUOUS_RESULT, each run on inputs in odd layouts: its result
# must be contiguous whatever the layout of what it reads. (rank of the odd input, op)
CONTIGUOUS_CASES = {
    "linear": (4, lambda a: F.linear(a, torch.randn(5, a.shape[-1]))),
    "mm": (2, lambda a: a.mm(torch.randn(a.shape[-1], 3))),
    "addmm": (2, lambda a: torch.addmm(torch.randn(3), a, torch.randn(a.shape[-1], 3))),
    "bmm": (3, lambda a: torch.bmm(a, torch.randn(a.shape[0], a.shape[-1], 2))),
    "baddbmm": (
        3,
        lambda a: torch.baddbmm(torch.randn(1, 1, 2), a, torch.randn(a.shape[0], a.shape[-1], 2)),
    ),
    "matmul": (4, lambda a: a @ torch.randn(a.shape[-1], 3)),
    "embedding": (2, lambda a: F.embedding(torch.tensor([0, 2, 1]), a)),
    "contiguous": (4, lambda a: a.contiguous()),
}


def _odd_layouts(rank: int):
    shape = (2, 3, 6, 4)[-rank:]
    base = torch.randn(shape)
    yield base.transpose(-1, -2).contiguous().transpose(-1, -2)  # last two dims swapped
    if rank == 4:
        yield base.contiguous(memory_format=torch.channels_last)
    yield torch.randn(*shape[:-1], shape[-1] * 2)[..., ::2]  # every other element


@pytest.mark.parametrize("name", sorted(CONTIGUOUS_CASES))
def test_contiguous_result_table_holds_for_odd_input_layouts(name):
    assert name in ops.CONTIGUOUS_RESULT
    rank, op = CONTIGUOUS_CASES[name]
    for odd in _odd_layouts(rank):
        assert not odd.is_contiguous()
        assert op(odd).is_contiguous(), (name, odd.stride())


def test_every_table_entry_is_checked():
    # arange reads no tensor: there is no input layout to follow.
    assert set(CONTIGUOUS_CASES) | {"arange"} == set(ops.CONTIGUOUS_RESULT)
