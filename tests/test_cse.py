"""Tests of the cse pass (common-subexpression elimination), on both capture levels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import fx, nn

from fxopt.ir import ops
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.verify import check_gradients, check_outputs
from fxopt.zoo import redundant
from tests.models.seed import RedundantModel
from tests.passes_helpers import (
    MODES,
    assert_same_effects,
    capture,
    compute_count,
    count,
    guarded_nodes,
    module_for,
    names,
    random_graph_inputs,
    random_graphs,
    run_passes,
    stats,
    wiring,
)


def opaque_twice(x):
    return x * 2


torch.fx.wrap("opaque_twice")


@dataclass
class Case:
    """A model, its inputs, and per canonical op name the count (before, after) the pass."""

    id: str
    model: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    counts: dict[str, tuple[int, int]]
    export_counts: dict[str, tuple[int, int]] | None = None  # when export spells it otherwise
    export_skip: str | None = None  # why this case cannot run on the export level
    reason: str | None = None  # words the plan's skip reason must contain (negatives)
    reason_in_export: bool = True  # False when export gives the duplicates other inputs
    merged: int | None = None  # exact merge count, when it is the point of the case

    def expected(self, mode: str) -> dict[str, tuple[int, int]]:
        return self.export_counts if mode == "export" and self.export_counts else self.counts


def fn(f, arity: int = 1) -> Callable[[], nn.Module]:
    return lambda: module_for(f, arity)


def x4() -> tuple:
    return (torch.randn(2, 4),)


def xy4() -> tuple:
    return (torch.randn(2, 4), torch.randn(2, 4))


def ints() -> tuple:
    return (torch.arange(8).reshape(2, 4),)


def params(cases: list[Case]) -> list:
    return [pytest.param(case, mode, id=f"{case.id}-{mode}") for case in cases for mode in MODES]


_CAPTURED: dict[tuple[str, str], tuple[nn.Module, tuple, fx.GraphModule]] = {}


def captured(case: Case, mode: str) -> tuple[nn.Module, tuple, fx.GraphModule]:
    """The case's model, inputs and graph; captured once per mode (export is slow), and
    safe to share: passes run on copies and the checks clone models and inputs."""
    if mode == "export" and case.export_skip:
        pytest.skip(case.export_skip)
    key = (case.id, mode)
    if key not in _CAPTURED:
        model, inputs = case.model(), case.inputs()
        _CAPTURED[key] = (model, inputs, capture(model, inputs, mode))
    return _CAPTURED[key]


class Act(nn.Module):
    """A leaf module called twice on the same input."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.act = module

    def forward(self, x):
        return self.act(x) + self.act(x)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)

    def forward(self, x):
        return self.encoder(x) * self.encoder(x)


def trained(module: nn.Module, train: bool) -> Callable[[], nn.Module]:
    return lambda: Act(module).train(train)


def _write_input(module, args):
    args[0].mul_(2)  # a pre-hook may do anything, here write into the module's input


def hooked_writer() -> nn.Module:
    class WritesInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()
            self.act.register_forward_pre_hook(_write_input)

        def forward(self, x):
            y = x * 1
            a = y + 1
            z = self.act(y)
            return a, y + 1, z

    return WritesInput()


# -- 1. positive cases -----------------------------------------------------------------------

POSITIVE = [
    # Seed 000's RedundantModel: a = F.relu(x); b = F.relu(x); return a + b -> one relu.
    Case("F.relu", fn(lambda x: F.relu(x) + F.relu(x)), x4, {"relu": (2, 1)}, merged=1),
    Case("torch.relu", fn(lambda x: torch.relu(x) + torch.relu(x)), x4, {"relu": (2, 1)}),
    Case("x.relu()", fn(lambda x: x.relu() + x.relu()), x4, {"relu": (2, 1)}),
    Case("nn.ReLU module", lambda: Act(nn.ReLU()), x4, {"relu": (2, 1)}),
    Case("operator add", fn(lambda x, y: (x + y) * (x + y), 2), xy4, {"add": (2, 1)}),
    Case("torch.add", fn(lambda x, y: torch.add(x, y) * torch.add(x, y), 2), xy4, {"add": (2, 1)}),
    Case("x.add(y)", fn(lambda x, y: x.add(y) * x.add(y), 2), xy4, {"add": (2, 1)}),
    Case(
        "add with same alpha",
        fn(lambda x, y: torch.add(x, y, alpha=2) * torch.add(x, y, alpha=2), 2),
        xy4,
        {"add": (2, 1)},
    ),
    Case("a+b vs b+a", fn(lambda x, y: (x + y) * (y + x), 2), xy4, {"add": (2, 1)}, merged=1),
    Case("a*b vs b*a", fn(lambda x, y: (x * y) - (y * x), 2), xy4, {"mul": (2, 1)}, merged=1),
    Case(
        "encoder(x) twice",
        Encoder,
        x4,
        {"linear": (2, 1)},
        export_counts={"addmm": (2, 1), "permute": (2, 1)},
    ),
    Case("eval BatchNorm twice", trained(nn.BatchNorm1d(4), False), x4, {"batch_norm": (2, 1)}),
    Case(
        "eval Dropout twice",
        trained(nn.Dropout(0.5), False),
        x4,
        {"dropout": (2, 1)},
        export_skip="torch.export removes eval-mode dropout at capture: nothing to merge",
    ),
    Case(
        "cascade",
        fn(lambda x: torch.sigmoid(x + 1) * 2 - torch.sigmoid(x + 1) * 2),
        x4,
        {"add": (2, 1), "sigmoid": (2, 1), "mul": (2, 1)},
        merged=3,
    ),
    Case(
        "seed RedundantModel",
        RedundantModel,
        lambda: (torch.randn(2, 8),),
        {"relu": (2, 1), "linear": (2, 1)},
        export_counts={"relu": (2, 1), "addmm": (2, 1)},
    ),
    Case(
        "zoo RedundantModel",
        lambda: redundant.build(image=6)[0],
        lambda: (torch.randn(2, 8, 6, 6),),
        {"conv": (2, 1), "linear": (4, 2), "relu": (4, 2)},
        export_counts={"conv": (2, 1), "addmm": (4, 2), "relu": (4, 2)},
    ),
]


POSITIVE_BY_ID = {case.id: case for case in POSITIVE}


@pytest.mark.parametrize(("case", "mode"), params(POSITIVE))
def test_duplicates_are_merged(case, mode):
    model, inputs, gm = captured(case, mode)
    result = run_passes(gm, "cse")
    for name, (before, after) in case.expected(mode).items():
        assert (count(gm, name), count(result.module, name)) == (before, after), name
    merged = stats(result, "cse")["merged"]
    assert merged >= 1 and result.records[0].changed
    if case.merged is not None:
        assert merged == case.merged
    assert compute_count(result.module) == compute_count(gm) - merged
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)


# -- 2. near misses: one per guard -----------------------------------------------------------

FUNCTIONALIZED = "torch.export functionalizes the in-place write, so {} (covered in fx mode)"


def b_written_later(x):
    a = torch.relu(x)
    b = torch.relu(x)
    b.add_(1)
    return a, b


def a_written_before_b(x):
    a = torch.relu(x)
    a.add_(1)
    b = torch.relu(x)
    return a, b


def add_twice_inplace(x):
    x.add_(1)
    x.add_(1)
    return x


def read_around_view_write(x):
    a = x + 1
    x.view(-1).mul_(2)
    return a, x + 1


def read_around_intermediate_view_write(x):
    y = x * 3
    a = y + 1
    y.view(-1).mul_(2)
    return a, y + 1


def read_around_transpose_write(x):
    a = x + 1
    x.T.mul_(2)
    return a, x + 1


def shapes_concatenated(x):
    # `+` on shapes is the point: fx records it as operator.add, like tensor addition.
    return x.reshape(x.shape + (1,)), x.reshape((1,) + x.shape)  # noqa: RUF005


class TwoFunctionalBatchNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        a = F.batch_norm(x, self.mean, self.var, training=True)
        return a + F.batch_norm(x, self.mean, self.var, training=True)


NEGATIVE = [
    Case(
        "two randn_like",
        fn(lambda x: torch.randn_like(x) + torch.randn_like(x)),
        x4,
        {"random": (2, 2)},
        reason="random",
    ),
    Case(
        "two training F.dropout",
        fn(lambda x: F.dropout(x, 0.5, True) + F.dropout(x, 0.5, True)),
        x4,
        {"dropout": (2, 2)},
        reason="random",
    ),
    Case(
        "two training nn.Dropout",
        trained(nn.Dropout(0.5), True),
        x4,
        {"dropout": (2, 2)},
        reason="random",
    ),
    Case("x.add_(1) twice", fn(add_twice_inplace), x4, {"add": (2, 2)}),
    Case("x + 1 around x.view(-1).mul_(2)", fn(read_around_view_write), x4, {"add": (2, 2)}),
    Case(
        "y + 1 around y.view(-1).mul_(2)",
        fn(read_around_intermediate_view_write),
        x4,
        {"add": (2, 2)},
    ),
    Case("x + 1 around x.T.mul_(2)", fn(read_around_transpose_write), x4, {"add": (2, 2)}),
    Case(
        "b written in place later",
        fn(b_written_later),
        x4,
        {"relu": (2, 2)},
        export_skip=FUNCTIONALIZED.format("b is a new value there and merging is right"),
        reason="written in place later",
    ),
    Case(
        "a written in place before b",
        fn(a_written_before_b),
        x4,
        {"relu": (2, 2)},
        export_skip=FUNCTIONALIZED.format("a is a new value there and merging is right"),
        reason="written in place later",
    ),
    Case(
        "training BatchNorm twice",
        trained(nn.BatchNorm1d(4), True),
        x4,
        {"batch_norm": (2, 2)},
        reason="module state",
        reason_in_export=False,
    ),
    Case("training F.batch_norm twice", TwoFunctionalBatchNorms, x4, {"batch_norm": (2, 2)}),
    Case("x * 1 vs x * 1.0 (int)", fn(lambda x: (x * 1, x * 1.0)), ints, {"mul": (2, 2)}),
    Case("x + 1 vs x + True (int)", fn(lambda x: (x + 1, x + True)), ints, {"add": (2, 2)}),
    Case("x + -0.0 vs x + 0.0", fn(lambda x: (x + (-0.0), x + 0.0)), x4, {"add": (2, 2)}),
    Case("x * -0.0 vs x * 0.0", fn(lambda x: (x * (-0.0), x * 0.0)), x4, {"mul": (2, 2)}),
    Case(
        "add(x, y, alpha) vs add(y, x, alpha)",
        fn(lambda x, y: (torch.add(x, y, alpha=2), torch.add(y, x, alpha=2)), 2),
        xy4,
        {"add": (2, 2)},
    ),
    Case("x - y vs y - x", fn(lambda x, y: (x - y, y - x), 2), xy4, {"sub": (2, 2)}),
    Case(
        "unknown function",
        fn(lambda x: torch.cosh(x) + torch.cosh(x)),
        x4,
        {"cosh": (2, 2)},
        export_skip="torch.export spells cosh as aten.cosh, whose schema makes it known",
    ),
    Case(
        "fx.wrap'ed python function",
        fn(lambda x: opaque_twice(x) + opaque_twice(x)),
        x4,
        {"opaque_twice": (2, 2)},
        export_skip="torch.export traces through python functions",
    ),
    Case(
        "unknown leaf module",
        lambda: Act(nn.Softplus()),
        x4,
        {"Softplus": (2, 2)},
        export_skip="torch.export spells softplus as aten.softplus, known by its schema",
    ),
    Case(
        "hooked module",
        lambda: Act(_hooked(nn.ReLU())),
        x4,
        {"relu": (2, 2)},
        export_skip="torch.export inlines module hooks",
    ),
    Case(
        "pre-hook writes the input",
        hooked_writer,
        x4,
        {"add": (2, 2)},
        export_skip="torch.export inlines module hooks",
    ),
    Case(
        "s + (1,) vs (1,) + s",
        fn(shapes_concatenated),
        x4,
        {"add": (2, 2)},
        export_skip="torch.export specializes static shapes: no shape arithmetic is left",
    ),
]


def _hooked(module: nn.Module) -> nn.Module:
    module.register_forward_hook(lambda *_: None)
    return module


@pytest.mark.parametrize(("case", "mode"), params(NEGATIVE))
def test_near_misses_are_not_merged(case, mode):
    model, inputs, gm = captured(case, mode)
    guarded = guarded_nodes(gm)
    result = run_passes(gm, "cse")
    for name, (before, after) in case.expected(mode).items():
        assert (count(gm, name), count(result.module, name)) == (before, after), name
    assert guarded_nodes(result.module) == guarded  # nothing random/in-place/impure merged
    if case.reason and (mode == "fx" or case.reason_in_export):
        reasons = " | ".join(s.reason for s in result.records[0].skipped)
        assert case.reason in reasons
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)


def test_training_batch_norm_sharing_buffer_nodes_is_not_merged():
    # Regression: F.batch_norm(training=True) was pure; two calls on the same buffer nodes
    # merged, so the running stats were updated once instead of twice.
    model = TwoFunctionalBatchNorms()
    graph = fx.Graph()
    x = graph.placeholder("x")
    mean, var = graph.get_attr("mean"), graph.get_attr("var")
    calls = [
        graph.call_function(F.batch_norm, (x, mean, var), {"training": True}) for _ in range(2)
    ]
    graph.output(graph.call_function(torch.add, tuple(calls)))
    gm = fx.GraphModule(model, graph)
    result = run_passes(gm, "cse")
    assert count(result.module, "batch_norm") == 2
    assert_same_effects(gm, result.module, x4())


# -- 3. parity of outputs (random models under one seed) and of gradients ------------------


class NoisyRedundant(nn.Module):
    """Duplicates around random ops: merging must keep every dropout mask and noise draw."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        a = self.drop(self.lin(x))
        b = self.drop(self.lin(x))
        noise = torch.randn_like(x)
        return F.relu(a) + F.relu(b) + torch.sigmoid(noise) * torch.sigmoid(noise)


@pytest.mark.parametrize("mode", MODES)
def test_random_model_parity_under_one_seed(mode):
    model, inputs = NoisyRedundant().train(), x4()
    gm = capture(model, inputs, mode)
    result = run_passes(gm, "cse", "dce")
    assert stats(result, "cse")["merged"] >= 2  # lin(x) and sigmoid(noise)
    assert count(result.module, "dropout") == 2
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_id", ["seed RedundantModel", "zoo RedundantModel"])
def test_gradient_parity(case_id, mode):
    model, inputs, gm = captured(POSITIVE_BY_ID[case_id], mode)
    result = run_passes(gm, "cse", "dce")
    assert stats(result, "cse")["merged"] >= 2
    check = check_gradients(model, result.module, inputs)
    assert check.ok, check.message
    assert check.details["compared"] >= 3  # the input and the parameters, not vacuous


# -- 4. idempotence and 5. an honest `changed` ------------------------------------------------


@pytest.mark.parametrize(("case", "mode"), params(POSITIVE))
def test_second_run_changes_nothing(case, mode):
    _, _, gm = captured(case, mode)
    once = run_passes(gm, "cse", "dce").module
    again = run_passes(once, "cse", "dce")
    assert not again.changed
    assert [r.changed for r in again.records] == [False, False]
    assert stats(again, "cse") == {"merged": 0}
    assert stats(again, "dce") == {"removed": 0}
    assert names(again.module) == names(once)


@pytest.mark.parametrize("mode", MODES)
def test_changed_is_false_when_nothing_repeats(mode):
    model, inputs = module_for(lambda x: torch.relu(x) + torch.sigmoid(x), 1), x4()
    gm = capture(model, inputs, mode)
    result = run_passes(gm, "cse")
    assert result.records[0].changed is False
    assert stats(result, "cse") == {"merged": 0}
    assert wiring(result.module) == wiring(gm)


def test_pass_object_reports_what_it_did():
    gm = fx.symbolic_trace(module_for(lambda x: torch.relu(x) + torch.relu(x), 1))
    cse = CommonSubexpressionElimination()
    plan = cse.analyze(gm)
    assert [(d.name, k.name) for d, k in plan.merges] == [("relu_1", "relu")]
    assert count(gm, "relu") == 2  # analyze is read-only
    result = cse.transform(gm, plan)
    assert result.changed and result.stats == {"merged": 1}
    cse.verify(gm)
    assert cse(gm).changed is False


# -- 6. golden graphs --------------------------------------------------------------------------

GOLDEN = {
    "fx": [
        ("placeholder", ()),
        ("relu", ("placeholder",)),
        ("linear", ("placeholder",)),
        ("add", ("relu", "relu")),
        ("add", ("add", "linear")),
        ("add", ("add", "linear")),
        ("output", ("add",)),
    ],
    "export": [
        ("get_attr", ()),
        ("get_attr", ()),
        ("placeholder", ()),
        ("relu", ("placeholder",)),
        ("permute", ("get_attr",)),
        ("addmm", ("get_attr", "placeholder", "permute")),
        ("add", ("relu", "relu")),
        ("add", ("add", "addmm")),
        ("add", ("add", "addmm")),
        ("output", ("add",)),
    ],
}


@pytest.mark.parametrize("mode", MODES)
def test_golden_seed_redundant_model(mode):
    _, _, gm = captured(POSITIVE_BY_ID["seed RedundantModel"], mode)
    result = run_passes(gm, "cse", "dce")
    assert wiring(result.module) == GOLDEN[mode]


# -- property tests on random graphs ----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_random_graphs_cse_then_dce(gm):
    inputs = random_graph_inputs()
    guarded = guarded_nodes(gm)
    result = run_passes(gm, "cse", "dce")
    assert_same_effects(gm, result.module, inputs)
    # Nothing random or stateful goes; an in-place write may, with the fresh value it
    # writes once nothing reads that (dce).
    gone = guarded - guarded_nodes(result.module)
    assert not guarded_nodes(result.module) - guarded
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in gone:
        op = ops.info(nodes[name], gm)
        assert op.inplace and op.known and not (op.random or op.stateful), name
    assert compute_count(result.module) <= compute_count(gm)
    again = run_passes(result.module, "cse", "dce")
    assert not again.changed


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_random_graphs_cse_alone(gm):
    inputs = random_graph_inputs()
    guarded = guarded_nodes(gm)
    result = run_passes(gm, "cse")
    merged = stats(result, "cse")["merged"]
    assert_same_effects(gm, result.module, inputs)
    assert guarded_nodes(result.module) == guarded
    assert compute_count(result.module) == compute_count(gm) - merged
    assert result.records[0].changed is (merged > 0)
