"""The seed's milestone criteria and the GraphOptimizer / fxopt.optimize contract."""

import copy
import operator

import pytest
import torch
from torch import nn

import fxopt
from fxopt import GraphOptimizer
from fxopt.errors import FxoptError, PassError, VerificationError
from fxopt.ir import ops
from fxopt.passes import Pass, PassResult, Plan
from tests.contract import OPTIMIZE_KEYS
from tests.models.seed import AddInsteadOfSub, RedundantModel, ResNetBlock, SimpleMLP

MODES = ["fx", "export"]


class AddToSub(Pass[Plan]):
    """A deliberately wrong pass: every add becomes a sub."""

    name = "add-to-sub"
    description = "wrong on purpose"

    def analyze(self, gm):
        return Plan()

    def transform(self, gm, plan):
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (operator.add, torch.add):
                node.target = operator.sub
                changed = True
            elif node.target == torch.ops.aten.add.Tensor:
                node.target = torch.ops.aten.sub.Tensor
                changed = True
        return PassResult(changed)


class Raises(Pass[Plan]):
    name = "raises"
    description = "fails"

    def analyze(self, gm):
        raise RuntimeError("analysis failed")


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model, state):
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("mode", MODES)
def test_no_passes_verifies(mode):
    x = torch.randn(4, 32)
    optimizer = GraphOptimizer(SimpleMLP(), x, mode=mode)
    gm = optimizer.optimize(passes=[])
    assert optimizer.verify_correctness(x)
    assert optimizer.verify_correctness(torch.randn(4, 32))
    torch.testing.assert_close(gm(x), SimpleMLP()(x) * 0 + optimizer.reference(x))


@pytest.mark.parametrize("mode", MODES)
def test_redundant_model_ends_with_one_relu_and_one_encoder_call(mode):
    x = torch.randn(2, 8)
    optimizer = GraphOptimizer(RedundantModel(), x, mode=mode)
    gm = optimizer.optimize(passes=["redundant_ops", "dce"])
    names = [ops.info(n, gm).name for n in gm.graph.nodes if ops.is_compute(n)]
    assert names.count("relu") == 1
    encoder_calls = names.count("linear") + names.count("addmm")
    assert encoder_calls == 1
    assert optimizer.verify_correctness(x)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("training", [False, True])
def test_resnet_block_with_batchnorm_verifies_and_state_is_untouched(mode, training):
    model = ResNetBlock().train(training)
    x = torch.randn(2, 4, 8, 8)
    state = _state(model)
    optimizer = GraphOptimizer(model, x, mode=mode)
    # torch.export's training graph writes BN statistics with copy_ into tensors autograd
    # saved, so its backward raises in torch itself (no fxopt pass involved): fx only there.
    gradients = mode == "fx" or not training
    gm = optimizer.optimize(passes=["cse", "dce"], gradients=gradients)
    gm_state = _state(gm)
    assert optimizer.verify_correctness(x)
    optimizer.benchmark(x, num_runs=2)
    _assert_unchanged(model, state)
    _assert_unchanged(gm, gm_state)  # verification and benchmarking ran on copies


@pytest.mark.parametrize("mode", MODES)
def test_wrong_pass_raises_verification_error_naming_it(mode):
    model = AddInsteadOfSub()
    inputs = (torch.randn(3), torch.randn(3))
    with pytest.raises(VerificationError) as info:
        GraphOptimizer(model, inputs, mode=mode).optimize(passes=["cse", AddToSub(), "dce"])
    error = info.value
    assert error.first_bad_pass == "add-to-sub"
    assert error.max_abs_error > 0
    assert "example inputs" in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_raising_pass_gives_pass_error_and_model_is_unchanged(mode):
    model = ResNetBlock()
    state = _state(model)
    with pytest.raises(PassError, match="raises"):
        GraphOptimizer(model, torch.randn(1, 4, 8, 8), mode=mode).optimize(passes=["cse", Raises()])
    _assert_unchanged(model, state)


def test_optimize_report_has_the_cli_keys():
    result = fxopt.optimize(RedundantModel().eval(), torch.randn(2, 8), benchmark_runs=3)
    report = result.report
    for key in OPTIMIZE_KEYS:
        assert key in report
    assert report["verified"] is True
    assert report["nodes_after"] < report["nodes_before"]
    assert set(report["latency_ms"]) == {"original", "optimized"}
    assert all(v > 0 for v in report["latency_ms"].values())
    from fxopt.passes import pipelines

    assert {p["name"] for p in report["passes"]} == set(pipelines.get("speed").pass_names())


def test_optimize_for_memory_gives_a_training_step_with_eager_gradients():
    torch.manual_seed(0)
    model, x = SimpleMLP(), torch.randn(8, 32)
    expected = copy.deepcopy(model)
    expected(x).sum().backward()
    step = GraphOptimizer(model, x).optimize_for_memory(memory_budget=0.9)
    loss = step(x)
    torch.testing.assert_close(loss, expected(x).sum())
    for ours, theirs in zip(model.parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad)
    assert step.plan.peak <= step.plan.budget_bytes


def test_verify_before_optimize_says_what_to_call():
    optimizer = GraphOptimizer(SimpleMLP(), torch.randn(1, 32))
    with pytest.raises(FxoptError, match="call optimize"):
        optimizer.verify_correctness(torch.randn(1, 32))


def test_optimize_for_speed_runs_the_preset():
    optimizer = GraphOptimizer(RedundantModel().eval(), torch.randn(2, 8))
    optimizer.optimize_for_speed(autotune=False)
    assert optimizer.pipeline is not None
    from fxopt.passes import pipelines

    preset = pipelines.get("speed").pass_names()
    assert [r.name for r in optimizer.pipeline.records[: len(preset)]] == preset


def test_dropout_model_in_training_mode_verifies_under_same_seed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.ReLU()).train()
    x = torch.randn(4, 8)
    optimizer = GraphOptimizer(model, x)
    optimizer.optimize(passes=["cse", "dce"])
    assert optimizer.last_check is not None and optimizer.last_check.ok


def test_api_mistakes_are_clear_errors():
    model, x = SimpleMLP().eval(), torch.randn(2, 32)
    if not torch.cuda.is_available():
        with pytest.raises(fxopt.UserInputError, match="device 'cuda' is not available"):
            GraphOptimizer(model, x, device="cuda")
    with pytest.raises(fxopt.UserInputError, match="unknown device"):
        GraphOptimizer(model, x, device="gpu0")
    optimizer = GraphOptimizer(model, x)
    with pytest.raises(fxopt.UserInputError, match=r"did you mean \['cse'\]"):
        optimizer.optimize(passes="cse")
    with pytest.raises(fxopt.UserInputError, match=r"did you mean \['cse'\]"):
        fxopt.optimize(model, x, passes="cse")
    with pytest.raises(fxopt.UserInputError, match="not both"):
        fxopt.optimize(model, x, passes=["cse"], preset="speed")
    optimizer.optimize(passes=["cse"])
    with pytest.raises(fxopt.UserInputError, match="num_runs must be a positive integer"):
        optimizer.benchmark(x, num_runs=0)
    with pytest.raises(fxopt.UserInputError, match="rtol must be a finite number"):
        optimizer.verify_correctness(x, rtol=float("nan"))
    with pytest.raises(fxopt.UserInputError, match="atol must be a finite number"):
        optimizer.verify_correctness(x, atol=-1.0)


def test_verify_correctness_on_a_refused_input_raises_the_mismatch():
    optimizer = GraphOptimizer(SimpleMLP().eval(), torch.randn(2, 32))
    optimizer.optimize(passes=["cse"])
    assert optimizer.verify_correctness(torch.randn(5, 32))  # another batch: dynamic
    with pytest.raises(fxopt.InputMismatchError):
        optimizer.verify_correctness(torch.randn(5, 31))


def test_the_reference_is_the_callers_model_run_isolated_and_never_changed():
    # No copy of the weights: the model itself is the reference, and every run of it is
    # isolated (a training BatchNorm's statistics and its counter stay as they were).
    x = torch.randn(4, 8)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    graph = torch.fx.symbolic_trace(plain)
    training = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).train()
    for model in (plain, graph, training):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        tensors = {k: (v, v._version) for k, v in model.state_dict(keep_vars=True).items()}
        opt = GraphOptimizer(model, x)
        opt.optimize(["cse"])
        assert opt.reference is model
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        # The same tensor objects, unchanged in place (version counters did not move).
        after = model.state_dict(keep_vars=True)
        assert all(after[k] is t and t._version == v for k, (t, v) in tensors.items())
