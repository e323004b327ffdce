"""Alias analysis: storage classes, written-ness through views, and storage versions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.ir.alias import AliasAnalysis
from tests.passes_helpers import Fn, Fn2, capture


def analyze(fn, arity: int = 1) -> tuple[AliasAnalysis, dict[str, fx.Node]]:
    gm = fx.symbolic_trace(Fn(fn) if arity == 1 else Fn2(fn))
    return AliasAnalysis(gm), {n.name: n for n in gm.graph.nodes}


def test_a_read_after_a_write_through_a_view_has_a_newer_version():
    def f(x):
        a = x + 1
        x.view(-1).mul_(2)
        return a, x + 1

    alias, n = analyze(f)
    assert alias.version(n["x"], at=n["add"]) == 0
    assert alias.version(n["x"], at=n["add_1"]) == 1
    assert alias.is_written(n["x"]) and alias.is_written(n["view"])
    assert alias.storage_class(n["view"]) is alias.storage_class(n["x"])
    assert not alias.is_written(n["add"]) and not alias.is_written(n["add_1"])
    assert alias.writers(n["x"]) == [alias.position[n["mul_"]]]


def test_versions_count_every_earlier_write():
    def f(x):
        y = x * 2
        a = y + 1
        y.add_(1)
        b = y + 1
        y.view(-1).mul_(3)
        return a, b, y + 1

    alias, n = analyze(f)
    y = n["mul"]
    assert [alias.version(y, at=n[k]) for k in ("add", "add_1", "add_2")] == [0, 1, 2]
    assert alias.version(y, at=n["add_"]) == 0  # a write does not count itself
    assert len(alias.writers(y)) == 2
    assert not alias.is_written(n["x"])  # x * 2 is a new tensor: x itself is never written


def test_writes_through_chains_of_views_reach_the_base():
    def f(x):
        y = x * 2
        v = y.view(-1)
        w = v.view(2, -1)[0]
        w.mul_(2)
        return y

    alias, n = analyze(f)
    base = n["mul"]
    for name in ("view", "view_1", "getitem", "mul_"):
        assert alias.storage_class(n[name]) is alias.storage_class(base), name
    assert alias.is_written(base)
    assert alias.storage_class(base) is base  # the earliest node represents its class


def test_writes_through_tensor_attribute_views():
    # Regression: x.T was not a view; the write through it went unnoticed.
    def f(x):
        a = x + 1
        x.T.mul_(2)
        return a, x + 1

    alias, n = analyze(f)
    assert alias.is_written(n["x"])
    assert alias.version(n["x"], at=n["add"]) == 0
    assert alias.version(n["x"], at=n["add_1"]) == 1


def test_pure_results_are_separate_unwritten_classes():
    alias, n = analyze(lambda x, y: (torch.relu(x) + y, torch.sigmoid(x)), 2)
    classes = {alias.storage_class(n[k]) for k in ("x", "y", "relu", "add", "sigmoid")}
    assert len(classes) == 5
    assert not any(alias.is_written(node) for node in n.values())
    assert all(alias.writers(node) == [] for node in n.values())


def test_writing_one_input_joins_all_inputs():
    # The caller may pass the same tensor twice: a write into x may be a write into y.
    def f(x, y):
        a = y + 1
        x.add_(1)
        return a, y + 1

    alias, n = analyze(f, 2)
    assert alias.storage_class(n["x"]) is alias.storage_class(n["y"])
    assert alias.is_written(n["y"])
    assert alias.version(n["y"], at=n["add"]) == 0
    assert alias.version(n["y"], at=n["add_1"]) == 1


def test_inputs_stay_apart_when_no_input_is_written():
    def f(x, y):
        z = x * 1
        z.add_(1)
        return z, y + 1

    alias, n = analyze(f, 2)
    assert alias.storage_class(n["x"]) is not alias.storage_class(n["y"])
    assert not alias.is_written(n["x"]) and not alias.is_written(n["y"])
    assert alias.is_written(n["mul"])


def test_out_argument_and_inplace_flag_are_writes():
    def f(x, buf):
        a = buf + 1
        torch.add(x, x, out=buf)
        y = x * 2
        F.relu(y, inplace=True)
        return a, buf + 1, y

    alias, n = analyze(f, 2)
    buf = n["y"]  # Fn2 names its inputs x and y
    assert alias.version(buf, at=n["add"]) == 0
    assert alias.version(buf, at=n["add_2"]) == 1  # add_1 is the torch.add(out=) itself
    assert alias.is_written(n["mul"])  # F.relu(y, inplace=True) writes y


def test_unknown_ops_may_write_and_alias_every_input():
    def f(x):
        y = x * 2
        a = y + 1
        z = torch.cosh(y)  # not in the op table: assumed to write and alias y
        return a, y + 1, z

    alias, n = analyze(f)
    assert alias.storage_class(n["cosh"]) is alias.storage_class(n["mul"])
    assert alias.is_written(n["mul"])
    assert alias.version(n["mul"], at=n["add"]) == 0
    assert alias.version(n["mul"], at=n["add_1"]) == 1


def test_training_batch_norm_function_writes_its_running_stats():
    # Regression: F.batch_norm(training=True) writes running_mean/var in place.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mean", torch.zeros(4))
            self.register_buffer("var", torch.ones(4))

        def forward(self, x):
            return F.batch_norm(x, self.mean, self.var, training=True)

    gm = fx.symbolic_trace(M())
    alias = AliasAnalysis(gm)
    n = {node.name: node for node in gm.graph.nodes}
    assert alias.is_written(n["mean"]) and alias.is_written(n["var"])


def test_exported_input_mutation_is_a_write_through_copy():
    def f(x):
        a = x + 1
        x.mul_(2)
        return a

    gm = capture(Fn(f), (torch.randn(2, 3),), "export")
    alias = AliasAnalysis(gm)
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (copy,) = [n for n in gm.graph.nodes if "copy_" in str(n.target)]
    assert alias.is_written(x)
    assert alias.writers(x) == [alias.position[copy]]


def test_positions_follow_graph_order():
    alias, n = analyze(lambda x: torch.relu(x) + 1)
    assert [alias.position[node] for node in n.values()] == list(range(len(n)))
