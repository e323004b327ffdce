"""Analyses shared across a pipeline run (fxopt.ir.shared) never go stale."""

from __future__ import annotations

import operator

import pytest
import torch
from hypothesis import given, settings
from torch import fx

from fxopt.ir import ops, shared
from fxopt.ir.alias import AliasAnalysis
from fxopt.passes import Pass, PassManager, PassResult, Plan
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.passes.dce import DeadCodeElimination
from tests.passes_helpers import assert_kept_analysis_sound, random_graphs


def _twice_plus_one() -> fx.GraphModule:
    def f(x):
        return x + 1, x + 1

    return fx.symbolic_trace(f)


def test_outside_a_scope_every_call_computes_afresh():
    gm = _twice_plus_one()
    assert AliasAnalysis.of(gm) is not AliasAnalysis.of(gm)


def test_inside_a_scope_the_analysis_is_shared_until_invalidated():
    gm = _twice_plus_one()
    with shared.scope(gm.graph):
        first = AliasAnalysis.of(gm)
        assert AliasAnalysis.of(gm) is first
        shared.invalidate(gm.graph)
        assert AliasAnalysis.of(gm) is not first
    assert shared.memo(gm.graph, "ops.info") is None  # nothing outlives the scope


def test_remembered_op_info_follows_a_changed_target():
    gm = _twice_plus_one()
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    with shared.scope(gm.graph):
        assert AliasAnalysis.of(gm).info[add].name == "add"
        add.target = operator.mul  # same args objects: only the target tells
        shared.invalidate(gm.graph)
        assert AliasAnalysis.of(gm).info[add].name == "mul"


def test_remembered_op_info_follows_changed_arguments():
    def f(x):
        return torch.nn.functional.relu(x)

    gm = fx.symbolic_trace(f)
    relu = next(n for n in gm.graph.nodes if ops.is_compute(n))
    with shared.scope(gm.graph):
        assert not AliasAnalysis.of(gm).info[relu].inplace
        relu.kwargs = {"inplace": True}
        shared.invalidate(gm.graph)
        assert AliasAnalysis.of(gm).info[relu].inplace


class _WriteBetween(Pass[Plan]):
    """Inserts ``x.mul_(2)`` between the two ``x + 1``: they are no longer the same value."""

    name = "write-between"
    description = "test pass"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        second_add = [n for n in gm.graph.nodes if n.target is operator.add][1]
        with gm.graph.inserting_before(second_add):
            gm.graph.call_method("mul_", (x, 2))
        return PassResult(changed=True)


def test_a_pass_that_changes_the_graph_makes_the_next_pass_see_the_change():
    gm = _twice_plus_one()
    x = torch.randn(4)
    expected = _twice_plus_one()(x.clone())
    # dce builds and shares the alias analysis and changes nothing; then the write; then
    # cse, which with a stale analysis would merge the two adds across the new mul_.
    result = PassManager(["dce", _WriteBetween(), "cse"], max_rounds=1).run(gm)
    adds = [n for n in result.module.graph.nodes if n.target is operator.add]
    assert len(adds) == 2
    out = result.module(x.clone())
    assert torch.equal(out[0], expected[0])
    assert not torch.equal(out[1], expected[1])  # the second add now sees x * 2


def test_dce_and_cse_keep_the_alias_analysis_sound():
    def f(x):
        a = x + 1
        b = x + 1
        _unused = torch.sigmoid(x)
        a.view(-1).mul_(2)  # a's storage is written: a and b must not merge
        return a, b

    gm = fx.symbolic_trace(f)
    with shared.scope(gm.graph):
        before = AliasAnalysis.of(gm)
        assert DeadCodeElimination()(gm).changed  # sigmoid goes
        kept = AliasAnalysis.of(gm)
        assert kept is before
        # Still sound for what remains: the write through the view is still seen.
        add = next(n for n in gm.graph.nodes if n.name == "add")
        assert kept.is_written(add)
        assert not CommonSubexpressionElimination()(gm).changed
    g2 = fx.symbolic_trace(lambda x: (x + 1).relu() * (x + 1).relu())
    with shared.scope(g2.graph):
        before = AliasAnalysis.of(g2)
        assert CommonSubexpressionElimination()(g2).changed
        assert AliasAnalysis.of(g2) is before  # followed the merges instead of a rebuild
        assert_kept_analysis_sound(before, g2, exact=True)


@settings(max_examples=150, deadline=None)
@given(random_graphs())
def test_analysis_kept_by_cse_then_dce_matches_a_fresh_one(gm):
    with shared.scope(gm.graph):
        kept = AliasAnalysis.of(gm)
        if CommonSubexpressionElimination()(gm).changed:
            assert AliasAnalysis.of(gm) is kept
        assert_kept_analysis_sound(kept, gm, exact=True)
        DeadCodeElimination()(gm)
        assert AliasAnalysis.of(gm) is kept
        assert_kept_analysis_sound(kept, gm, exact=False)


def test_cse_keeps_the_views_of_a_merged_duplicate_in_its_class():
    def f(x):
        a = x + 1
        v = (x + 1).view(-1)  # after cse, v views a
        return a * 2, v  # (returning a itself too would keep the two apart: see cse)

    gm = fx.symbolic_trace(f)
    with shared.scope(gm.graph):
        kept = AliasAnalysis.of(gm)
        assert CommonSubexpressionElimination()(gm).changed
        assert_kept_analysis_sound(kept, gm, exact=True)
        add, view, _ = (n for n in gm.graph.nodes if ops.is_compute(n))
        assert kept.storage_class(view) is kept.storage_class(add)


def test_merging_a_written_class_joins_the_writes():
    # y.relu_() writes b's storage; replace(b, a) as a pass that proved b == a would.
    def f(x):
        a = x * 2
        b = x * 2
        b.relu_()
        return a, b

    gm = fx.symbolic_trace(f)
    a, b = (n for n in gm.graph.nodes if n.target is operator.mul)
    alias = AliasAnalysis(gm)
    assert alias.is_written(b) and not alias.is_written(a)
    b.replace_all_uses_with(a)
    gm.graph.erase_node(b)
    alias.replace(b, a)
    assert alias.is_written(a)
    assert_kept_analysis_sound(alias, gm, exact=True)


def test_replace_refuses_graph_inputs():
    gm = _twice_plus_one()
    x = next(iter(gm.graph.nodes))
    add = next(n for n in gm.graph.nodes if n.target is operator.add)
    with pytest.raises(ValueError, match="two call nodes"):
        AliasAnalysis(gm).replace(add, x)
