"""fxopt.remat end to end: capture, profile, rewrite, run, measure, errors, CLI."""

import copy
import json
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt import zoo
from fxopt.bench import StorageTracker
from fxopt.cli import main
from fxopt.errors import CaptureError, UserInputError
from fxopt.remat import BudgetError, backend, compile_step
from fxopt.remat.capture import tag_phases
from fxopt.remat.measure import boundary, measure_step, with_boundary_marker
from fxopt.remat.profile import profile, static_timeline
from fxopt.remat.rewrite import RECOMPUTED_FROM
from fxopt.remat.tags import BACKWARD, FORWARD, phase

aten = torch.ops.aten


def resnet():
    entry = zoo.create("resnet18", image=32, batch=4)
    x = entry.example_inputs[0]
    y = torch.arange(4) % 10
    return entry.model.train(), (x, y), lambda m, x, y: F.cross_entropy(m(x), y)


def bert():  # dropout 0.1 in training mode
    entry = zoo.create("bert", seq=16, batch=4)
    return entry.model.train(), entry.example_inputs, lambda m, i, a: m(i, a)[0].pow(2).mean()


@pytest.fixture(scope="module", params=[resnet, bert], ids=["resnet18-bn", "bert-dropout"])
def captured(request):
    model, inputs, loss_fn = request.param()
    start = copy.deepcopy(model)
    base = compile_step(model, loss_fn, inputs, memory_budget=1.0, profile_runs=1)
    return start, base, inputs, loss_fn


def eager_step(model, inputs, loss_fn):
    torch.manual_seed(7)
    loss = loss_fn(model, *inputs)
    loss.backward()
    return loss


def reachable(base, fraction):
    """A budget ``fraction`` of the way from the smallest peak greedy reaches to 1.0 (op
    temporaries put that floor far above 0 on models this small)."""
    from fxopt.remat.planners import greedy_sequence

    floor = min(sim.peak for _, sim in greedy_sequence(base.table)) / base.plan.baseline_peak
    return floor + fraction * (1.0 - floor) + 1e-6


@pytest.mark.parametrize(
    "planner, fraction",
    [
        ("greedy", 1.0),
        ("greedy", 0.5),
        ("greedy", 0.0),
        ("optimal", 0.3),
        ("every_n", 0.5),
        ("sqrt_n", 0.5),
    ],
)
def test_gradients_loss_and_statistics_match_eager(captured, planner, fraction):
    start, base, inputs, loss_fn = captured
    budget = min(1.0, reachable(base, fraction))
    try:
        step = base.replan(budget, planner, time_limit_s=10.0)
    except BudgetError as error:
        assert planner in ("every_n", "sqrt_n"), error  # budget-blind policies may miss
        return
    if budget < 1.0 and planner in ("greedy", "optimal"):
        assert step.plan.recompute and step.plan.peak <= step.plan.budget_bytes
    reference, mine = copy.deepcopy(start), copy.deepcopy(start)
    expected = eager_step(reference, inputs, loss_fn)
    runner = copy.copy(step)
    runner.model = mine
    runner.__init__(mine, step.joint, step.graph, step.table, step.plan, inputs, None)
    torch.manual_seed(7)
    loss = runner(*inputs)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(reference.named_parameters(), mine.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    # Running statistics are updated exactly once, as eager does.
    for (name, b), c in zip(reference.named_buffers(), mine.buffers()):
        torch.testing.assert_close(c, b, msg=name)


def test_rewriter_places_each_copy_once_before_its_first_backward_use(captured):
    _, base, _, _ = captured
    step = base.replan(reachable(base, 0.0), "greedy")
    nodes = list(step.graph.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    copies = [n for n in nodes if RECOMPUTED_FROM in n.meta]
    origins = [n.meta[RECOMPUTED_FROM] for n in copies]
    assert copies and len(origins) == len(set(origins))  # nothing recomputed twice
    by_name = {n.name: n for n in nodes}
    for c in copies:
        assert phase(c) == BACKWARD and c.users
        original = by_name[c.meta[RECOMPUTED_FROM]]
        assert phase(original) == FORWARD
        assert position[c] < min(position[u] for u in c.users)
        first_backward = min(position[n] for n in nodes if phase(n) == BACKWARD)
        assert position[c] >= first_backward
        # The forward original no longer feeds the backward (except through copies).
        assert all(phase(u) != BACKWARD or RECOMPUTED_FROM in u.meta for u in original.users)
    assert set(origins) <= set(step.plan.recompute)


def test_simulated_saved_bytes_match_the_profiler(captured):
    _, base, inputs, _ = captured
    step = base.replan(reachable(base, 0.3), "greedy")
    marked = copy.copy(step)
    marked.graph = with_boundary_marker(step.graph)
    measured = measure_step(lambda: marked(*inputs), step.model)
    assert measured.saved_bytes == step.plan.saved
    # Peak: the cost model counts op temporaries measured in one profiled run.
    assert abs(measured.peak_bytes - step.plan.peak) <= 0.05 * step.plan.peak


def tiny_joint():
    """A hand-built joint graph of ATen ops: forward sin/mul, backward cos/mul."""

    def f(x):
        a = aten.sin.default(x)
        b = aten.mul.Tensor(a, a)
        v = aten.view.default(b, [-1])
        loss = aten.sum.default(v)
        ga = aten.mul.Tensor(aten.cos.default(x), a)
        return loss, ga

    gm = fx.symbolic_trace(f)
    out = list(gm.graph.nodes)[-1]
    tag_phases(gm, forward_outputs=[out.args[0][0]])
    return gm


def test_profile_liveness_views_and_timeline_on_a_hand_built_graph():
    gm = tiny_joint()
    x = torch.randn(64, 64)
    table = profile(gm, [x], runs=1)
    names = [r.name for r in table.rows]
    sin, mul, view = (names.index(n) for n in ("sin_default", "mul_tensor", "view_default"))
    assert table.rows[view].owns == () and table.rows[view].refs == table.rows[mul].owns
    assert table.last_forward_use(sin) == mul
    cos = names.index("cos_default")
    assert table.first_backward_use(sin) == names.index("mul_tensor_1") > cos
    assert table.sources(mul) == (sin,)
    # Static timeline equals the live bytes a storage-counting dispatch mode sees after
    # every op when the generated code runs (no op here has temporaries).
    timeline = static_timeline(table)
    compute = [i for i, r in enumerate(table.rows) if r.phase in ("forward", "backward")]
    with StorageTracker([x]) as counter:
        gm(x)
    assert counter.after_op == [timeline[i] for i in compute]
    assert counter.peak == max(timeline)


def test_profile_times_each_op_signature_once_and_pools_repeated_blocks():
    from torch.utils._python_dispatch import TorchDispatchMode

    def f(x, y):
        a = aten.sin.default(x)  # three sins of one signature: x, a and b share a shape
        b = aten.sin.default(a)
        c = aten.sin.default(b)
        d = aten.sin.default(y)  # another shape: another signature, seen once
        return aten.add.Tensor(aten.sum.default(c), aten.sum.default(d)), c

    gm = fx.symbolic_trace(f)
    out = list(gm.graph.nodes)[-1]
    tag_phases(gm, forward_outputs=[out.args[0][0]])

    class CountSins(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is aten.sin.default:
                shape = tuple(args[0].shape)
                self.calls[shape] = self.calls.get(shape, 0) + 1
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(32, 32), torch.randn(8, 8)
    with CountSins() as counter:
        table = profile(gm, [x, y], runs=3)
    # Run 0 (recording) runs every node once; the timed run runs each node once, and the
    # lone (8, 8) sin twice more, so its signature has 3 samples like the other's.
    assert counter.calls == {(32, 32): 3 + 3, (8, 8): 1 + 3}
    times = {r.name: r.time_s for r in table.rows}
    assert times["sin_default"] == times["sin_default_1"] == times["sin_default_2"]
    assert times["sin_default_3"] > 0
    # A second input that differs in shape: the profile is of the new shapes.
    table = profile(gm, [torch.randn(4, 4), torch.randn(4, 4)], runs=3)
    four = [r.time_s for r in table.rows if r.name.startswith("sin")]
    assert len(set(four)) == 1  # now all four sins share one signature


def test_random_and_in_place_nodes_are_never_recomputable():
    def f(x):
        d = aten.native_dropout.default(x, 0.5, True)
        r = aten.relu_.default(aten.add.Tensor(x, 1))
        return aten.sum.default(aten.mul.Tensor(d[0], r))

    gm = fx.symbolic_trace(f)
    out = list(gm.graph.nodes)[-1]
    tag_phases(gm, forward_outputs=[out.args[0]])
    table = profile(gm, [torch.randn(8)], runs=1)
    reasons = {r.name: r.reason for r in table.rows if r.phase == "forward"}
    assert "random" in reasons["native_dropout_default"]
    assert "in place" in reasons["relu__default"]
    assert "written in place" in reasons["add_tensor"]


# --------------------------------------------------------------------------- bad input


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_bad_inputs_get_one_clear_error():
    net, x = Net(), torch.randn(4, 8)
    loss = lambda m, x: m(x).pow(2).mean()  # noqa: E731
    for budget in (0.0, 1.5, -3):
        with pytest.raises(UserInputError, match="budget"):
            compile_step(net, loss, (x,), memory_budget=budget)
    with pytest.raises(UserInputError, match="planner"):
        compile_step(net, loss, (x,), planner="best")
    with pytest.raises(UserInputError, match="scalar"):
        compile_step(net, lambda m, x: m(x), (x,))

    class Branchy(Net):
        def forward(self, x):
            return super().forward(x) if x.sum() > 0 else x

    # The message names the model's line, not torch's.
    with pytest.raises(CaptureError, match=r"data-dependent\) at \S*test_remat_runtime.py:\d+ in"):
        compile_step(Branchy(), loss, (x,))
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(UserInputError, match="not a parameter"):
        compile_step(net, loss, (x,), optimizer=stray)


def test_a_transformers_padding_mask_is_captured_for_every_mask():
    # transformers branches on the mask's values in eager (padding_mask.all()); under a
    # compiler's flags it always builds the mask: the step holds for any padding.
    transformers = pytest.importorskip("transformers")
    config = transformers.DistilBertConfig(
        n_layers=2, dim=32, hidden_dim=64, n_heads=2, dropout=0.0, attention_dropout=0.0
    )
    model = transformers.DistilBertModel(config).train()
    reference = copy.deepcopy(model)
    ids, mask = torch.randint(0, 1000, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0

    def loss(m, ids, mask):
        return m(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean()

    step = compile_step(model, loss, (ids, mask), memory_budget=1.0, profile_runs=1)
    no_padding = torch.ones_like(mask)
    other_padding = torch.ones_like(mask)
    other_padding[0, 3:] = 0
    for given in (mask, no_padding, other_padding):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        got = step(ids, given)
        expected = loss(reference, ids, given)
        expected.backward()
        torch.testing.assert_close(got, expected.detach())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_an_unreachable_budget_warns_and_trains_with_the_best_plan():
    net, x = Net(), torch.randn(4, 8)
    reference = copy.deepcopy(net)

    def loss(m, x):
        return m(x).pow(2).mean()

    with pytest.raises(BudgetError):
        compile_step(net, loss, (x,), memory_budget=1, strict=True, profile_runs=1)
    with pytest.warns(UserWarning, match=r"using the best plan found, \d\.\d+ of the baseline"):
        step = compile_step(net, loss, (x,), memory_budget=1, profile_runs=1)
    assert not step.plan.details["budget_met"] and step.plan.peak > step.plan.budget_bytes == 1
    other = torch.randn(4, 8)
    got = step(other)
    expected = eager_step(reference, (other,), loss)
    torch.testing.assert_close(got, expected.detach())
    for p, q in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_failed_step_leaves_the_model_untouched_and_the_optimizer_steps():
    net, x = Net(), torch.randn(4, 8)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = compile_step(
        net, lambda m, x: m(x).pow(2).mean(), (x,), memory_budget=1.0, optimizer=opt, profile_runs=1
    )
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(UserInputError, match=r"input 0 shape \(5, 8\), not \(4, 8\)"):
        step(torch.randn(5, 8))
    with pytest.raises(UserInputError, match="input 0 dtype float64, not float32"):
        step(x.double())
    with pytest.raises(UserInputError, match="2 inputs, not 1"):
        step(x, x)
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, net.parameters()))
    step(x)
    assert not torch.equal(before[0], net.a.weight)


def test_torch_compile_backend_matches_eager():
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
    x = torch.randn(64, 32)
    reference = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(model, backend=backend(0.9, plans=plans), dynamic=False)
    compiled(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    assert plans and plans[0].recompute and plans[0].peak <= plans[0].budget_bytes
    for p, q in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)


def test_cli_json_has_the_contract_keys(capsys):
    code = main(["remat", "zoo:mlp?batch=64", "--budget", "0.8", "--json", "--runs", "1"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {
        "planner",
        "budget",
        "baseline",
        "optimized",
        "recomputed",
        "grads_match",
        "max_grad_error",
    } <= set(data)
    for side in ("baseline", "optimized"):
        assert set(data[side]) == {"peak_activation_bytes", "saved_activation_bytes", "step_ms"}
    assert data["grads_match"] and data["recomputed"]
    assert data["optimized"]["peak_activation_bytes"] < data["baseline"]["peak_activation_bytes"]
    assert set(data["setup_s"]) == {"capture", "profile", "plan", "rewrite", "first step"}
    assert all(seconds >= 0 for seconds in data["setup_s"].values())
    # Peak memory of each of them, beside the model (Linux: the resident high-water mark).
    if data["memory"]["method"] == "VmHWM":
        assert set(data["memory"]["phases_peak_bytes"]) == set(data["setup_s"])
        assert data["memory"]["weight_bytes"] > 0


def test_cli_bad_budget_is_a_user_error(capsys):
    assert main(["remat", "zoo:mlp", "--budget", "lots"]) == 2
    assert "bad --budget" in capsys.readouterr().err


def test_boundary_marker_reads_saved_activations_in_eager_code():
    net, x = Net(), torch.randn(16, 8)

    def step():
        loss = net(x).pow(2).mean()
        boundary()
        loss.backward()

    m = measure_step(step, net)
    assert m.saved_bytes >= 16 * 32 * 4 and m.peak_bytes > m.saved_bytes


class DictNet(nn.Module):
    """Returns a dict holding a nested tuple and an integer tensor, like HF-style models."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return {"logits": self.b(h), "extra": (h, h.argmax(dim=1))}


def make_dict_net():
    return DictNet(), (torch.randn(4, 8),)


def test_default_loss_sums_the_floating_point_leaves_of_any_output_pytree():
    from fxopt.remat import sum_of_outputs

    net, (x,) = make_dict_net()
    reference = copy.deepcopy(net)
    step = compile_step(net, None, (x,), memory_budget=1.0, profile_runs=1)
    loss = step(x)
    expected = sum_of_outputs(reference, x)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(reference.parameters(), net.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


class ArgmaxNet(DictNet):
    def forward(self, x):
        return {"labels": super().forward(x)["logits"].argmax(dim=1)}


def test_default_loss_needs_a_floating_point_output():
    with pytest.raises(UserInputError, match=r"no floating-point tensor.*int64"):
        compile_step(ArgmaxNet(), None, (torch.randn(4, 8),), memory_budget=1.0)


def test_cli_trains_a_model_that_returns_a_dict(capsys):
    spec = f"{__file__}:make_dict_net"
    assert main(["remat", spec, "--budget", "1.0", "--json", "--runs", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["grads_match"]


QUIET_SCRIPT = """
import sys, torch
from torch.profiler import ProfilerActivity, profile
from fxopt.remat import compile_step
from fxopt.remat.measure import measure_step

net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
x = torch.randn(4, 8)
step = compile_step(net, None, (x,), memory_budget=1.0, profile_runs=1)
measure_step(lambda: step(x), net)
print("fxopt wrote this", file=sys.stderr, flush=True)
print("---", file=sys.stderr, flush=True)
with profile(activities=[ProfilerActivity.CPU]):  # torch's own profiler still logs
    torch.ones(2) + 1
"""


def test_the_python_api_profiles_without_kineto_lines_on_stderr():
    # A fresh process: kineto reads KINETO_LOG_LEVEL once, at its first use, and the CLI
    # (which sets it) may already have run in this one.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    ours, _, theirs = done.stderr.partition("---\n")
    assert "USDT" not in ours, ours
    assert "fxopt wrote this" in ours  # other stderr output is kept
    assert "USDT" in theirs  # the check above is not vacuous: this kineto does log


def test_only_kineto_lines_are_dropped_from_stderr(capfd):
    import os

    from fxopt.remat.native_output import KINETO_LOG, without_lines

    with without_lines(2, KINETO_LOG):
        os.write(2, b"USDT:2026-11-24 02:55:03 7634:7634 Handler.cpp:52] profiler_start\n")
        os.write(2, b"a warning the user should see\n")
    assert capfd.readouterr().err == "a warning the user should see\n"


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_cli_wrong_input_shape_is_one_line_naming_the_op(capfd):
    assert main(["remat", "zoo:mlp", "--input", "1x3x5"]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "aten.mm on float32[3, 5], float32[784, 256]" in line
    assert "module 'fc1' (Linear)" in line and "untraceable" not in line


def test_cli_int64_example_into_a_float_model_names_the_op(capfd):
    from tests.models import mistakes

    assert main(["remat", f"{mistakes.SPEC}:int64_into_float"]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "aten.addmm on float32[3], int64[2, 4], float32[4, 3]" in line


def test_cli_unwritable_plot_fails_before_training(tmp_path, capfd):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    plot = blocker / "pareto.png"
    assert main(["remat", "zoo:no_such_model", "--plot", str(plot)]) == 2
    assert _one_line(capfd.readouterr().err).startswith(f"fxopt: error: --plot {plot}:")


def test_cli_unreachable_budget_is_one_line_with_the_budget_that_works(capfd):
    assert main(["remat", "zoo:mlp?batch=64", "--budget", "0.3"]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "below what any plan can reach" in line and "give a budget of at least 0." in line


def test_the_readme_remat_command_fits_its_budget():
    # The README's line once asked ResNet-18 for 0.5, below the 0.54 no plan can go under
    # (its stem's BatchNorm backward). Plan it as the CLI would, without the timed runs.
    import argparse
    import re
    import shlex
    from pathlib import Path

    from fxopt import models
    from fxopt.cli.remat import add_arguments, parse_budget
    from fxopt.remat import sum_of_outputs

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    line = re.search(r"^fxopt remat (.*?)\s*(#.*)?$", readme, re.MULTILINE).group(1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(shlex.split(line))
    loaded = models.load(args.model, args.input)
    step = compile_step(
        loaded.model.train(),
        sum_of_outputs,
        loaded.example_inputs,
        memory_budget=parse_budget(args.budget),
        planner=args.planner,
        profile_runs=1,
    )
    assert step.plan.peak <= step.plan.budget_bytes


def test_the_rewrites_run_as_passes_with_dumps_and_reasons():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(4, 8)
    step = compile_step(
        model, None, (x,), memory_budget=1.0, dump_after=("split-dropouts", "recompute")
    )
    assert [r.name for r in step.passes] == ["split-dropouts", "add-snapshots", "recompute"]
    assert step.passes[0].stats == {"split": 1} and step.passes[1].stats == {"added": 1}
    assert "apply_dropout_mask" in step.dumps["split-dropouts"]
    assert "recompute" in step.dumps
    assert [p["name"] for p in step.report()["passes"]] == [r.name for r in step.passes]
    with pytest.raises(UserInputError, match="valid names: split-dropouts, add-snapshots"):
        compile_step(model, None, (x,), dump_after=("cse",))


def test_cli_dump_after_must_name_a_remat_rewrite(capsys):
    assert main(["remat", "zoo:mlp", "--dump-after", "cse"]) == 2
    assert "not a remat rewrite" in capsys.readouterr().err


def test_the_single_trace_capture_equals_aot_export_modules_graph():
    from torch._functorch.aot_autograd import aot_export_module

    from fxopt.remat.aot_capture import export_joint_once
    from fxopt.remat.capture import _LossModule

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    model[0].bias.requires_grad_(False)  # a frozen parameter gets no gradient output
    wrapper = _LossModule(model, lambda m, x: m(x).square().mean())
    x = torch.randn(2, 3, 6, 6, requires_grad=True)  # an input that wants its gradient
    ours, our_signature = export_joint_once(wrapper, (x,))
    theirs, their_signature = aot_export_module(
        wrapper, (x,), trace_joint=True, output_loss_index=0
    )

    def computing(gm):  # the retrace adds a dead detach and a dead getitem
        skip = {aten.detach.default, operator.getitem}
        nodes = gm.graph.nodes
        return sorted(
            str(n.target) for n in nodes if n.op == "call_function" and n.target not in skip
        )

    assert computing(ours) == computing(theirs)
    assert len(ours.graph.output_node().args[0]) == len(theirs.graph.output_node().args[0])
    for field in ("parameters", "buffers", "user_inputs", "buffers_to_mutate"):
        assert len(getattr(our_signature, field)) == len(getattr(their_signature, field))
    ours_back, theirs_back = our_signature.backward_signature, their_signature.backward_signature
    trained = ["model.0.weight", "model.1.bias", "model.1.weight"]  # not the frozen bias
    assert sorted(ours_back.gradients_to_parameters.values()) == trained
    assert sorted(ours_back.gradients_to_parameters.values()) == sorted(
        theirs_back.gradients_to_parameters.values()
    )
    assert len(ours_back.gradients_to_user_inputs) == 1
    # The same numbers out, on the example and on other values (both graphs are
    # specialized to the example's shapes; Step recaptures for others).
    state = [*model.parameters(), *model.buffers()]
    for batch in (x.detach(), torch.randn(2, 3, 6, 6) * 3):
        assert all(
            torch.equal(a, b)
            for a, b in zip(ours(*state, batch), theirs(*state, batch), strict=True)
        )


def test_the_single_trace_capture_falls_back_to_aot_export_module(monkeypatch):
    from fxopt.remat import aot_capture
    from fxopt.remat.capture import _LossModule

    def unexpected(*args, **kwargs):
        raise aot_capture._Unexpected

    monkeypatch.setattr(aot_capture, "_flatten_joint", unexpected)
    model = nn.Linear(4, 2)
    gm, signature = aot_capture.export_joint_once(
        _LossModule(model, lambda m, x: m(x).sum()), (torch.randn(3, 4),)
    )
    assert len(signature.backward_signature.gradients_to_parameters) == 2
    _, *grads = gm(model.weight, model.bias, torch.ones(3, 4))
    assert torch.allclose(grads[1], torch.full((2,), 3.0))  # d(sum)/d(bias): the batch size
