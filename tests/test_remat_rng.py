"""fxopt.remat's RNG-state replay: random ops (dropout) recomputed with eager's draws."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.errors import PassError
from fxopt.ir.copying import clone_module
from fxopt.passes import PassManager
from fxopt.remat import backend, compile_step
from fxopt.remat.capture import capture_joint, tag_phases
from fxopt.remat.measure import measure_step, with_boundary_marker
from fxopt.remat.planners import greedy_sequence, make_plan
from fxopt.remat.profile import joint_inputs, profile
from fxopt.remat.rewrite import recompute
from fxopt.remat.rng import SNAPSHOT_OF, state_of
from fxopt.remat.runtime import Step
from fxopt.remat.simulate import simulate
from fxopt.remat.snapshots import AddSnapshots
from fxopt.remat.split_dropouts import SplitDropouts
from fxopt.remat.table import Table

aten = torch.ops.aten


class DropoutMLP(nn.Module):
    def __init__(self, width=64, depth=4, p=0.3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.drop = nn.Dropout(p)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


def loss_fn(m, x):
    return m(x).pow(2).mean()


# Typical profiled medians (µs) of these small models' ops, fixed: on a loaded machine the
# measured timings can reorder greedy's choices, and these tests are about what the
# planners and the rewriter do given the costs (the profile has its own tests).
TYPICAL_US = {"addmm": 150, "mm": 100, "tanh": 35, "random": 300, "apply_dropout_mask": 110}


def with_typical_costs(step):
    rows = tuple(
        dataclasses.replace(r, time_s=TYPICAL_US.get(r.op, 30) * 1e-6) for r in step.table.rows
    )
    step.table = Table(rows, step.table.storage_bytes, step.table.excluded)
    return step


def recomputing(base, names):
    """A step of ``base``'s model that recomputes exactly ``names`` (no planner)."""
    table = base.table
    chosen = frozenset(table.index(n) for n in names)
    sim = simulate(table, chosen)
    fixed = make_plan(table, "fixed", sim.peak, chosen, sim)
    graph = clone_module(base.joint.gm)
    recompute(graph, fixed.recompute)
    return Step(base.model, base.joint, graph, table, fixed, base._examples, None)


def replaying(base):
    """Recompute every dropout, draws included: each mask draw is replayed."""
    names = [r.name for r in base.table.rows if is_dropout(r.name) and r.recomputable]
    assert any(r.op == "random" for r in base.table.rows if r.name in names)
    return recomputing(base, names)


@pytest.fixture(scope="module")
def dropout_step():
    torch.manual_seed(0)
    # 64×256 masks (16 KB): replaying one frees far more than its 5 KB RNG snapshot keeps.
    model, x = DropoutMLP(width=256).train(), torch.randn(64, 256)
    start = copy.deepcopy(model)
    base = compile_step(model, loss_fn, (x,), memory_budget=1.0, profile_runs=1)
    return start, with_typical_costs(base), x


def floor(table: Table) -> float:
    """The smallest simulated peak greedy reaches, as a fraction of the baseline's."""
    peaks = [sim.peak for _, sim in greedy_sequence(table)]
    return min(peaks) / peaks[0]


def run_on_copy(step, start, inputs):
    """Run ``step`` on a fresh copy of the starting model, like a first training step."""
    model = copy.deepcopy(start)
    runner = copy.copy(step)
    runner.__init__(model, step.joint, step.graph, step.table, step.plan, inputs, None)
    return runner, model


def assert_matches_eager(step, start, x, seed, loss_tol=(0, 0), grad_tol=(0, 0)):
    """One step from ``start`` under ``seed``: loss, gradients and the RNG state after it
    equal eager's (exactly, unless tolerances are given)."""
    runner, mine = run_on_copy(step, start, (x,))
    torch.manual_seed(seed)
    expected, reference = eager(start, (x,))
    after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    loss = runner(x)
    # Same draws, and replays restore the generator: the stream goes on as eager's.
    assert torch.equal(torch.get_rng_state(), after_eager)
    torch.testing.assert_close(loss, expected, rtol=loss_tol[0], atol=loss_tol[1])
    for (name, p), q in zip(reference.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=grad_tol[0], atol=grad_tol[1], msg=name)


def eager(start, inputs):
    model = copy.deepcopy(start)
    loss = loss_fn(model, *inputs)
    loss.backward()
    return loss.detach(), model


def is_dropout(name):
    return name.startswith("native_dropout") and not name.endswith("rng_state")


def test_replayed_dropout_draws_what_eager_draws(dropout_step):
    start, base, x = dropout_step
    step = replaying(base)
    replays = [n for n in step.graph.graph.nodes if getattr(n.target, "__name__", "") == "replay"]
    assert replays
    assert_matches_eager(step, start, x, seed=11)


def test_random_rows_are_recomputable_through_their_snapshot(dropout_step):
    _, base, _ = dropout_step
    table = base.table
    draws = [r for r in table.rows if r.op == "random" and r.phase == "forward"]
    assert len(draws) == 4
    for row in draws:
        snapshot = [table.rows[i] for i in row.args if table.rows[i].op == "state_of"]
        assert row.recomputable and len(snapshot) == 1, row
    # Without replay the draws could not be recomputed, and a lower peak needs them gone:
    # the simulated peak of recomputing every dropout is below that of keeping the draws.
    everything = frozenset(
        table.index(r.name) for r in table.rows if is_dropout(r.name) and r.recomputable
    )
    no_draws = frozenset(i for i in everything if table.rows[i].op != "random")
    assert simulate(table, everything).saved < simulate(table, no_draws).saved


def test_snapshots_cost_nothing_when_no_random_op_is_recomputed(dropout_step):
    _, base, _ = dropout_step
    snapshots = [n for n in base.joint.gm.graph.nodes if SNAPSHOT_OF in n.meta]
    assert len(snapshots) == 4  # one per dropout, in the captured graph
    row = base.table.rows[base.table.index(snapshots[0].name)]
    assert not row.recomputable and "snapshot" in row.reason
    assert row.owns and base.table.storage_bytes[row.owns[0]] == state_of("cpu").numel()
    for budget in (1.0, 0.9):
        step = base.replan(budget, "greedy")
        if any(is_dropout(n) for n in step.plan.recompute):
            continue
        assert not [n for n in step.graph.graph.nodes if SNAPSHOT_OF in n.meta]


def test_a_replayed_snapshot_is_counted_as_saved_exactly(dropout_step):
    start, base, x = dropout_step
    step = replaying(base)
    marked, model = run_on_copy(step, start, (x,))
    marked.graph = with_boundary_marker(step.graph)
    measured = measure_step(lambda: marked(x), model)
    assert measured.saved_bytes == step.plan.saved
    assert abs(measured.peak_bytes - step.plan.peak) <= 0.05 * step.plan.peak


def test_an_explicit_generator_is_not_replayed():
    generator = torch.Generator().manual_seed(3)

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            noise = torch.bernoulli(torch.full_like(h, 0.5), generator=generator)
            return self.b(h * noise)

    model, x = Noisy().train(), torch.randn(4, 8)
    joint = capture_joint(model, loss_fn, (x,))
    assert not [n for n in joint.gm.graph.nodes if SNAPSHOT_OF in n.meta]
    table = profile(joint.gm, joint_inputs(joint, model, (x,)), runs=1)
    reasons = {r.name: r.reason for r in table.rows if r.phase == "forward"}
    assert "explicit generator" in reasons["bernoulli"]


def test_the_rewriter_refuses_a_random_op_without_snapshot():
    def f(x):
        d = aten.native_dropout.default(x, 0.5, True)
        return aten.sum.default(d[0]), aten.mul.Tensor(d[1], x)

    gm = fx.symbolic_trace(f)
    out = list(gm.graph.nodes)[-1]
    tag_phases(gm, forward_outputs=[out.args[0][0]])
    with pytest.raises(PassError, match="no RNG-state snapshot"):
        recompute(gm, ["native_dropout_default", "getitem_1"])
    for node in gm.graph.nodes:  # a device is all the snapshot needs
        node.meta["val"] = torch.empty(0)
    assert AddSnapshots()(gm).stats == {"added": 1}
    result = recompute(gm, ["native_dropout_default", "getitem_1"])
    x = torch.randn(100)
    torch.manual_seed(2)
    (_, mask), after = aten.native_dropout.default(x, 0.5, True), torch.get_rng_state()
    torch.manual_seed(2)
    _, grad = gm(x)
    assert result.records[0].stats["copies"] == 2 and torch.equal(grad, mask * x)
    assert torch.equal(torch.get_rng_state(), after)


def test_torch_compile_backend_replays_dropout(monkeypatch):
    # The plan is fixed (every dropout, draws included): which nodes greedy picks at a
    # budget depends on measured timings, and this test is about the backend's plumbing.
    from fxopt.remat import compile_backend

    def every_dropout(table, budget, planner, **options):
        chosen = frozenset(
            i for i, r in enumerate(table.rows) if is_dropout(r.name) and r.recomputable
        )
        sim = simulate(table, chosen)
        return make_plan(table, "fixed", sim.peak, chosen, sim)

    monkeypatch.setattr(compile_backend, "plan", every_dropout)
    torch.manual_seed(0)
    model, x = DropoutMLP().train(), torch.randn(32, 64)
    reference = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(
        model, backend=backend(0.7, plans=plans, profile_runs=1), dynamic=False
    )
    torch.manual_seed(5)
    loss = compiled(x).pow(2).mean()
    loss.backward()
    after = torch.get_rng_state()
    torch.manual_seed(5)
    expected = reference(x).pow(2).mean()
    expected.backward()
    assert plans and any(n.endswith("_mask") for n in plans[0].recompute), plans[0].recompute
    assert torch.equal(torch.get_rng_state(), after)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for p, q in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


class Attention(nn.Module):
    """Three residual self-attention layers through F.scaled_dot_product_attention."""

    def __init__(self, p, layers=3):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(32, 96) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(32, 32) for _ in range(layers))
        self.p = p

    def forward(self, x):
        b, t, _ = x.shape
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
            x = x + out(y.transpose(1, 2).reshape(b, t, 32))
        return x


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_sdpa_attention_is_recomputed_with_and_without_dropout(p):
    # On CPU, dropout_p > 0 takes the math path (a native_dropout); dropout_p = 0 keeps
    # the flash kernel, tagged random by its schema but drawing nothing.
    torch.manual_seed(0)
    model, x = Attention(p).train(), torch.randn(2, 16, 32)
    start = copy.deepcopy(model)
    base = with_typical_costs(compile_step(model, loss_fn, (x,), memory_budget=1.0))
    ops = {r.op for r in base.table.rows if r.phase == "forward"}
    step = base.replan(floor(base.table) + 1e-6, "greedy")
    recomputed = {base.table.rows[base.table.index(n)].op for n in step.plan.recompute}
    if p > 0:
        # The dropout (split into mask and output, the split-dropouts pass) is recomputed.
        assert any(is_dropout(n) for n in step.plan.recompute), step.plan.recompute
    else:
        assert any("attention" in op for op in ops & recomputed), (ops, recomputed)
        assert not [n for n in base.joint.gm.graph.nodes if SNAPSHOT_OF in n.meta]
    assert_matches_eager(step, start, x, seed=4, loss_tol=(1e-6, 1e-7), grad_tol=(1e-5, 1e-6))


def test_split_dropout_draws_and_values_are_native_dropouts():
    from torch._subclasses import FakeTensorMode

    def f(x):
        d = aten.native_dropout.default(x, 0.3, True)
        return d[0], d[1]

    def traced(fake):
        gm = fx.symbolic_trace(f)
        vals = (torch.empty_like(fake), torch.empty_like(fake, dtype=torch.bool))
        for node in gm.graph.nodes:
            node.meta["val"] = vals if node.target is aten.native_dropout.default else fake
        return gm

    with FakeTensorMode():
        fake = torch.empty(3, 40, 17)
        gm, strided = traced(fake), traced(fake.transpose(0, 2))
    # The kernel's mask has the input's strides, bernoulli.p's is contiguous: not split,
    # and --explain says so.
    kept = PassManager([SplitDropouts()], copy=False).run(strided)
    assert not kept.changed
    assert [s.reason for s in kept.skipped] == [
        "its input is not contiguous (the kernel's mask would have its strides)"
    ]
    split = PassManager([SplitDropouts()], copy=False).run(gm)
    assert split.records[0].stats == {"split": 1} and split.records[0].changed
    # (The second shape is a BERT-base attention map: large enough for parallel draws.)
    for x in (torch.randn(3, 40, 17), torch.randn(2, 12, 128, 128)):
        torch.manual_seed(7)
        expected, after = aten.native_dropout.default(x, 0.3, True), torch.get_rng_state()
        torch.manual_seed(7)
        got = gm(x)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert torch.equal(torch.get_rng_state(), after)


def test_a_dropout_output_is_recomputed_from_its_kept_mask_before_any_replay(dropout_step):
    # Recomputing a dropout's output from its mask (two multiplications) frees as many
    # bytes as replaying it, far cheaper: greedy's first choices are outputs, not draws.
    start, base, x = dropout_step
    table = base.table
    first = None
    for chosen, _ in greedy_sequence(table):
        if chosen:
            first = chosen
            break
    names = {table.rows[i].name for i in first}
    assert any(n.startswith("native_dropout") and n.endswith("_out") for n in names), names
    assert not any(n.endswith("_mask") for n in names), names
    step = base.replan(0.999, "greedy")  # the first cheap choice fits
    outs = [n for n in step.plan.recompute if n.endswith("_out")]
    assert outs and not [
        n for n in step.graph.graph.nodes if getattr(n.target, "__name__", "") == "replay"
    ]
    assert_matches_eager(step, start, x, seed=3)
