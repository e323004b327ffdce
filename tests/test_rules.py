"""The pattern language and the rule engine: what matches, and what the engine refuses for
every rule (fxopt.ir.pattern, fxopt.passes.rules), on both capture levels and on Circle."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import fx

from fxopt.api import GraphOptimizer
from fxopt.capture import trace
from fxopt.ir import ops
from fxopt.ir.pattern import ABSENT, Op, Var, find
from fxopt.ir.views import FxView
from fxopt.passes import PassManager
from fxopt.passes.rules import Rewire, Rule, RulePass

MODES = ("fx", "export")
EXAMPLE = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "06_write_a_rule.py"))


def _nodes(gm: fx.GraphModule, name: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if ops.is_compute(n) and ops.info(n, gm).name == name]


def _matches(fn, pattern, root_op: str, *shapes):
    gm = trace(_fn(fn, len(shapes)), tuple(torch.randn(s) for s in shapes), "fx")
    view = FxView(gm)
    return [m for root in _nodes(gm, root_op) for m in find(view, pattern, root)]


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Fn2(_Fn):
    def forward(self, x, y):
        return self.fn(x, y)


def _fn(fn, arity: int = 1) -> torch.nn.Module:
    return (_Fn if arity == 1 else _Fn2)(fn)


# --- the pattern language -------------------------------------------------------------------


def test_a_literal_matches_a_number_of_either_type_but_never_a_bool():
    pattern = Op("mul", input=Var("x"), other=1)
    assert len(_matches(lambda x: x * 1.0, pattern, "mul", (2,))) == 1
    assert len(_matches(lambda x: x * 1, pattern, "mul", (2,))) == 1
    assert _matches(lambda x: x * True, pattern, "mul", (2,)) == []
    assert _matches(lambda x: x * 2, pattern, "mul", (2,)) == []


def test_a_named_variable_binds_the_same_value_everywhere():
    square = Op("mul", input=Var("x"), other=Var("x"))
    assert len(_matches(lambda x: x * x, square, "mul", (2,))) == 1
    assert _matches(lambda x, y: x * y, square, "mul", (2,), (2,)) == []


def test_commutative_operands_swap_and_alternatives_are_tried_in_order():
    pattern = Op(
        "add",
        input=Op(("mul", "div"), input=Var("x"), other=2, bind="scaled"),
        other=Var("y"),
        commutative=True,
    )
    found = _matches(lambda a, b: b + a / 2, pattern, "add", (2,), (2,))
    # add(y, x / 2): the pattern's operands match swapped
    assert len(found) == 1 and found[0]["x"].name == "x" and found[0]["y"].name == "y"
    assert ops.info(found[0]["scaled"]).name == "div"


def test_an_optional_node_matches_with_and_without_it():
    pattern = Op("relu", input=Op("clone", input=Var("x"), optional="input"))
    with_clone = _matches(lambda x: x.clone().relu(), pattern, "relu", (2,))
    without = _matches(lambda x: x.relu(), pattern, "relu", (2,))
    assert [len(m.nodes) for m in with_clone] == [2, 1]  # the clone first, then through it
    assert [m["x"].name for m in without] == ["x"]


def test_absent_matches_an_operand_not_given_and_a_default():
    pattern = Op("add", input=Var("x"), other=Var("y"), alpha=ABSENT | 1)
    assert len(_matches(lambda x, y: x + y, pattern, "add", (2,), (2,))) == 1
    assert _matches(lambda x, y: torch.add(x, y, alpha=2), pattern, "add", (2,), (2,)) == []


# --- the engine: what it refuses for every rule -------------------------------------------


class _DoubleNegation(Rule):
    name, stat = "-(-x) → x", "removed"
    pattern = Op("neg", input=Op("neg", input=Var("x"), bind="inner"))

    def replace_with(self, match):
        return match["x"]


class _Negations(RulePass):
    name = "negations"
    counters = ("removed",)
    rules = (_DoubleNegation(),)


def _run(fn, mode, *inputs):
    gm = trace(_Fn(fn), inputs, mode)
    result = PassManager([_Negations()]).run(gm)
    return result.module, result.records[0]


@pytest.mark.parametrize("mode", MODES)
def test_a_match_is_replaced_and_its_inner_nodes_erased(mode):
    fn = lambda x: -(x.neg()) + 1  # noqa: E731
    gm, record = _run(fn, mode, torch.randn(3))
    assert record.stats == {"removed": 1} and _nodes(gm, "neg") == []
    other = torch.tensor([-0.0, float("nan"), float("-inf"), 2.5])  # other values, shape
    torch.testing.assert_close(gm(other), fn(other), equal_nan=True)


@pytest.mark.parametrize("mode", MODES)
def test_an_inner_node_read_outside_the_match_is_refused_with_the_reason(mode):
    def fn(x):
        inner = -x
        return -inner, inner * 2

    gm, record = _run(fn, mode, torch.randn(3))
    assert record.stats == {"removed": 0} and len(_nodes(gm, "neg")) == 2
    assert "inside the match is also read by" in record.skipped[0].reason


@pytest.mark.parametrize("mode", MODES)
def test_an_inner_node_that_is_returned_is_refused(mode):
    def fn(x):
        inner = -x
        return -inner, inner

    _, record = _run(fn, mode, torch.randn(3))
    assert not record.changed and "inside the match is returned" in record.skipped[0].reason


@pytest.mark.parametrize("mode", MODES)
def test_a_value_written_in_place_inside_the_match_is_refused(mode):
    def fn(x):
        y = x * 1.5
        inner = -y
        y.add_(1)  # -inner reads the old y through inner; x would be read after the write
        return -inner

    x = torch.randn(3)
    gm, record = _run(fn, mode, x)
    if mode == "fx":
        assert not record.changed, record.skipped
        assert "written in place" in record.skipped[0].reason
    else:  # export functionalizes the write: -inner reads the value before it, rewritten
        assert record.changed
    torch.testing.assert_close(gm(x + 1), fn(x + 1))


def test_an_in_place_node_in_the_match_is_refused():
    def fn(x):
        return (-x).neg_()

    _, record = _run(fn, "fx", torch.randn(3))
    assert not record.changed and "writes into its input" in record.skipped[0].reason


def test_a_chain_collapses_in_one_analysis_through_planned_rewires():
    class Outer(Rule):
        name = "view of a view"
        keeps_inputs = True
        pattern = Op("view", input=Op("view", input=Var("x")))

        def replace_with(self, match):
            return Rewire({"input": match["x"]})

    class Views(RulePass):
        name, rules = "views", (Outer(),)

    x = torch.randn(2, 3, 4)
    gm = trace(_Fn(lambda x: x.view(6, 4).view(24).view(4, 6).view(2, 12)), (x,), "fx")
    result = PassManager([Views()]).run(gm)
    views = _nodes(result.module, "view")
    assert len(views) == 1 and ops.args(views[0])["input"].op == "placeholder"
    assert result.records[0].stats == {"view of a view": 3}
    torch.testing.assert_close(result.module(x * 3), (x * 3).view(2, 12))


def test_verify_finds_matches_left():
    gm = trace(_Fn(lambda x: -(x.neg()) + 1), (torch.randn(2),), "fx")
    with pytest.raises(AssertionError, match="matches left after negations"):
        _Negations().verify(gm)


def test_a_replacement_that_returns_the_callers_input_is_refused():
    _, record = _run(lambda x: -(x.neg()), "fx", torch.randn(2))
    assert not record.changed
    assert "would share storage with an input" in record.skipped[0].reason


# --- the example rule of docs/writing_a_pass.md ---------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_example_three_node_rule(mode):
    class Block(torch.nn.Module):
        def forward(self, x):
            kept = x.transpose(0, 2).tanh().transpose(2, 0)  # rewritten
            other = x.transpose(0, 1).relu().transpose(1, 2)  # does not cancel
            return kept, other

    x = torch.randn(2, 3, 4)
    optimizer = GraphOptimizer(Block(), x, mode=mode)
    gm = optimizer.optimize(passes=[EXAMPLE["CancelTransposes"](), "dce"])
    record = optimizer.pipeline.records[0]
    assert record.stats == {"cancelled": 1}
    assert [s.reason for s in record.skipped] == ["the transposes do not cancel"]
    other = torch.randn(2, 3, 4) * 100
    for got, want in zip(gm(other), Block()(other)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- Circle graphs through the same engine ---------------------------------------------------


def test_a_circle_rule_sees_slots_and_refuses_a_tensor_read_twice():
    from fxopt.circle.graph import CircleGraph
    from fxopt.circle.passes.view import CircleRulePass

    class NegNeg(Rule):
        name = "NEG of a NEG"
        pattern = Op("NEG", Op("NEG", Var("x")))

        def replace_with(self, match):
            return match["x"]

    class Pass(CircleRulePass):
        name, rules = "neg-neg", (NegNeg(),)

    def graph(read_twice: bool) -> CircleGraph:
        g = CircleGraph()
        x, a, b = (g.add_tensor(n, (2,), np.float32) for n in "xab")
        g.add_op("NEG", [x], [a])
        g.add_op("NEG", [a], [b])
        g.inputs, g.outputs = [x], [b, a] if read_twice else [b]
        return g

    g = graph(read_twice=False)
    r = g.add_tensor("r", (2,), np.float32)
    g.add_op("RELU", [g.outputs[0]], [r])
    g.outputs = [r]
    assert Pass()(g).stats == {"NEG of a NEG": 1}
    assert [(op.code, op.inputs) for op in g.operators] == [("RELU", [0])]
    g = graph(read_twice=True)
    result = Pass()(g)
    assert not result.changed and "inside the match is returned" in result.skipped[0].reason
