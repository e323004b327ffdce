"""Tests of the remove-nops pass, on both capture levels.

Every case below is one branch of a single model (:class:`Cases`), so each capture level is
captured once per table: a ``torch.export`` capture costs about a second, and thirty of them
would blow the test budget. A case is judged on its own *cone*: the nodes its outputs depend
on. Cases use disjoint nodes (only the placeholders are shared), so a case's op counts, skip
reasons and outputs are its own.

Where ``torch.export`` spells a construct differently the expectation says so: ``.contiguous()``
on a contiguous value, ``.to(same dtype)`` and ``nn.Identity`` vanish at capture; eval-mode
dropout becomes ``aten.clone``; ``transpose``/``t`` become ``permute``; ``reshape`` becomes
``view``; in-place ops are functionalized, so a ``clone`` no longer protects anything.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt import GraphOptimizer
from fxopt.capture import propagate_shapes, trace
from fxopt.ir import ops
from fxopt.passes import PassManager, PassRecord
from fxopt.passes.remove_nops import RemoveNops
from fxopt.verify import check_outputs, run_seeded
from tests.passes_helpers import MODES, assert_same_effects, names, run_effects

PASS = "remove-nops"


@dataclass(frozen=True)
class Case:
    """One construct: ``fn(model, f, f3, i, one)`` and, for the canonical op it is about,
    the count (before, after) the pass in its cone; ``export`` overrides (op, before, after)
    when the export level spells it otherwise. ``reason``: words of the skip reason."""

    id: str
    fn: Callable
    op: str
    counts: tuple[int, int]
    export: tuple[str, int, int] | None = None
    reason: str | None = None
    export_reason: str | None = None  # defaults to ``reason`` when export keeps the op

    def expected(self, mode: str) -> tuple[str, int, int]:
        if mode == "export" and self.export is not None:
            return self.export
        return (self.op, *self.counts)

    def expected_reason(self, mode: str) -> str | None:
        if mode == "export" and self.export is not None:
            return self.export_reason
        return self.reason


def _clone_then_write(m, f, f3, i, one):
    y = f.clone()
    y.add_(1)
    return f, y


def _times_one_then_write(m, f, f3, i, one):
    z = f * 1
    z.mul_(3)
    return f, z


def _reshapes_through_a_copy(m, f, f3, i, one):
    # f.t() is not contiguous, so reshape(6) copies; reshape(3, 2, 1) is then a view of a
    # contiguous copy and .view(-1) works. Collapsed to f.t().reshape(3, 2, 1) it would be
    # a strided view of f, and .view(-1) would raise.
    c = f.t().reshape(6).reshape(3, 2, 1)
    return c.sigmoid(), c.view(-1)


POSITIVES = (
    Case(
        "nn.Identity",
        lambda m, f, *_: m.identity(f).relu(),
        "identity",
        (1, 0),
        export=("identity", 0, 0),
    ),
    Case(
        "eval nn.Dropout",
        lambda m, f, *_: m.drop_eval(f).relu(),
        "dropout",
        (1, 0),
        export=("clone", 1, 0),
    ),
    Case(
        "training nn.Dropout(p=0)",
        lambda m, f, *_: m.drop_p0(f).relu(),
        "dropout",
        (1, 0),
        export=("clone", 1, 0),
    ),
    Case(
        "F.dropout training=False",
        lambda m, f, *_: F.dropout(f, 0.3, training=False).relu(),
        "dropout",
        (1, 0),
        export=("clone", 1, 0),
    ),
    Case("x * 1", lambda m, f, *_: (f * 1).relu(), "mul", (1, 0)),
    Case("1 * x", lambda m, f, *_: (1 * f).relu(), "mul", (1, 0)),
    Case("x / 1", lambda m, f, *_: (f / 1).relu(), "div", (1, 0)),
    Case("x + -0.0", lambda m, f, *_: (f + -0.0).relu(), "add", (1, 0)),
    Case("x - 0", lambda m, f, *_: (f - 0).relu(), "sub", (1, 0)),
    Case("int + 0", lambda m, f, f3, i, one: (i + 0).neg(), "add", (1, 0)),
    Case(
        ".to(same dtype)",
        lambda m, f, *_: f.to(torch.float32).relu(),
        "to",
        (1, 0),
        export=("to", 0, 0),
    ),
    Case(
        ".float() on float32", lambda m, f, *_: f.float().relu(), "to", (1, 0), export=("to", 0, 0)
    ),
    Case(
        ".contiguous() on contiguous",
        lambda m, f, *_: f.relu().contiguous().sigmoid(),
        "contiguous",
        (1, 0),
        export=("clone", 0, 0),
    ),
    Case("view to same shape", lambda m, f, *_: f.relu().view(2, 3).sigmoid(), "view", (1, 0)),
    Case(
        "reshape to same shape",
        lambda m, f, *_: f.relu().reshape(2, 3).sigmoid(),
        "reshape",
        (1, 0),
        export=("view", 1, 0),
    ),
    Case(
        "reshape(a).reshape(b)",
        lambda m, f, *_: f.relu().reshape(6).reshape(3, 2).sigmoid(),
        "reshape",
        (2, 1),
        export=("view", 2, 1),
    ),
    Case(
        "three reshapes",
        lambda m, f, *_: f.relu().reshape(6).reshape(3, 2).reshape(1, 6).exp(),
        "reshape",
        (3, 1),
        export=("view", 3, 1),
    ),
    Case(
        "permute pair",
        lambda m, f, f3, *_: f3.relu().permute(2, 0, 1).permute(1, 2, 0).exp(),
        "permute",
        (2, 0),
    ),
    Case(
        "transpose(0, 1) twice",
        lambda m, f, *_: f.relu().transpose(0, 1).transpose(0, 1).exp(),
        "transpose",
        (2, 0),
        export=("permute", 2, 0),
    ),
    Case("t().t()", lambda m, f, *_: f.relu().t().t().exp(), "t", (2, 0), export=("permute", 2, 0)),
)

NEGATIVES = (
    Case("training nn.Dropout", lambda m, f, *_: m.drop_train(f), "dropout", (1, 1)),
    Case("F.dropout default training=True", lambda m, f, *_: F.dropout(f, 0.5), "dropout", (1, 1)),
    Case(
        "int * 1.0 promotes",
        lambda m, f, f3, i, one: i * 1.0,
        "mul",
        (1, 1),
        reason="promotes torch.int64 to torch.float32",
    ),
    Case("[1] + zeros(4) broadcasts", lambda m, f, f3, i, one: one + torch.zeros(4), "add", (1, 1)),
    # -0.0 + 0 is +0.0: an identity for every float but -0.0 (fast_math only).
    Case(
        "x + 0 on floats",
        lambda m, f, *_: (f + 0).relu(),
        "add",
        (1, 1),
        reason="not an identity for -0.0",
    ),
    Case(
        "x - -0.0 on floats",
        lambda m, f, *_: (f - -0.0).relu(),
        "sub",
        (1, 1),
        reason="not an identity for -0.0",
    ),
    Case(
        ".contiguous() of a transpose, then view",
        lambda m, f, *_: f.t().contiguous().view(-1),
        "contiguous",
        (1, 1),
        reason="not known to be contiguous",
        export=("clone", 1, 1),
        export_reason="not known to be contiguous",
    ),
    # export functionalizes y.add_(1) into y' = add(y, 1): the clone protects nothing there.
    Case(
        "clone, then written in place",
        _clone_then_write,
        "clone",
        (1, 1),
        reason="written in place",
        export=("clone", 1, 0),
    ),
    Case(
        "x * 1, then written in place",
        _times_one_then_write,
        "mul",
        (2, 2),
        reason="written in place",
        export=("mul", 2, 1),
    ),
    Case(".to(float64) on float32", lambda m, f, *_: f.to(torch.float64), "to", (1, 1)),
    Case(
        "permutes that don't cancel",
        lambda m, f, f3, *_: f3.permute(2, 0, 1).permute(2, 0, 1).exp(),
        "permute",
        (2, 2),
    ),
    Case(
        "view chain through a non-contiguous value",
        lambda m, f, f3, *_: f3.transpose(1, 2).view(2, 2, 2, 3).view(2, 2, 2, 3, 1),
        "view",
        (2, 2),
        reason="not known to be contiguous",
        export=("view", 2, 2),
        export_reason="not known to be contiguous",
    ),
    Case(
        "reshape chain through a copy, then view",
        _reshapes_through_a_copy,
        "reshape",
        (2, 2),
        reason="not known to be contiguous",
        # export: the copy is an explicit clone (kept); the views after it may collapse.
        export=("view", 3, 2),
        export_reason="not known to be contiguous",
    ),
    Case("view(dtype) keeps its shape", lambda m, f, *_: f.view(torch.int32) + 1, "view", (1, 1)),
    Case(
        "view(dtype) then view",
        lambda m, f, *_: f.view(torch.int32).view(6) + 1,
        "view",
        (2, 2),
        reason="reinterprets the dtype",
        export=("view", 2, 2),
        # export puts an alias between the views; it goes, and the chain is seen whole
        export_reason="reinterprets the dtype",
    ),
    Case(
        "clone returned",
        lambda m, f, *_: f.clone(),
        "clone",
        (1, 1),
        reason="returned",
        export=("clone", 1, 1),
        export_reason="returned",
    ),
    Case(
        "x * 1 returned",
        lambda m, f, *_: f * 1,
        "mul",
        (1, 1),
        reason="returned",
        export=("mul", 1, 1),
        export_reason="returned",
    ),
)


class Cases(nn.Module):
    """Runs every case of a table and returns all their outputs, flattened in order."""

    def __init__(self, cases: tuple[Case, ...]):
        super().__init__()
        self.cases = cases
        self.identity = nn.Identity()
        self.drop_eval = nn.Dropout(0.5).eval()
        self.drop_train = nn.Dropout(0.5).train()
        self.drop_p0 = nn.Dropout(0.0).train()

    def forward(self, f, f3, i, one):
        outputs = []
        for case in self.cases:
            result = case.fn(self, f, f3, i, one)
            outputs.extend(result if isinstance(result, tuple) else (result,))
        return tuple(outputs)


def make_inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(2, 3, generator=generator),
        torch.randn(2, 3, 4, generator=generator),
        torch.randint(-5, 5, (2, 3), generator=generator),
        torch.randn(1, generator=generator),
    )


@dataclass
class Run:
    """A table captured once at one level, optimized with remove-nops then dce."""

    model: Cases
    optimizer: GraphOptimizer
    before: fx.GraphModule
    after: fx.GraphModule
    record: PassRecord  # remove-nops' record
    spans: dict[str, slice]  # case id -> its outputs' positions in the flat output


@cache
def optimized(table: str, mode: str) -> Run:
    cases = {"positives": POSITIVES, "negatives": NEGATIVES}[table]
    model = Cases(cases)
    inputs = make_inputs()
    spans, start = {}, 0
    for case in cases:
        result = case.fn(model, *inputs)
        width = len(result) if isinstance(result, tuple) else 1
        spans[case.id] = slice(start, start + width)
        start += width
    # Verified in test_parity: here a broken case must fail on its own, not the whole table.
    optimizer = GraphOptimizer(model, inputs, mode=mode)
    after = optimizer.optimize([PASS, "dce"], verify_result=False)
    record = optimizer.pipeline.records[0]
    return Run(model, optimizer, optimizer.original, after, record, spans)


@cache
def effects(table: str, mode: str) -> tuple:
    """(reference outputs, candidate outputs, inputs after each), one seeded run each."""
    run = optimized(table, mode)
    expected, inputs_after_reference, _ = run_effects(run.model, make_inputs())
    actual, inputs_after_candidate, _ = run_effects(run.after, make_inputs())
    return expected, actual, inputs_after_reference, inputs_after_candidate


def cone(gm: fx.GraphModule, span: slice) -> list[fx.Node]:
    """The compute nodes the outputs at ``span`` depend on, in graph order, including the
    in-place ops that write into them (``z.mul_(3)`` has no users but changes ``z``)."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    seen: set[fx.Node] = set()
    stack = [n for n in output.args[0][span] if isinstance(n, fx.Node)]
    while stack:
        while stack:
            node = stack.pop()
            if node not in seen:
                seen.add(node)
                stack.extend(node.all_input_nodes)
        stack = [
            n
            for n in gm.graph.nodes
            if n not in seen
            and ops.is_compute(n)
            and ops.info(n, gm).inplace
            and any(a in seen for a in n.all_input_nodes)
        ]
    return [n for n in gm.graph.nodes if n in seen and ops.is_compute(n)]


def cone_counts(gm: fx.GraphModule, span: slice) -> Counter:
    return Counter(ops.info(n, gm).name for n in cone(gm, span))


def assert_case(table: str, case: Case, mode: str) -> None:
    run = optimized(table, mode)
    span = run.spans[case.id]
    op, before, after = case.expected(mode)
    assert cone_counts(run.before, span)[op] == before, cone_counts(run.before, span)
    assert cone_counts(run.after, span)[op] == after, cone_counts(run.after, span)
    reason = case.expected_reason(mode)
    cone_names = {n.name for n in cone(run.before, span)}
    reasons = [s.reason for s in run.record.skipped if s.node in cone_names]
    if reason is None:
        assert not reasons, reasons
    else:
        assert any(reason in r for r in reasons), reasons
    # Exact parity of this case's outputs with the eager model, under one seed. (If the
    # rewritten graph cannot run at all, every case of its table fails here.)
    expected, actual, inputs_after_reference, inputs_after_candidate = effects(table, mode)
    torch.testing.assert_close(actual[span], expected[span], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(inputs_after_candidate, inputs_after_reference, rtol=0, atol=0)


# 1. Positive cases -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", POSITIVES, ids=lambda c: c.id)
def test_removes(case: Case, mode: str):
    assert_case("positives", case, mode)


# 2. Near-miss negatives: every guard keeps its op, and the model still runs --------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", NEGATIVES, ids=lambda c: c.id)
def test_keeps(case: Case, mode: str):
    assert_case("negatives", case, mode)


@pytest.mark.parametrize("mode", MODES)
def test_training_dropout_stays_random(mode: str):
    run = optimized("negatives", mode)
    span = run.spans["F.dropout default training=True"]
    inputs = make_inputs()
    first = run_seeded(run.after, inputs, seed=1)[span]
    second = run_seeded(run.after, inputs, seed=2)[span]
    assert not torch.equal(first[0], second[0])


def test_native_dropout_with_its_mask_stays():
    # aten.native_dropout(x, p, train=False) is not random, but returns (output, mask):
    # replacing it by x would turn getitem(·, 0) into x[0]. No capture produces it (export
    # spells inactive dropout as clone), so the graph is built by hand, with ShapeProp
    # metadata as fx capture leaves it.
    graph = fx.Graph()
    x = graph.placeholder("x")
    dropout = graph.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, False))
    output = graph.call_function(operator.getitem, (dropout, 0))
    graph.output((graph.call_function(torch.ops.aten.relu.default, (output,)),))
    gm = fx.GraphModule(nn.Module(), graph)
    inputs = (torch.randn(2, 3),)
    propagate_shapes(gm, inputs)
    result = PassManager([PASS]).run(gm)
    assert not result.records[0].changed
    assert_same_effects(gm, result.module, inputs)


def test_export_functionalizes_the_writes_the_fx_guards_see():
    # What makes removing the export-level clone and x * 1 safe: no in-place op is left.
    run = optimized("negatives", "export")
    for case_id in ("clone, then written in place", "x * 1, then written in place"):
        nodes = cone(run.before, run.spans[case_id])
        assert not [n.name for n in nodes if ops.info(n, run.before).inplace]


# 3. Parity on both levels (check_outputs, random inputs too) ------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("table", ["positives", "negatives"])
def test_parity(table: str, mode: str):
    run = optimized(table, mode)
    result = check_outputs(run.model, run.after, make_inputs(), random_sets=3)
    assert result.ok, result.message
    assert_same_effects(run.model, run.after, make_inputs())
    # GraphOptimizer's own verification (outputs, repeatability) raises VerificationError.
    run.optimizer.optimize([PASS, "dce"])


# 4. Idempotence and 5. an honest changed flag ------------------------------------------------


def changed_code(result, before: fx.GraphModule) -> bool:
    return result.module.code != before.code


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("table", ["positives", "negatives"])
def test_second_run_changes_nothing(table: str, mode: str):
    run = optimized(table, mode)
    once = PassManager([PASS]).run(run.before)  # dead reshapes left behind: no dce
    twice = PassManager([PASS]).run(once.module)
    assert not twice.records[0].changed
    assert twice.records[0].stats == {"removed": 0, "collapsed": 0}
    assert not changed_code(twice, once.module)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("table", ["positives", "negatives"])
def test_changed_flag_matches_the_graph(table: str, mode: str):
    run = optimized(table, mode)
    result = PassManager([PASS]).run(run.before)
    record = result.records[0]
    assert record.changed == changed_code(result, run.before)
    assert record.changed == (record.stats["removed"] + record.stats["collapsed"] > 0)


def test_near_misses_only_change_nothing_at_fx_level():
    record = optimized("negatives", "fx").record
    assert not record.changed
    assert record.stats == {"removed": 0, "collapsed": 0}
    assert len(record.skipped) >= 8


@pytest.mark.parametrize("mode", MODES)
def test_nothing_to_remove(mode: str):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    gm = trace(model, (torch.randn(2, 3),), mode)
    result = PassManager([PASS]).run(gm)
    assert not result.records[0].changed
    assert result.records[0].stats == {"removed": 0, "collapsed": 0}
    assert result.records[0].skipped == ()
    assert not changed_code(result, gm)


def test_verify_reports_nops_left_behind():
    gm = optimized("positives", "fx").before
    with pytest.raises(AssertionError, match="no-ops left"):
        RemoveNops().verify(gm)
    RemoveNops().verify(optimized("positives", "fx").after)


# 6. Golden op list ---------------------------------------------------------------------------


class Representative(nn.Module):
    """A linear block written the way exported or generated code often is."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.dropout = nn.Dropout(0.1)
        self.identity = nn.Identity()

    def forward(self, x):
        h = self.identity(x.reshape(2, 6, 1).reshape(2, 6)) * 1
        h = self.dropout(self.linear(h))
        h = h.t().t().contiguous() - 0
        return h.float().view(2, 6).sigmoid()


GOLDEN = {
    # reshape(2, 6, 1).reshape(2, 6) → reshape(2, 6); identity, * 1, eval dropout, t().t(),
    # contiguous, - 0, float() and view(2, 6) all go.
    "fx": (
        ["placeholder", "input_guard", "reshape", "linear", "sigmoid", "output"],
        {"removed": 8, "collapsed": 1},
    ),
    # export already dropped identity and contiguous; float() leaves a metadata assertion.
    # input_guard: the optimized module's input check (fxopt.ir.contract).
    "export": (
        [
            "get_attr",
            "get_attr",
            "placeholder",
            "input_guard",
            "view",
            "permute",
            "addmm",
            "_assert_tensor_metadata",
            "sigmoid",
            "output",
        ],
        {"removed": 5, "collapsed": 1},
    ),
}


@pytest.mark.parametrize("mode", MODES)
def test_golden(mode: str):
    model = Representative().eval()
    x = torch.randn(2, 3, 2)
    optimizer = GraphOptimizer(model, x, mode=mode)
    gm = optimizer.optimize([PASS, "dce"], max_rounds=3)
    op_names, stats = GOLDEN[mode]
    assert names(gm) == op_names
    # remove-nops erases the reshape it collapsed past: dce finds nothing, and nothing
    # changed after remove-nops, so neither is rerun.
    first, dce = optimizer.pipeline.records
    assert (first.changed, first.stats) == (True, stats)
    assert (dce.changed, dce.stats) == (False, {"removed": 0})
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


class FlattenThenReshapeAs(nn.Module):
    """timm levit_128s: y.flatten(0, 1).reshape_as(y): a reshape chain that is an identity."""

    def forward(self, y):
        return y.flatten(0, 1).reshape_as(y) * 2


@pytest.mark.parametrize("mode", MODES)
def test_a_reshape_chain_back_to_its_source_is_removed_in_one_run(mode):
    model, y = FlattenThenReshapeAs(), torch.randn(2, 3, 4)
    optimizer = GraphOptimizer(model, y, mode=mode)
    gm = optimizer.optimize([PASS, "dce"])  # before: "no-ops left after remove-nops"
    assert not any(ops.info(n, gm).name in ("view", "reshape", "flatten") for n in gm.graph.nodes)
    other = torch.randn(5, 3, 4)
    torch.testing.assert_close(gm(other), model(other))


class AddsZero(nn.Module):
    def forward(self, x):
        return 1 / (x + 0), 1 / (x - 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fast_math", [False, True])
def test_x_plus_zero_goes_only_with_fast_math_and_is_reported(mode, fast_math):
    model, x = AddsZero(), torch.randn(4)
    optimizer = GraphOptimizer(model, x, mode=mode, fast_math=fast_math)
    gm = optimizer.optimize(["remove-nops"])
    record = optimizer.pipeline.records[0]
    adds = [n for n in gm.graph.nodes if ops.is_call(n, "add", gm)]
    assert len(adds) == (0 if fast_math else 1)
    assert not any(ops.is_call(n, "sub", gm) for n in gm.graph.nodes)  # x - 0 is exact
    assert record.inexact == ({"x + 0 → x on floats": 1} if fast_math else {})
    signed = torch.tensor([-0.0, 0.0, float("nan"), -float("inf"), 2.5])
    got, want = gm(signed), model(signed)
    torch.testing.assert_close(got[1], want[1], equal_nan=True)  # 1 / x: -inf at -0.0
    if fast_math:  # what fast_math gives up: 1 / (-0.0 + 0) is +inf in eager
        assert want[0][0].item() == float("inf") and got[0][0].item() == -float("inf")
    else:
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
