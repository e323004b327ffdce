"""The canonical op table: one name for every spelling, and the traits passes rely on."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.ir import ops
from tests.passes_helpers import Fn, Fn2, capture

aten = torch.ops.aten
X = torch.randn(2, 4)


def opaque_helper(x):
    return x * 2


torch.fx.wrap("opaque_helper")


# -- building one node of each spelling -----------------------------------------------------


def traced(fn, arity: int = 1) -> fx.GraphModule:
    return fx.symbolic_trace(Fn(fn) if arity == 1 else Fn2(fn))


def only(gm: fx.GraphModule, pred=ops.is_compute) -> fx.Node:
    found = [n for n in gm.graph.nodes if pred(n)]
    assert len(found) == 1, f"expected one node, got {[n.format_node() for n in found]}"
    return found[0]


def module_node(*modules: nn.Module) -> tuple[fx.GraphModule, fx.Node]:
    gm = fx.symbolic_trace(nn.Sequential(*modules))
    return gm, only(gm, lambda n: n.op == "call_module")


def fx_node(fn, arity: int = 1, pred=ops.is_compute) -> tuple[fx.GraphModule, fx.Node]:
    gm = traced(fn, arity)
    return gm, only(gm, pred)


def aten_of(packet: str):
    return lambda n: (
        isinstance(n.target, torch._ops.OpOverload) and (n.target.overloadpacket.__name__ == packet)
    )


def exported(model: nn.Module, packet: str, inputs=(X,)) -> tuple[fx.GraphModule, fx.Node]:
    gm = capture(model, inputs, "export")
    return gm, only(gm, aten_of(packet))


def handmade(target, *args, **kwargs) -> tuple[fx.GraphModule, fx.Node]:
    """One call of ``target``; the strings "x", "y", "w", "b", "rm", "rv" become inputs."""
    graph = fx.Graph()
    inputs = {name: graph.placeholder(name) for name in ("x", "y", "w", "b", "rm", "rv")}

    def resolve(value):
        return inputs.get(value, value) if isinstance(value, str) else value

    node = graph.call_function(
        target, tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}
    )
    graph.output(node)
    return fx.GraphModule(nn.Module(), graph), node


def info(built: tuple[fx.GraphModule, fx.Node]) -> ops.OpInfo:
    gm, node = built
    return ops.info(node, gm)


def bn(train: bool, **kwargs) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(4, **kwargs).train(train)


# -- one canonical name for every spelling -------------------------------------------------

SPELLINGS = {
    "relu": [
        ("nn.ReLU", lambda: module_node(nn.ReLU())),
        ("F.relu", lambda: fx_node(F.relu)),
        ("torch.relu", lambda: fx_node(torch.relu)),
        ("x.relu()", lambda: fx_node(lambda x: x.relu())),
        ("F.relu(inplace=True)", lambda: fx_node(lambda x: F.relu(x, inplace=True))),
        ("torch.relu_", lambda: fx_node(torch.relu_)),
        ("x.relu_()", lambda: fx_node(lambda x: x.relu_())),
        ("aten export", lambda: exported(Fn(F.relu), "relu")),
        ("aten.relu_", lambda: handmade(aten.relu_.default, "x")),
    ],
    "add": [
        ("operator.add", lambda: fx_node(lambda x, y: x + y, 2)),
        ("radd", lambda: fx_node(lambda x: 1 + x)),
        ("torch.add", lambda: fx_node(torch.add, 2)),
        ("x.add(y)", lambda: fx_node(lambda x, y: x.add(y), 2)),
        ("x.add_(y)", lambda: fx_node(lambda x, y: x.add_(y), 2)),
        ("operator.iadd", lambda: handmade(operator.iadd, "x", "y")),
        ("aten export", lambda: exported(Fn2(torch.add), "add", (X, X))),
        ("aten.add.Scalar", lambda: handmade(aten.add.Scalar, "x", 2)),
        ("aten.add_.Tensor", lambda: handmade(aten.add_.Tensor, "x", "y")),
    ],
    "conv": [
        ("nn.Conv1d", lambda: module_node(nn.Conv1d(2, 2, 3))),
        ("nn.Conv2d", lambda: module_node(nn.Conv2d(2, 2, 3))),
        ("nn.Conv3d", lambda: module_node(nn.Conv3d(2, 2, 3))),
        ("F.conv2d", lambda: fx_node(F.conv2d, 2)),
        ("torch.conv2d", lambda: fx_node(torch.conv2d, 2)),
        (
            "aten export",
            lambda: exported(nn.Conv2d(2, 2, 3), "convolution", (torch.randn(1, 2, 5, 5),)),
        ),
    ],
    "linear": [
        ("nn.Linear", lambda: module_node(nn.Linear(4, 4))),
        ("F.linear", lambda: fx_node(F.linear, 2)),
        ("aten.linear", lambda: handmade(aten.linear.default, "x", "w", "b")),
    ],
    "batch_norm": [
        ("nn.BatchNorm1d", lambda: module_node(bn(False))),
        ("nn.BatchNorm2d", lambda: module_node(nn.BatchNorm2d(4))),
        ("F.batch_norm", lambda: fx_node(lambda x: F.batch_norm(x, None, None, training=True))),
        (
            "torch.batch_norm",
            lambda: handmade(torch.batch_norm, "x", "w", "b", "rm", "rv", False, 0.1, 1e-5, False),
        ),
        ("aten eval export", lambda: exported(bn(False), "_native_batch_norm_legit_no_training")),
        ("aten train export", lambda: exported(bn(True), "_native_batch_norm_legit_functional")),
        (
            "aten.batch_norm",
            lambda: handmade(
                aten.batch_norm.default, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5, False
            ),
        ),
        (
            "aten._native_batch_norm_legit",
            lambda: handmade(
                aten._native_batch_norm_legit.default, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5
            ),
        ),
    ],
}


@pytest.mark.parametrize(
    ("canonical", "build"),
    [
        pytest.param(name, build, id=f"{name}-{spelling}")
        for name, spellings in SPELLINGS.items()
        for spelling, build in spellings
    ],
)
def test_every_spelling_has_the_canonical_name(canonical, build):
    gm, node = build()
    assert ops.info(node, gm).name == canonical
    assert ops.is_call(node, canonical, gm)
    assert node in list(ops.calls(gm, canonical))
    assert ops.info(node, gm).known


def test_canonical_names_are_sorted_and_cover_the_common_ops():
    names = ops.canonical_names()
    assert names == sorted(names)
    assert {"relu", "add", "conv", "linear", "batch_norm", "dropout", "view"} <= set(names)


def test_non_compute_nodes_are_not_calls():
    gm = traced(torch.relu)
    placeholder, relu, output = list(gm.graph.nodes)
    assert not ops.is_compute(placeholder) and not ops.is_compute(output)
    assert ops.info(placeholder).name == "placeholder"
    assert ops.info(placeholder).compute is False
    assert not ops.is_call(placeholder, "placeholder")
    assert ops.is_call(relu, "relu") and not ops.is_call(relu, "sigmoid")


def test_call_module_needs_the_graph_module():
    _, node = module_node(nn.ReLU())
    assert ops.info(node).name == "relu"  # looked up in the module owning the graph
    graph = fx.Graph()  # a graph no module owns
    orphan = graph.call_module("relu", (graph.placeholder("x"),))
    with pytest.raises(ValueError, match="needs the GraphModule"):
        ops.info(orphan)


# -- traits: in place ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "written"),
    [
        pytest.param(lambda: fx_node(lambda x: x.add_(1)), "x", id="x.add_(1)"),
        pytest.param(lambda: fx_node(lambda x: x.mul_(2)), "x", id="x.mul_(2)"),
        pytest.param(
            lambda: fx_node(lambda x: F.relu(x, inplace=True)), "x", id="F.relu(inplace=True)"
        ),
        pytest.param(lambda: handmade(F.relu, "x", True), "x", id="F.relu(x, True)"),
        pytest.param(lambda: fx_node(torch.relu_), "x", id="torch.relu_"),
        pytest.param(
            lambda: module_node(nn.ReLU(inplace=True)), "input_1", id="nn.ReLU(inplace=True)"
        ),
        pytest.param(
            lambda: fx_node(lambda x, y: torch.add(x, x, out=y), 2), "y", id="torch.add(out=)"
        ),
        pytest.param(lambda: handmade(operator.iadd, "x", "y"), "x", id="operator.iadd"),
        pytest.param(lambda: handmade(operator.setitem, "x", 0, "y"), "x", id="operator.setitem"),
        pytest.param(lambda: handmade(aten.add_.Tensor, "x", "y"), "x", id="aten.add_"),
        pytest.param(lambda: handmade(aten.add.out, "x", "x", out="y"), "y", id="aten.add.out"),
        pytest.param(lambda: handmade(aten.copy_.default, "x", "y"), "x", id="aten.copy_"),
        pytest.param(
            lambda: fx_node(lambda x: F.dropout(x, 0.5, True, True)),
            "x",
            id="F.dropout(inplace=True)",
        ),
    ],
)
def test_inplace_calls_say_what_they_write(build, written):
    gm, node = build()
    op = ops.info(node, gm)
    assert op.inplace
    assert not op.pure and not op.removable and not op.mergeable
    assert op.view  # the result aliases what was written
    assert [n.name for n in ops.mutated_nodes(node, op)] == [written]


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: fx_node(F.relu), id="F.relu"),
        pytest.param(lambda: fx_node(lambda x: F.relu(x, inplace=False)), id="inplace=False"),
        pytest.param(lambda: module_node(nn.ReLU()), id="nn.ReLU()"),
        pytest.param(lambda: fx_node(lambda x: x.add(1)), id="x.add(1)"),
        pytest.param(lambda: fx_node(lambda x, y: torch.add(x, y, out=None), 2), id="out=None"),
        pytest.param(lambda: handmade(aten.add.Tensor, "x", "y"), id="aten.add"),
    ],
)
def test_functional_calls_are_pure_and_removable(build):
    gm, node = build()
    op = ops.info(node, gm)
    assert not op.inplace and op.mutates == ()
    assert op.pure and op.known and op.removable and op.mergeable
    assert list(ops.mutated_nodes(node, op)) == []


# -- traits: random ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "random"),
    [
        pytest.param(lambda: fx_node(torch.randn_like), True, id="torch.randn_like"),
        pytest.param(lambda: fx_node(torch.rand_like), True, id="torch.rand_like"),
        pytest.param(lambda: fx_node(lambda x: x.bernoulli()), True, id="x.bernoulli()"),
        pytest.param(lambda: handmade(aten.randn_like.default, "x"), True, id="aten.randn_like"),
        pytest.param(lambda: fx_node(F.dropout), True, id="F.dropout default"),
        pytest.param(
            lambda: fx_node(lambda x: F.dropout(x, 0.5, True)), True, id="F.dropout training"
        ),
        pytest.param(
            lambda: fx_node(lambda x: F.dropout(x, 0.5, False)), False, id="F.dropout eval"
        ),
        pytest.param(lambda: fx_node(lambda x: F.dropout(x, p=0.0)), False, id="F.dropout p=0"),
        pytest.param(
            lambda: handmade(torch.dropout, "x", 0.5, True), True, id="torch.dropout train"
        ),
        pytest.param(
            lambda: handmade(torch.dropout, "x", 0.5, False), False, id="torch.dropout eval"
        ),
        pytest.param(lambda: module_node(nn.Dropout(0.5).train()), True, id="nn.Dropout train"),
        pytest.param(lambda: module_node(nn.Dropout(0.5).eval()), False, id="nn.Dropout eval"),
        pytest.param(lambda: module_node(nn.Dropout(0.0).train()), False, id="nn.Dropout p=0"),
        pytest.param(
            lambda: exported(nn.Dropout(0.5).train(), "native_dropout"),
            True,
            id="export train dropout",
        ),
        pytest.param(
            lambda: handmade(aten.native_dropout.default, "x", 0.5, True),
            True,
            id="aten.native_dropout train",
        ),
        pytest.param(
            lambda: handmade(aten.native_dropout.default, "x", 0.5, False),
            False,
            id="aten.native_dropout eval",
        ),
        pytest.param(
            lambda: handmade(aten.dropout.default, "x", 0.5, True), True, id="aten.dropout train"
        ),
        pytest.param(
            lambda: handmade(aten.dropout.default, "x", 0.5, False), False, id="aten.dropout eval"
        ),
    ],
)
def test_random_ops_and_only_active_dropout_are_random(build, random):
    op = info(build())
    assert op.random is random
    assert op.removable is not random and op.mergeable is not random
    if random:
        assert not op.pure


# -- traits: stateful ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "stateful"),
    [
        pytest.param(lambda: module_node(bn(True)), True, id="BN train"),
        pytest.param(lambda: module_node(bn(False)), False, id="BN eval"),
        pytest.param(
            lambda: module_node(bn(True, track_running_stats=False)),
            False,
            id="BN train no running stats",
        ),
        pytest.param(
            lambda: handmade(F.batch_norm, "x", "rm", "rv", training=True),
            True,
            id="F.batch_norm train",
        ),
        pytest.param(
            lambda: handmade(F.batch_norm, "x", "rm", "rv"), False, id="F.batch_norm eval"
        ),
        pytest.param(
            lambda: handmade(F.batch_norm, "x", None, None, training=True),
            False,
            id="F.batch_norm train no running stats",
        ),
        pytest.param(
            lambda: handmade(torch.batch_norm, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5, False),
            True,
            id="torch.batch_norm train",
        ),
        pytest.param(
            lambda: handmade(
                aten.batch_norm.default, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5, False
            ),
            True,
            id="aten.batch_norm train",
        ),
        pytest.param(
            lambda: handmade(
                aten.batch_norm.default, "x", "w", "b", "rm", "rv", False, 0.1, 1e-5, False
            ),
            False,
            id="aten.batch_norm eval",
        ),
        pytest.param(
            lambda: handmade(
                aten._native_batch_norm_legit.default, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5
            ),
            True,
            id="aten._native_batch_norm_legit train",
        ),
        pytest.param(
            lambda: exported(bn(False), "_native_batch_norm_legit_no_training"),
            False,
            id="export BN eval",
        ),
    ],
)
def test_training_batch_norm_with_running_stats_is_stateful(build, stateful):
    op = info(build())
    assert op.stateful is stateful
    assert op.removable is not stateful and op.mergeable is not stateful


def test_functional_batch_norm_in_training_writes_its_running_stats():
    # Regression: F.batch_norm(training=True) updates running_mean/var in place; it was
    # called pure, so dce deleted it (stats never updated) and cse could merge two calls.
    for build, written in [
        (lambda: handmade(F.batch_norm, "x", "rm", "rv", training=True), ["rm", "rv"]),
        (
            lambda: handmade(torch.batch_norm, "x", "w", "b", "rm", "rv", True, 0.1, 1e-5, False),
            ["rm", "rv"],
        ),
        (
            lambda: handmade(
                aten.batch_norm.default, "x", "w", "b", "rm", None, True, 0.1, 1e-5, False
            ),
            ["rm"],
        ),
    ]:
        gm, node = build()
        op = ops.info(node, gm)
        assert [n.name for n in ops.mutated_nodes(node, op)] == written


def test_exported_training_batch_norm_writes_stats_through_copy():
    gm = capture(bn(True), (X,), "export")
    functional = only(gm, aten_of("_native_batch_norm_legit_functional"))
    assert ops.info(functional, gm).pure  # new running stats are returned, not written...
    copies = [n for n in gm.graph.nodes if aten_of("copy_")(n)]
    assert copies and all(ops.info(n, gm).inplace for n in copies)  # ...copy_ writes them


# -- traits: view ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "view"),
    [
        pytest.param(lambda: fx_node(lambda x: x.view(-1)), True, id="x.view"),
        pytest.param(lambda: fx_node(lambda x: x.reshape(-1)), True, id="x.reshape"),
        pytest.param(lambda: fx_node(lambda x: torch.reshape(x, (-1,))), True, id="torch.reshape"),
        pytest.param(lambda: fx_node(lambda x: x.transpose(0, 1)), True, id="x.transpose"),
        pytest.param(lambda: fx_node(lambda x: x[0]), True, id="x[0]"),
        pytest.param(lambda: fx_node(lambda x: x.T), True, id="x.T"),
        pytest.param(lambda: fx_node(lambda x: x.mT), True, id="x.mT"),
        pytest.param(lambda: fx_node(lambda x: x.detach()), True, id="x.detach"),
        pytest.param(lambda: handmade(aten.view.default, "x", [-1]), True, id="aten.view"),
        pytest.param(lambda: handmade(aten.t.default, "x"), True, id="aten.t"),
        pytest.param(
            lambda: exported(Fn(lambda x: x.view(-1) + 1), "view"), True, id="export view"
        ),
        pytest.param(lambda: fx_node(torch.relu), False, id="relu"),
        pytest.param(lambda: fx_node(lambda x: x.clone()), False, id="clone"),
        pytest.param(lambda: handmade(aten.clone.default, "x"), False, id="aten.clone"),
    ],
)
def test_view_ops_may_alias_their_input(build, view):
    op = info(build())
    assert op.view is view
    assert op.pure and not op.inplace


def test_tensor_attribute_views_are_views():
    # Regression: getattr(x, "T") was not a view, so a write through x.T did not count as a
    # write into x and cse merged `x + 1` before and after `x.T.mul_(2)`.
    gm, node = fx_node(lambda x: x.T)
    assert node.target is getattr
    assert ops.info(node, gm).view


# -- traits: unknown ops ----------------------------------------------------------------------


class Opaque(nn.Module):
    def forward(self, x):
        return x * 3


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: fx_node(torch.cosh), id="torch.cosh (not in table)"),
        pytest.param(lambda: fx_node(lambda x: x.cosh()), id="x.cosh()"),
        pytest.param(lambda: fx_node(lambda x: opaque_helper(x)), id="fx.wrap'ed python function"),
        pytest.param(lambda: module_node(nn.Softplus()), id="nn.Softplus module"),
        pytest.param(lambda: handmade(aten.relu, "x"), id="aten overload packet"),
        pytest.param(lambda: module_node(_hooked(nn.ReLU())), id="module with a hook"),
    ],
)
def test_unknown_ops_are_impure_and_may_write_and_alias_all_inputs(build):
    gm, node = build()
    op = ops.info(node, gm)
    assert op.known is False
    assert not op.pure and not op.removable and not op.mergeable
    assert op.view and op.inplace
    assert list(ops.mutated_nodes(node, op)) == ops.tensor_args(node)


def _hooked(module: nn.Module) -> nn.Module:
    module.register_forward_hook(lambda *_: None)
    return module


def test_custom_leaf_module_is_unknown():
    class Tracer(fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, Opaque) or super().is_leaf_module(m, qualname)

    root = nn.Sequential(Opaque())
    gm = fx.GraphModule(root, Tracer().trace(root))
    node = only(gm, lambda n: n.op == "call_module")
    assert ops.info(node, gm).name == "Opaque"
    assert ops.info(node, gm).known is False


# -- traits: commutative --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "commutative"),
    [
        pytest.param(lambda: fx_node(lambda x, y: x + y, 2), True, id="x + y"),
        pytest.param(lambda: fx_node(lambda x, y: x * y, 2), True, id="x * y"),
        pytest.param(lambda: fx_node(torch.maximum, 2), True, id="torch.maximum"),
        pytest.param(lambda: handmade(aten.add.Tensor, "x", "y"), True, id="aten.add"),
        pytest.param(lambda: fx_node(lambda x, y: x - y, 2), False, id="x - y"),
        pytest.param(lambda: fx_node(lambda x, y: x @ y, 2), False, id="x @ y"),
        pytest.param(
            lambda: fx_node(lambda x, y: torch.add(x, y, alpha=2), 2), False, id="torch.add alpha"
        ),
        pytest.param(
            lambda: handmade(aten.add.Tensor, "x", "y", alpha=2), False, id="aten.add alpha"
        ),
    ],
)
def test_commutativity(build, commutative):
    assert info(build()).commutative is commutative


def test_sequence_concatenation_does_not_commute():
    # Regression: `s + (1,)` and `(1,) + s` on a shape are both operator.add; they were
    # called commutative, so cse merged two different shapes.
    model = Fn(lambda x: (x.reshape(x.shape + (1,)), x.reshape((1,) + x.shape)))  # noqa: RUF005
    for gm in (fx.symbolic_trace(model), capture(model, (X,), "fx")):
        adds = [n for n in gm.graph.nodes if n.target is operator.add]
        assert len(adds) == 2
        assert not any(ops.info(n, gm).commutative for n in adds)
    gm, node = fx_node(lambda x: x.shape + x.shape, pred=lambda n: n.target is operator.add)
    assert not ops.info(node, gm).commutative  # shapes without metadata: getattr 'shape'
    gm, node = fx_node(lambda x: x.size() + x.size(), pred=lambda n: n.target is operator.add)
    assert not ops.info(node, gm).commutative


@pytest.mark.parametrize(
    ("args", "kwargs", "random"),
    [
        ((0.0,), {}, False),
        ((0,), {}, False),
        ((0.1,), {}, True),
        ((), {}, False),
        ((), {"dropout_p": 0.0}, False),
        ((), {"dropout_p": 0.2}, True),
    ],
)
def test_attention_is_random_only_with_dropout(args, kwargs, random):
    # Every SDPA overload carries the nondeterministic_seeded tag, for its dropout.
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    graph = fx.Graph()
    q = graph.placeholder("q")
    node = graph.call_function(op, (q, q, q, *args), kwargs)
    info = ops.info(node)
    assert info.random is random and info.pure is (not random)
