"""Tests of the dce pass (dead-code elimination), on both capture levels."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from torch import fx, nn

from fxopt.ir import ops
from fxopt.passes.dce import DeadCodeElimination
from fxopt.verify import check_gradients, check_outputs
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

aten = torch.ops.aten
CALLS: list[str] = []


def logged(x):
    """An opaque function with a side effect dce must keep (it is not in the op table)."""
    CALLS.append("logged")
    return x


torch.fx.wrap("logged")


@dataclass
class Case:
    """A model with unused code, and per canonical op name the count (before, after) dce."""

    id: str
    model: Callable[[], nn.Module]
    counts: dict[str, tuple[int, int]]
    arity: int = 1
    export_skip: str | None = None
    reason: str | None = None  # words the skip reason of the unused node must contain


def fn(f, arity: int = 1) -> Callable[[], nn.Module]:
    return lambda: module_for(f, arity)


def inputs_for(case: Case) -> tuple:
    return tuple(torch.randn(2, 4) for _ in range(case.arity))


def params(cases: list[Case]) -> list:
    return [pytest.param(case, mode, id=f"{case.id}-{mode}") for case in cases for mode in MODES]


_CAPTURED: dict[tuple[str, str], tuple[nn.Module, tuple, fx.GraphModule]] = {}


def captured(case: Case, mode: str) -> tuple[nn.Module, tuple, fx.GraphModule]:
    """Captured once per mode and shared: passes run on copies, checks clone."""
    if mode == "export" and case.export_skip:
        pytest.skip(case.export_skip)
    key = (case.id, mode)
    if key not in _CAPTURED:
        model, inputs = case.model(), inputs_for(case)
        _CAPTURED[key] = (model, inputs, capture(model, inputs, mode))
    return _CAPTURED[key]


class Unused(nn.Module):
    """Calls ``self.m`` on an intermediate value and drops the result."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module

    def forward(self, x):
        y = x * 2
        self.m(y)
        return y + 1


def unused(module: nn.Module, train: bool = False) -> Callable[[], nn.Module]:
    return lambda: Unused(module).train(train)


class UnusedFunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        F.batch_norm(x, self.mean, self.var, training=True)
        return x + 1


def _hooked(module: nn.Module) -> nn.Module:
    module.register_forward_hook(lambda *_: CALLS.append("hook"))
    return module


# -- 1. positive cases -----------------------------------------------------------------------

EXPORT_DCE = "torch.export already removes unused pure ops at capture (see test_dead_copy_*)"


def dead_chain(x):
    (x + 1).sigmoid() * 2
    return x - 1


POSITIVE = [
    Case("F.relu", fn(lambda x: (F.relu(x), x - 1)[1]), {"relu": (1, 0)}),
    Case("torch.relu", fn(lambda x: (torch.relu(x), x - 1)[1]), {"relu": (1, 0)}),
    Case("x.relu()", fn(lambda x: (x.relu(), x - 1)[1]), {"relu": (1, 0)}),
    Case("operator add", fn(lambda x, y: (x + y, x - y)[1], 2), {"add": (1, 0)}, arity=2),
    Case("x.view(-1)", fn(lambda x: (x.view(-1), x - 1)[1]), {"view": (1, 0)}),
    Case("nn.ReLU module", unused(nn.ReLU()), {"relu": (1, 0)}),
    Case("nn.Linear module", unused(nn.Linear(4, 4)), {"linear": (1, 0)}),
    Case("eval BatchNorm module", unused(nn.BatchNorm1d(4)), {"batch_norm": (1, 0)}),
    Case("eval Dropout module", unused(nn.Dropout(0.5)), {"dropout": (1, 0)}),
    Case(
        "F.dropout(training=False)",
        fn(lambda x: (F.dropout(x, 0.5, False), x - 1)[1]),
        {"dropout": (1, 0)},
    ),
    Case("dead chain", fn(dead_chain), {"add": (1, 0), "sigmoid": (1, 0), "mul": (1, 0)}),
]
for _case in POSITIVE:
    _case.export_skip = EXPORT_DCE


@pytest.mark.parametrize(("case", "mode"), params(POSITIVE))
def test_unused_pure_ops_are_removed(case, mode):
    model, inputs, gm = captured(case, mode)
    result = run_passes(gm, "dce")
    for name, (before, after) in case.counts.items():
        assert (count(gm, name), count(result.module, name)) == (before, after), name
    removed = stats(result, "dce")["removed"]
    assert removed == sum(b - a for b, a in case.counts.values())  # one pass, whole chains
    assert result.records[0].changed
    assert compute_count(result.module) == compute_count(gm) - removed
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)


DEAD_COPIES = [
    ("relu", fn(torch.relu), 1),
    ("add", fn(lambda x, y: x + y, 2), 2),
    ("view", fn(lambda x: x.view(-1) * 2), 1),
    ("sigmoid", fn(torch.sigmoid), 1),
    ("batch_norm", lambda: nn.Sequential(nn.BatchNorm1d(4)).eval(), 1),
    ("dropout", fn(lambda x: F.dropout(x, 0.5, False) * 2), 1),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("name", "build", "arity"), DEAD_COPIES, ids=[c[0] for c in DEAD_COPIES])
def test_dead_copy_of_a_pure_op_is_removed(name, build, arity, mode):
    model, inputs = build(), tuple(torch.randn(2, 4) for _ in range(arity))
    gm = capture(model, inputs, mode)
    if mode == "export" and name == "dropout":
        pytest.skip("torch.export removes eval-mode dropout at capture: nothing to copy")
    before = count(gm, name)
    already_dead = stats(run_passes(gm, "dce"), "dce")["removed"]  # export: unused get_attr
    original = next(ops.calls(gm, name))
    with gm.graph.inserting_after(original):
        gm.graph.node_copy(original)  # same call, no users
    gm.recompile()
    result = run_passes(gm, "dce")
    assert stats(result, "dce") == {"removed": already_dead + 1}
    assert count(result.module, name) == before
    assert_same_effects(model, result.module, inputs)


def test_export_unused_attribute_reads_go_but_state_dict_keys_stay():
    model, inputs = nn.BatchNorm1d(4).eval(), (torch.randn(2, 4),)
    gm = capture(model, inputs, "export")
    unused_attrs = [n.target for n in gm.graph.nodes if n.op == "get_attr" and not n.users]
    assert unused_attrs  # num_batches_tracked is read by nobody in eval mode
    result = run_passes(gm, "dce")
    assert stats(result, "dce") == {"removed": len(unused_attrs)}
    left = {n.target for n in result.module.graph.nodes if n.op == "get_attr"}
    assert not left & set(unused_attrs)
    assert result.module.state_dict().keys() == gm.state_dict().keys()
    assert_same_effects(model, result.module, inputs)


def test_unused_placeholders_stay():
    gm = capture(module_for(lambda x, y: x + 1, 2), (torch.randn(2), torch.randn(2)), "fx")
    result = run_passes(gm, "dce")
    assert [n.name for n in result.module.graph.nodes if n.op == "placeholder"] == ["x", "y"]
    assert result.records[0].changed is False


# -- 2. near misses: unused but kept -----------------------------------------------------------

AT_CAPTURE = "torch.export drops the unused {} at capture (ATen level: test_aten_*)"


def unused_random_then_used(x):
    torch.randn_like(x)
    return torch.randn_like(x)


def unused_out(x, y):
    torch.add(x, x, out=y)
    return x * 2


def unused_inplace_relu(x):
    y = x * 2
    F.relu(y, inplace=True)
    return y


def unused_inplace_on_input(x):
    x.mul_(2)
    return x + 1


def unused_mul_on_view(x):
    y = x * 1
    y.view(-1).mul_(2)
    return y


NEGATIVE = [
    Case(
        "randn_like",
        fn(unused_random_then_used),
        {"random": (2, 2)},
        reason="random",
        export_skip=AT_CAPTURE.format("randn_like"),
    ),
    Case(
        "training F.dropout",
        fn(lambda x: (F.dropout(x, 0.5, True), torch.randn_like(x))[1]),
        {"dropout": (1, 1)},
        reason="random",
        export_skip=AT_CAPTURE.format("dropout"),
    ),
    Case(
        "training nn.Dropout",
        unused(nn.Dropout(0.5), train=True),
        {"dropout": (1, 1)},
        reason="random",
        export_skip=AT_CAPTURE.format("dropout"),
    ),
    Case(
        "training BatchNorm module",
        unused(nn.BatchNorm1d(4), train=True),
        {"batch_norm": (1, 1)},
        reason="module state",
    ),
    Case("training F.batch_norm", UnusedFunctionalBatchNorm, {"batch_norm": (1, 1)}),
    Case(
        "torch.add(out=)",
        fn(unused_out, 2),
        {"add": (1, 1)},
        arity=2,
        reason="writes into its input",
    ),
    Case(
        "F.relu(inplace=True)",
        fn(unused_inplace_relu),
        {"relu": (1, 1)},
        reason="writes into its input",
    ),
    Case(
        "nn.ReLU(inplace=True)",
        unused(nn.ReLU(inplace=True)),
        {"relu": (1, 1)},
        reason="writes into its input",
    ),
    Case(
        "x.mul_(2) on an input",
        fn(unused_inplace_on_input),
        {"mul": (1, 1)},
        reason="writes into its input",
    ),
    Case(
        "mul_ through a view",
        fn(unused_mul_on_view),
        {"mul": (2, 2)},
        reason="writes into its input",
    ),
    Case(
        "unknown function",
        fn(lambda x: (torch.cosh(x), x - 1)[1]),
        {"cosh": (1, 1)},
        reason="unknown op",
        export_skip=AT_CAPTURE.format("aten.cosh (known, pure)"),
    ),
    Case(
        "fx.wrap'ed function",
        fn(lambda x: (logged(x), x - 1)[1]),
        {"logged": (1, 1)},
        reason="unknown op",
        export_skip="torch.export traces through python functions",
    ),
    Case(
        "unknown leaf module",
        unused(nn.Softplus()),
        {"Softplus": (1, 1)},
        reason="unknown op",
        export_skip=AT_CAPTURE.format("aten.softplus (known, pure)"),
    ),
    Case(
        "hooked module",
        unused(_hooked(nn.ReLU())),
        {"relu": (1, 1)},
        reason="unknown op",
        export_skip="torch.export inlines module hooks",
    ),
]


@pytest.mark.parametrize(("case", "mode"), params(NEGATIVE))
def test_unused_impure_ops_are_kept(case, mode):
    model, inputs, gm = captured(case, mode)
    guarded = guarded_nodes(gm)
    result = run_passes(gm, "dce")
    for name, (before, after) in case.counts.items():
        assert (count(gm, name), count(result.module, name)) == (before, after), name
    assert guarded_nodes(result.module) == guarded
    if case.reason and mode == "fx":
        reasons = " | ".join(s.reason for s in result.records[0].skipped)
        assert case.reason in reasons
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)  # also input writes and buffers


def test_side_effects_of_kept_opaque_calls_still_happen():
    model = module_for(lambda x: (logged(x), x - 1)[1], 1)
    result = run_passes(capture(model, (torch.randn(2),), "fx"), "dce")
    CALLS.clear()
    result.module(torch.randn(2))
    assert CALLS == ["logged"]
    hooked = run_passes(capture(unused(_hooked(nn.ReLU()))(), (torch.randn(2),), "fx"), "dce")
    CALLS.clear()
    hooked.module(torch.randn(2))
    assert CALLS == ["hook"]


def test_training_batch_norm_function_still_updates_running_stats():
    # Regression: F.batch_norm(training=True) was called pure and dce removed it, so the
    # running statistics were never updated.
    model, inputs = UnusedFunctionalBatchNorm(), (torch.randn(2, 4),)
    result = run_passes(capture(model, inputs, "fx"), "dce")
    assert count(result.module, "batch_norm") == 1
    result.module(*inputs)
    assert not torch.equal(result.module.mean, torch.zeros(4))


def _aten_graph(target, *args, **kwargs) -> fx.GraphModule:
    """x, y, rm, rv inputs; one unused call of ``target``; returns x + 1."""
    graph = fx.Graph()
    inputs = {name: graph.placeholder(name) for name in ("x", "y", "rm", "rv")}

    def resolve(value):
        return inputs.get(value, value) if isinstance(value, str) else value

    graph.call_function(
        target, tuple(map(resolve, args)), {k: resolve(v) for k, v in kwargs.items()}
    )
    graph.output(graph.call_function(aten.add.Tensor, (inputs["x"], 1)))
    return fx.GraphModule(nn.Module(), graph)


ATEN = [
    ("randn_like", aten.randn_like.default, ("x",), {}, False),
    ("native_dropout train", aten.native_dropout.default, ("x", 0.5, True), {}, False),
    ("dropout train", aten.dropout.default, ("x", 0.5, True), {}, False),
    ("add_", aten.add_.Tensor, ("x", "y"), {}, False),
    ("add.out", aten.add.out, ("x", "x"), {"out": "y"}, False),
    ("relu_", aten.relu_.default, ("y",), {}, False),
    ("copy_", aten.copy_.default, ("y", "x"), {}, False),
    (
        "_native_batch_norm_legit train",
        aten._native_batch_norm_legit.default,
        ("x", None, None, "rm", "rv", True, 0.1, 1e-5),
        {},
        False,
    ),
    (
        "batch_norm train",
        aten.batch_norm.default,
        ("x", None, None, "rm", "rv", True, 0.1, 1e-5, False),
        {},
        False,
    ),
    ("overload packet (unknown)", aten.relu, ("x",), {}, False),
    ("relu", aten.relu.default, ("x",), {}, True),
    ("view", aten.view.default, ("x", [-1]), {}, True),
    ("native_dropout eval", aten.native_dropout.default, ("x", 0.5, False), {}, True),
    ("dropout eval", aten.dropout.default, ("x", 0.5, False), {}, True),
    (
        "batch_norm eval",
        aten.batch_norm.default,
        ("x", None, None, "rm", "rv", False, 0.1, 1e-5, False),
        {},
        True,
    ),
]


@pytest.mark.parametrize(
    ("target", "args", "kwargs", "removed"), [c[1:] for c in ATEN], ids=[c[0] for c in ATEN]
)
def test_aten_unused_nodes(target, args, kwargs, removed):
    gm = _aten_graph(target, *args, **kwargs)
    inputs = (torch.randn(2, 4), torch.randn(2, 4), torch.zeros(4), torch.ones(4))
    result = run_passes(gm, "dce")
    assert stats(result, "dce") == {"removed": int(removed)}
    assert any(n.target is target for n in result.module.graph.nodes) is not removed
    assert_same_effects(gm, result.module, inputs)


def _written_copy(write: str, *, read_after: bool = False, view: bool = False):
    """x → a fresh copy (or a view of x), written in place by ``write``; returns x + 1 (or
    the copy, read after the write)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    if view:
        fresh = graph.call_function(aten.view.default, (x, [-1]))
    else:
        fresh = graph.call_function(aten.lift_fresh_copy.default, (x,))
    args = (fresh,) if write == "detach_" else (fresh, 2.0)
    graph.call_function(
        getattr(aten, write).default if write == "detach_" else aten.mul_.Scalar, args
    )
    out = fresh if read_after else graph.call_function(aten.add.Tensor, (x, 1.0))
    graph.output(out)
    return fx.GraphModule(nn.Module(), graph)


@pytest.mark.parametrize(
    ("write", "read_after", "view", "removed"),
    [
        ("detach_", False, False, 2),  # torch.export's detach_(lift_fresh_copy(constant))
        ("mul_", False, False, 2),  # nobody sees the written copy
        ("mul_", True, False, 0),  # the copy is returned: its write is what it holds
        ("mul_", False, True, 0),  # a view of the input: the write reaches the caller
    ],
)
def test_a_write_into_a_fresh_value_nobody_reads_goes_with_it(write, read_after, view, removed):
    gm = _written_copy(write, read_after=read_after, view=view)
    result = run_passes(gm, "dce")
    assert stats(result, "dce") == {"removed": removed}
    x = torch.randn(2, 3)
    assert_same_effects(gm, result.module, (x,))
    assert_same_effects(gm, result.module, (torch.tensor([[float("nan"), -0.0, 1.0]]),))


def test_two_writes_into_one_unread_fresh_value_go_together():
    # (found by the cse+dce property test: the second analysis, dce's own check, removed
    # what the first had kept)
    graph = fx.Graph()
    x = graph.placeholder("x")
    fresh = graph.call_function(aten.lift_fresh_copy.default, (x,))
    graph.call_function(aten.add_.Tensor, (fresh, x))
    graph.call_function(aten.mul.Tensor, (fresh, 2.0))  # dead: read by nothing
    graph.call_function(aten.add_.Tensor, (fresh, x))
    graph.output(graph.call_function(aten.add.Tensor, (x, 1.0)))
    gm = fx.GraphModule(nn.Module(), graph)
    result = run_passes(gm, "dce")  # (its verify re-analyzes: nothing left to remove)
    assert stats(result, "dce") == {"removed": 4}
    assert_same_effects(gm, result.module, (torch.randn(2, 3),))


# -- 3. parity, gradients -----------------------------------------------------------------------


class Wasteful(nn.Module):
    """Parameters, unused branches, a kept random op and a kept in-place op."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        h = self.lin(x)
        self.side(h).sigmoid()  # dead
        noise = torch.randn_like(h)  # kept: random
        torch.tanh(h)  # dead
        return self.drop(h) + noise


@pytest.mark.parametrize("mode", MODES)
def test_parity_and_gradients_with_parameters(mode):
    model, inputs = Wasteful().train(), (torch.randn(3, 4),)
    gm = capture(model, inputs, mode)
    result = run_passes(gm, "cse", "dce")
    if mode == "fx":
        assert stats(result, "dce")["removed"] == 3
    assert count(result.module, "random") == 1 and count(result.module, "dropout") == 1
    assert check_outputs(model, result.module, inputs).ok
    assert_same_effects(model, result.module, inputs)
    check = check_gradients(model, result.module, inputs)
    assert check.ok, check.message
    assert check.details["compared"] >= 3


# -- 4. idempotence, 5. honest `changed` --------------------------------------------------------


@pytest.mark.parametrize(("case", "mode"), params(POSITIVE + NEGATIVE))
def test_second_run_changes_nothing(case, mode):
    _, _, gm = captured(case, mode)
    once = run_passes(gm, "dce").module
    again = run_passes(once, "dce")
    assert again.records[0].changed is False
    assert stats(again, "dce") == {"removed": 0}
    assert names(again.module) == names(once)


@pytest.mark.parametrize("mode", MODES)
def test_changed_is_false_when_everything_is_used(mode):
    model, inputs = module_for(lambda x: torch.relu(x) + torch.sigmoid(x), 1), (torch.randn(3),)
    gm = capture(model, inputs, mode)
    result = run_passes(gm, "dce")
    assert result.records[0].changed is False
    assert stats(result, "dce") == {"removed": 0}
    assert wiring(result.module) == wiring(gm)


def test_pass_object_reports_what_it_did():
    gm = fx.symbolic_trace(module_for(dead_chain, 1))
    dce = DeadCodeElimination()
    plan = dce.analyze(gm)
    assert [n.name for n in plan.dead] == ["mul", "sigmoid", "add"]  # users first
    assert count(gm, "sigmoid") == 1  # analyze is read-only
    result = dce.transform(gm, plan)
    assert result.changed and result.stats == {"removed": 3}
    dce.verify(gm)
    assert dce(gm).changed is False


# -- 6. golden graph ------------------------------------------------------------------------------


def golden_model(x):
    y = x * 2
    (y + 1).sigmoid()  # dead chain: removed
    torch.randn_like(x)  # random: kept
    y.view(-1).mul_(3)  # in place through a view: kept
    return y


def test_golden_graph():
    result = run_passes(capture(module_for(golden_model, 1), (torch.randn(2, 3),), "fx"), "dce")
    assert wiring(result.module) == [
        ("placeholder", ()),
        ("mul", ("placeholder",)),
        ("random", ("placeholder",)),
        ("view", ("mul",)),
        ("mul", ("view",)),
        ("output", ("mul",)),
    ]
    assert [s.reason for s in result.records[0].skipped] == [
        "unused but kept: 'random' is random (each call draws new numbers)",
        "unused but kept: 'mul' writes into its input",
    ]


# -- property tests on random graphs ----------------------------------------------------------


def live_nodes(gm: fx.GraphModule) -> set[str]:
    """What dce must keep: placeholders, the output, everything not removable but an
    in-place write into fresh values only dead nodes read, and every input of a kept node
    (transitively). A fixed point: a write is live once a live node reads what it wrote."""
    writers = {
        n: list(ops.mutated_nodes(n, ops.info(n)))
        for n in gm.graph.nodes
        if ops.is_compute(n)
        and ops.info(n).inplace
        and ops.info(n).known
        and not (ops.info(n).random or ops.info(n).stateful)
    }

    def fresh(value: fx.Node) -> bool:
        op = ops.info(value) if value.op == "call_function" else None
        return op is not None and op.removable and not op.inplace and not op.view

    seeds = [
        n
        for n in gm.graph.nodes
        if n.op in ("placeholder", "output")
        or (ops.is_compute(n) and not ops.info(n).removable and n not in writers)
    ]
    live: set[fx.Node] = set()
    while True:
        keep = seeds + [
            w
            for w, written in writers.items()
            if not written
            or any(not fresh(v) or any(u is not w and u in live for u in v.users) for v in written)
        ]
        before = len(live)
        while keep:
            node = keep.pop()
            if node not in live:
                live.add(node)
                keep.extend(node.all_input_nodes)
        if len(live) == before:
            return {n.name for n in live}


@settings(max_examples=60, deadline=None)
@given(random_graphs())
def test_random_graphs_dce_keeps_exactly_what_is_live(gm):
    inputs = random_graph_inputs()
    live = live_nodes(gm)
    # (a guarded write goes only with the fresh value it writes, which nothing live reads)
    guarded = Counter({name: n for name, n in guarded_nodes(gm).items() if name in live})
    result = run_passes(gm, "dce")
    assert_same_effects(gm, result.module, inputs)
    assert guarded_nodes(result.module) == guarded
    assert {n.name for n in result.module.graph.nodes} == live
    assert result.records[0].changed is (stats(result, "dce")["removed"] > 0)
    assert run_passes(result.module, "dce").changed is False
