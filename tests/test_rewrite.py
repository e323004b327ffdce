"""One vocabulary for passes: ops.args / ops.emit / ops.set_args, the Rewrite rule base,
the safety questions, nested pipelines and the ATen-level boundary check."""

from __future__ import annotations

import operator
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt import GraphOptimizer
from fxopt.errors import InputMismatchError, PassError
from fxopt.ir import ops
from fxopt.ir.safety import Safety
from fxopt.passes import Pass, PassManager, PassResult, Plan, Rewrite
from tests.passes_helpers import MODES, Fn, capture

EXAMPLE = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "05_write_a_pass.py"))
MulByTwoToAdd = EXAMPLE["MulByTwoToAdd"]


# --- ops.args: one name for every spelling ------------------------------------------------


def _leaky(x):
    return F.leaky_relu(x, 0.2) + torch.nn.functional.leaky_relu(x, negative_slope=0.2)


@pytest.mark.parametrize("mode", MODES)
def test_args_reads_every_spelling_by_name(mode):
    gm = capture(Fn(_leaky), (torch.randn(2, 3),), mode)
    found = [ops.args(n, gm) for n in ops.calls(gm, "leaky_relu")]
    assert len(found) == 2
    assert all(a["negative_slope"] == 0.2 for a in found)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x * 2,
        lambda x: torch.mul(x, 2),
        lambda x: x.mul(2),
        lambda x: x.__mul__(2),
    ],
    ids=["operator", "torch", "method", "dunder"],
)
@pytest.mark.parametrize("mode", MODES)
def test_args_of_mul_names_its_operands(fn, mode):
    gm = capture(Fn(fn), (torch.randn(2, 3),), mode)
    (mul,) = ops.calls(gm, "mul")
    args = ops.args(mul, gm)
    assert args["other"] == 2 and args["input"].op == "placeholder"


def test_args_of_modules_are_their_attributes():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, groups=1), nn.Hardtanh(-2.0, 3.0))
    gm = fx.symbolic_trace(model)
    conv, hardtanh = (n for n in gm.graph.nodes if n.op == "call_module")
    assert ops.args(conv, gm)["weight"] is model[0].weight
    assert ops.args(conv, gm)["stride"] == (2, 2)
    assert (ops.args(hardtanh, gm)["min_val"], ops.args(hardtanh, gm)["max_val"]) == (-2.0, 3.0)


def test_args_spreads_method_varargs_and_fills_defaults():
    gm = fx.symbolic_trace(lambda x: (x.view(2, -1), x.permute(1, 0), x.sum(1), x.float()))
    view, permute, total, cast = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert ops.args(view)["size"] == [2, -1]
    assert ops.args(permute)["dims"] == [1, 0]
    assert ops.args(total)["dim"] == [1] and ops.args(total)["keepdim"] is False
    assert ops.args(cast)["dtype"] is torch.float32


def test_args_is_none_for_what_it_cannot_bind():
    gm = fx.symbolic_trace(lambda x: x.cpu())
    (cpu,) = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert ops.args(cpu) is None


def test_set_args_keeps_the_nodes_own_spelling():
    gm = fx.symbolic_trace(lambda x, w: F.conv2d(x, w, None, 1, 1))
    (conv,) = ops.calls(gm, "conv")
    _, w = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ops.set_args(conv, bias=w, groups=1)
    assert conv.args[2] is w  # given by position: stays positional
    assert conv.kwargs == {"groups": 1}  # left at its default: added as a keyword
    with pytest.raises(ValueError, match="no argument 'nope'"):
        ops.set_args(conv, nope=1)


# --- ops.emit: the spelling of the graph's level --------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_emit_builds_the_levels_spelling_with_its_value(mode):
    gm = capture(Fn(lambda x: x * 2), (torch.randn(2, 3),), mode)
    (mul,) = ops.calls(gm, "mul")
    x = ops.args(mul, gm)["input"]
    add = ops.emit(gm.graph, "add", x, x, like=mul)
    if mode == "export":
        assert add.target is torch.ops.aten.add.Tensor
        assert tuple(add.meta["val"].shape) == (2, 3)
    else:
        assert add.target is operator.add
    assert add.next is mul  # inserted just before the node it is like
    with pytest.raises(ValueError, match="not a canonical op name"):
        ops.emit(gm.graph, "no-such-op", x)


@pytest.mark.parametrize("mode", MODES)
def test_emit_builds_an_aten_overload_or_its_in_place_form_at_either_level_when_asked(mode):
    # fxopt's kernels are ATen calls in graphs of both levels (cpu_kernels' eager ReLU
    # after a fused conv, SDPA): level="aten" spells them so without torch.ops.aten.
    gm = capture(Fn(lambda x: torch.relu(x)), (torch.randn(2, 3),), mode)
    (relu,) = ops.calls(gm, "relu")
    with gm.graph.inserting_after(relu):
        clamped = ops.emit(gm.graph, "hardtanh_", relu, 0.0, 6.0, level="aten")
        copied = ops.emit(gm.graph, "to", clamped, device=torch.device("cpu"), level="aten")
    assert clamped.target is torch.ops.aten.hardtanh_.default
    assert copied.target is torch.ops.aten._to_copy.default
    assert ops.info(clamped, gm).mutates == (0,)
    with pytest.raises(ValueError, match=r"no ATen op aten\.convolution_"):
        ops.emit(gm.graph, "conv_", relu, level="aten")
    with pytest.raises(ValueError, match="level must be"):
        ops.emit(gm.graph, "relu", relu, level="onnx")


# --- Rewrite: a rule on both levels -------------------------------------------------------


class Doubler(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) * 2 + x.mul(3)


@pytest.mark.parametrize("mode", MODES)
def test_the_tutorial_rule_works_on_both_levels(mode):
    model = Doubler()
    optimizer = GraphOptimizer(model, torch.randn(3, 4), mode=mode)
    gm = optimizer.optimize(passes=[MulByTwoToAdd(), "dce"])  # verified against the model
    record = optimizer.pipeline.records[0]
    assert record.stats == {"rewritten": 1}
    assert [s.reason for s in record.skipped] == ["not a multiplication by 2"]
    assert sum(1 for _ in ops.calls(gm, "mul")) == 1
    other = torch.randn(7, 4)  # another batch: eager's answer
    torch.testing.assert_close(gm(other), model(other))
    with pytest.raises(InputMismatchError):
        gm(torch.randn(7, 5))


class _DropoutTwice(Rewrite):
    name, op = "dropout-twice", "dropout"

    def rewrite(self, graph, node, args):  # pragma: no cover (never reached: refused)
        raise AssertionError("a random node must not be rewritten")


def test_rewrite_refuses_random_and_in_place_nodes_with_the_reason():
    gm = fx.symbolic_trace(Fn(lambda x: F.dropout(x, 0.5, True) + F.relu(x, inplace=True)))
    result = _DropoutTwice()(gm)
    assert not result.changed
    reasons = [s.reason for s in result.skipped]
    assert reasons == ["'dropout' is random (each call draws new numbers)"]


# --- the ATen-level boundary ----------------------------------------------------------------


class _TorchLevelAdd(Pass[Plan]):
    """The old tutorial pass: rewrites the target to operator.add whatever the level."""

    name = "torch-level-add"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        nodes = list(ops.calls(gm, "mul"))
        for node in nodes:
            node.target, node.args = operator.add, (node.args[0], node.args[0])
        return PassResult(changed=bool(nodes))


def test_a_torch_level_rewrite_of_an_export_graph_is_refused_naming_the_pass():
    gm = capture(Fn(lambda x: x * 2), (torch.randn(2, 3),), "export")
    with pytest.raises(PassError, match=r"torch-level-add.*aten-level"):
        PassManager([_TorchLevelAdd()]).run(gm)
    fx_gm = capture(Fn(lambda x: x * 2), (torch.randn(2, 3),), "fx")
    assert PassManager([_TorchLevelAdd()]).run(fx_gm).changed  # fine at the torch level


# --- safety and nesting -------------------------------------------------------------------------


def test_safety_says_why_a_copy_of_a_written_value_stays():
    def f(x):
        y = x.clone()
        y.add_(1)
        return y, x.relu(), x.relu()

    gm = fx.symbolic_trace(f)
    x, clone, add_, relu, relu_1 = [n for n in gm.graph.nodes if n.op != "output"]
    safety = Safety(gm)
    assert "written in place" in safety.why_not_replace(clone, x)
    assert "one tensor twice" in safety.why_not_merge(relu_1, relu)
    assert "writes into its input" in safety.why_not_remove(add_)
    assert safety.why_not_remove(relu) is None


def test_a_pipeline_nests_as_a_pass():
    gm = fx.symbolic_trace(lambda x: torch.relu(x) + torch.relu(x) + torch.sigmoid(x) * 0)
    cleanup = PassManager(["cse", "dce"], name="cleanup")
    result = PassManager(["remove-nops", cleanup]).run(gm)
    assert [r.name for r in result.records] == ["remove-nops", "cleanup"]
    assert result.records[1].changed and result.records[1].stats == {"runs": 2, "changed": 1}
    assert sum(1 for _ in ops.calls(result.module, "relu")) == 1
