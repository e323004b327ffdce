"""fxopt.remat.backend inside torch.compile: training-mode BatchNorm (AOTAutograd's buffer
writes), budgets no plan reaches, inputs other than the first, and the Inductor compiler."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.errors import UserInputError
from fxopt.remat import BudgetError, backend, compile_step
from fxopt.remat.measure import boundary, measure_step


def bn_cnn(layers=8):
    """The issue's model: conv → BatchNorm (training mode) → ReLU, eight times."""
    blocks, channels = [], 3
    for _ in range(layers):
        blocks += [nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
        channels = 16
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class Decay(nn.Module):
    """Reads a buffer, then writes it in place: a recomputed sum in the backward must read
    the value the forward read, not the new one. (Adds, not products: eager autograd
    forbids writing a tensor a product saved for its backward.)"""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 64))

    def forward(self, x):
        h = torch.tanh(self.a(x) + self.scale)
        self.scale.mul_(0.9)
        return self.b(torch.tanh(h + self.scale))


def _peak(run, model):
    for p in model.parameters():
        p.grad = None
    return measure_step(run, model).peak_bytes


def _grads(model):
    return [p.grad for p in model.parameters()]


def _compiled_step(compiled, x):
    def run():
        loss = compiled(x).sum()
        boundary()
        loss.backward()

    return run


def test_batchnorm_in_training_mode_plans_like_compile_step():
    # A structural planner (sqrt_n keeps every k-th saved value; no timing in the choice)
    # so both paths reach the same plan from their own profiles.
    torch.manual_seed(0)
    model, x = bn_cnn(), torch.randn(4, 3, 32, 32)
    eager, stepped = copy.deepcopy(model), copy.deepcopy(model)
    plans = []
    compiled = torch.compile(
        model, backend=backend(0.7, "sqrt_n", plans=plans, profile_runs=1), dynamic=False
    )
    step = compile_step(stepped, None, (x,), memory_budget=0.7, planner="sqrt_n", profile_runs=1)
    compiled(x).sum().backward()
    eager(x).sum().backward()
    step(x)
    (chosen,) = plans
    assert any(name.startswith("_native_batch_norm") for name in chosen.recompute)
    assert chosen.peak <= 0.7 * chosen.baseline_peak
    assert chosen.peak / chosen.baseline_peak == pytest.approx(
        step.plan.peak / step.plan.baseline_peak, abs=0.05
    )
    for ours, theirs in ((model, eager), (stepped, eager)):
        assert all(torch.equal(a, b) for a, b in zip(_grads(ours), _grads(theirs)))
        assert all(torch.equal(a, b) for a, b in zip(ours.buffers(), theirs.buffers()))
    # Measured, not simulated: the compiled step's peak is compile_step's (within 5 %).
    compiled_peak = _peak(_compiled_step(compiled, x), model)
    step_peak = _peak(lambda: step(x), stepped)
    eager_peak = _peak(_compiled_step(eager, x), eager)
    assert compiled_peak <= 1.05 * step_peak < 0.9 * eager_peak


def test_forward_alone_updates_running_statistics_as_eager_does():
    # The writes are forward work: an evaluation forward in training mode (no backward)
    # must still update BatchNorm's statistics, as eager does.
    torch.manual_seed(0)
    model, x = bn_cnn(2), torch.randn(4, 3, 16, 16)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend(0.7, profile_runs=1), dynamic=False)
    compiled(x)
    eager(x)
    for ours, theirs in zip(model.buffers(), eager.buffers()):
        assert torch.equal(ours, theirs)


def test_a_written_buffer_is_read_before_its_write_by_recomputations(monkeypatch):
    from fxopt.remat import compile_backend
    from fxopt.remat.planners import make_plan
    from fxopt.remat.simulate import simulate

    def everything(table, budget, planner, **options):
        chosen = frozenset(i for i, r in enumerate(table.rows) if r.recomputable)
        sim = simulate(table, chosen)
        return make_plan(table, "everything", sim.peak, chosen, sim)

    monkeypatch.setattr(compile_backend, "plan", everything)
    torch.manual_seed(0)
    model, x = Decay(), torch.randn(16, 32)
    eager = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(model, backend=backend(0.5, plans=plans), dynamic=False)
    compiled(x).pow(2).sum().backward()
    eager(x).pow(2).sum().backward()
    assert any(name.startswith("add") for name in plans[0].recompute), plans[0].recompute
    assert torch.equal(model.scale, eager.scale)
    for ours, theirs in zip(_grads(model), _grads(eager)):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_an_unreachable_budget_warns_and_trains_on_unless_strict():
    torch.manual_seed(0)
    model, x = bn_cnn(2), torch.randn(4, 3, 16, 16)
    eager = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(model, backend=backend(0.01, plans=plans), dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).sum().backward()
    eager(x).sum().backward()
    messages = [str(w.message) for w in caught if "fxopt remat" in str(w.message)]
    assert len(messages) == 1 and "best plan found" in messages[0], messages
    assert plans[0].details["budget_met"] is False and plans[0].peak < plans[0].baseline_peak
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(eager)))

    strict = torch.compile(copy.deepcopy(eager), backend=backend(0.01, strict=True))
    with pytest.raises(Exception) as raised:
        strict(x).sum().backward()
    cause = raised.value
    while cause is not None and not isinstance(cause, BudgetError):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert isinstance(cause, BudgetError)


def test_another_batch_size_gets_its_own_plan_and_eager_answers():
    torch.manual_seed(0)
    model = bn_cnn(3)
    eager = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(model, backend=backend(0.7, plans=plans), dynamic=False)
    for batch in (4, 6):
        x = torch.randn(batch, 3, 16, 16)
        for net in (model, eager):
            net.zero_grad(set_to_none=True)
        loss = compiled(x).sum()
        loss.backward()
        expected = eager(x).sum()
        expected.backward()
        assert torch.equal(loss, expected)
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), _grads(eager)))
    assert len(plans) == 2 and plans[1].baseline_peak > plans[0].baseline_peak


@pytest.mark.parametrize("budget", [0.85, 0.95])
def test_inductor_compiles_the_rewritten_graphs(budget):
    # Every nn.Sequential shares one forward, whose Dynamo cache holds 8 graphs: earlier
    # tests' compiles would leave the second input below to run eagerly, unplanned.
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = bn_cnn(3), torch.randn(4, 3, 16, 16)
    y = torch.arange(4) % 10
    eager = copy.deepcopy(model)
    plans = []
    compiled = torch.compile(
        model, backend=backend(budget, plans=plans, compiler="inductor"), dynamic=False
    )
    F.cross_entropy(compiled(x), y).backward()
    F.cross_entropy(eager(x), y).backward()
    # Planned on Inductor's joint graph (BatchNorm decomposed into var_mean and friends).
    (chosen,) = plans
    assert chosen.recompute and chosen.peak <= chosen.budget_bytes
    # 0.95 admits recomputing every pointwise op (min-cut's plan, 0.88 of the simulated
    # peak), and that is the plan; 0.85 does not, and the greedy planner chooses.
    floor = budget == 0.95
    assert chosen.details.get("fused_floor", False) == floor
    if floor:
        assert "relu" in chosen.recompute and len(chosen.recompute) > 10
        assert not any(name.startswith("convolution") for name in chosen.recompute)
    for ours, theirs in zip(_grads(model), _grads(eager)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # Another batch and image size: a graph and plan of its own, eager's answer.
    x2, y2 = torch.randn(6, 3, 20, 20), torch.arange(6) % 10
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    F.cross_entropy(compiled(x2), y2).backward()
    F.cross_entropy(eager(x2), y2).backward()
    assert len(plans) == 2
    for ours, theirs in zip(_grads(model), _grads(eager)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    for ours, theirs in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_bad_backend_options_are_user_errors():
    with pytest.raises(UserInputError, match="unknown compiler 'tvm'"):
        backend(compiler="tvm")
    with pytest.raises(UserInputError, match="unknown planner"):
        backend(planner="magic")


def test_under_inductor_pointwise_recomputes_are_costed_as_fused():
    from torch import fx

    from fxopt.remat.capture import tag_phases
    from fxopt.remat.compile_backend import FUSED_POINTWISE_COST, fused_pointwise_costs
    from fxopt.remat.profile import profile

    aten = torch.ops.aten

    def f(x, w):
        a = aten.relu.default(aten.mm.default(x, w))  # mm: not pointwise; relu: pointwise
        return aten.sum.default(aten.mul.Tensor(a, a)), a

    gm = fx.symbolic_trace(f)
    tag_phases(gm, forward_outputs=[list(gm.graph.nodes)[-1].args[0][0]])
    table = profile(gm, [torch.randn(64, 64), torch.randn(64, 64)], runs=1)
    fused = fused_pointwise_costs(table, gm)
    for before, after in zip(table.rows, fused.rows, strict=True):
        factor = FUSED_POINTWISE_COST if before.op in ("relu", "mul") else 1.0
        assert after.time_s == before.time_s * factor, before.name
    assert [r.op for r in table.rows if r.op in ("mm", "sum")] == ["mm", "sum"]


def test_under_inductor_the_floor_recomputes_every_pointwise_op_and_nothing_else():
    from torch import fx

    from fxopt.remat.capture import tag_phases
    from fxopt.remat.compile_backend import fused_floor
    from fxopt.remat.profile import profile

    aten = torch.ops.aten

    def step(x, w, grad):
        h = aten.mm.default(x, w)
        a = aten.relu.default(h)
        b = aten.mul.Tensor(a, 2.0)
        loss = aten.sum.default(b)
        return loss, aten.mul.Tensor(grad, aten.mul.Tensor(b, h))  # backward reads b and h

    gm = fx.symbolic_trace(step)
    outs = list(gm.graph.nodes)[-1].args[0]
    tag_phases(gm, forward_outputs=[outs[0]])
    table = profile(gm, [torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 16)], runs=1)
    floor = fused_floor(table, gm)
    recomputed = {table.rows[i].op for i in floor.recomputed}
    assert recomputed == {"relu", "mul"}  # b from h, which the mm leaves saved


def test_compile_blocks_plans_every_block_past_dynamos_recompile_limit():

    # nn.Sequential's forward lives in torch's files: Dynamo compiles every such block
    # through one shared wrapper, whose cache holds 8 graphs before it gives up.
    for _ in range(9):  # fill that shared cache first, as other compiles in a process do
        other = nn.Sequential(nn.Linear(4, 4))
        torch.compile(other.forward, backend="eager", dynamic=False)(torch.randn(2, 4))
    try:
        _plan_ten_blocks()
    finally:
        torch._dynamo.reset()  # the full shared cache would stop later compiles too


def _plan_ten_blocks():
    from fxopt.remat import compile_blocks

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(32, 32), nn.Tanh())])
        for _ in range(10)
    )
    reference = copy.deepcopy(blocks)
    compiled = compile_blocks(blocks, memory_budget=0.9, profile_runs=1)
    x = torch.randn(64, 32)
    for model in (blocks, reference):
        h = x
        for block in model:
            h = block(h)
        h.square().sum().backward()
    assert len(compiled.plans) == 10  # every block planned, none run eagerly
    # One budget for the process: the blocks together save at most 0.9 of their baseline
    # (each block alone may keep more or less than that).
    saved = sum(plan.saved for plan in compiled.plans)
    assert saved <= 0.9 * sum(plan.baseline_saved for plan in compiled.plans)
    assert sum(len(plan.recompute) > 0 for plan in compiled.plans) >= 2
    for ours, theirs in zip(blocks.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad)
    compiled.remove()
    assert "forward" not in vars(blocks[0])


def test_compile_blocks_under_inductor_plans_the_chain_and_compiles_it_again(monkeypatch):
    """The chain's joint plan recompiles a block through Inductor, as it does through the
    eager compiler, with no fallback warning."""
    import warnings

    from fxopt.remat import compile_blocks
    from fxopt.remat.compile_backend import _PieceAware

    recompiles = []
    original = _PieceAware.recompile

    def counted(self, member, forced):
        recompiles.append(forced)
        return original(self, member, forced)

    monkeypatch.setattr(_PieceAware, "recompile", counted)
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Tanh())])
        for _ in range(3)
    )
    reference = copy.deepcopy(blocks)
    compiled = compile_blocks(blocks, memory_budget=0.6, profile_runs=1, compiler="inductor")
    try:
        for step in range(2):  # the chain is planned at the first call of the second step
            x = torch.randn(16, 32) + step
            for model in (blocks, reference):
                model.zero_grad(set_to_none=True)
                h = x
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for block in model:
                        h = block(h)
                    h.square().sum().backward()
                assert not [str(w.message) for w in caught if "fxopt" in str(w.message)]
            for ours, theirs in zip(blocks.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-4, atol=1e-5)
    finally:
        compiled.remove()
        torch._dynamo.reset()
    assert len(compiled.plans) == 3
    assert all(plan.details.get("chain_graphs") == 3 for plan in compiled.plans)
    assert recompiles and all(plan in compiled.plans for plan in recompiles)


def test_compile_blocks_draws_as_eager_does_after_the_chain_recompiles():
    """Blocks with dropout, past the step where the chain is planned and recompiled: the
    same gradients as eager and the same draws from the generator, step after step."""
    from fxopt.remat import compile_blocks

    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.GELU(), nn.Linear(64, 32))
        for _ in range(3)
    )
    reference = copy.deepcopy(blocks)
    compiled = compile_blocks(blocks, memory_budget=0.3, profile_runs=1)
    try:
        for step in range(4):
            x = torch.randn(16, 32)
            start = torch.get_rng_state()
            after = []
            for model in (blocks, reference):
                torch.set_rng_state(start)
                model.zero_grad(set_to_none=True)
                h = x
                for block in model:
                    h = block(h) + h
                h.square().sum().backward()
                after.append(torch.get_rng_state())
            assert torch.equal(*after), f"step {step}: the generator moved differently"
            for ours, theirs in zip(blocks.parameters(), reference.parameters(), strict=True):
                assert torch.equal(ours.grad, theirs.grad), f"step {step}"
    finally:
        compiled.remove()
        torch._dynamo.reset()
    assert all(plan.details.get("chain_graphs") == 3 for plan in compiled.plans)
    assert any(plan.recompute for plan in compiled.plans)


def test_a_backward_keeps_no_draw_that_nothing_reads():
    """Outside a Dynamo compile (a chain's recompile) default_partition keeps a random op
    nothing reads, and the forward ops that feed it; the partition drops them, and keeps
    what has an effect."""
    from torch import fx

    from fxopt.remat.compile_backend import _without_dead_draws

    aten = torch.ops.aten

    def backward(x, grad, out):
        dead = aten.bernoulli.p(aten.mul.Tensor(x, 2.0), 0.5)  # noqa: F841 -- the point
        aten.copy_.default(out, grad)  # an effect: kept though nothing reads it
        return aten.add.Tensor(grad, 1.0)

    bw = fx.symbolic_trace(backward)
    bw.graph.eliminate_dead_code()  # as outside a compile: the draw counts as impure
    assert "bernoulli" in str(bw.graph)
    fw = fx.symbolic_trace(lambda x: x)
    _, cleaned = _without_dead_draws(fw, bw)
    targets = [n.target for n in cleaned.graph.nodes if n.op == "call_function"]
    assert targets == [aten.copy_.default, aten.add.Tensor]
    x, grad, out = torch.randn(3), torch.randn(3), torch.zeros(3)
    state = torch.get_rng_state()
    assert torch.equal(cleaned(x, grad, out), grad + 1) and torch.equal(out, grad)
    assert torch.equal(torch.get_rng_state(), state)  # no draw left


def test_the_joint_graph_computes_each_value_once_and_draws_each_time():
    """A repeated computation (BatchNorm's backward computes x - mean twice) is merged
    before planning, as min-cut does; two draws stay two draws."""
    from torch import fx

    from fxopt.remat.compile_backend import _eliminate_common_subexpressions

    aten = torch.ops.aten

    def joint(x, mean):
        a = aten.mul.Tensor(aten.sub.Tensor(x, mean), 2.0)
        b = aten.mul.Tensor(aten.sub.Tensor(x, mean), 3.0)
        first, second = aten.bernoulli.p(x, 0.5), aten.bernoulli.p(x, 0.5)
        return aten.add.Tensor(a, b), first, second

    gm = fx.symbolic_trace(joint)
    x, mean = torch.rand(64), torch.rand(64)
    _eliminate_common_subexpressions(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.sub.Tensor) == 1 and targets.count(aten.bernoulli.p) == 2
    torch.manual_seed(0)
    total, first, second = gm(x, mean)
    assert torch.equal(total, (x - mean) * 2.0 + (x - mean) * 3.0)
    assert not torch.equal(first, second)  # 64 fair coins twice: equal with p = 2^-64


def test_compile_blocks_bad_input_and_another_batch_size():
    from fxopt.remat import compile_blocks

    with pytest.raises(UserInputError, match=r"not an nn\.Module"):
        compile_blocks([nn.Linear(4, 4), "layer"])
    with pytest.raises(UserInputError, match="iterable of modules"):
        compile_blocks(3)
    block = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
    reference = copy.deepcopy(block)
    compiled = compile_blocks(block, memory_budget=0.9, profile_runs=1)
    with pytest.raises(UserInputError, match="already compiled"):
        compile_blocks(block)
    try:
        for batch in (64, 17):  # another batch size: a new graph and plan, eager's answer
            x = torch.randn(batch, 32)
            assert torch.allclose(block(x), reference(x), atol=1e-6)
        assert len(compiled.plans) == 2 * 4  # a Sequential's children are the blocks
    finally:
        compiled.remove()
        torch._dynamo.reset()


class _Stemmed(nn.Module):
    """A stem (conv, training-mode BatchNorm, ReLU) outside the blocks, as in a ResNet."""

    def __init__(self):
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.body = nn.Sequential(
            *[
                nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
                for _ in range(3)
            ]
        )
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = torch.relu(self.norm(self.stem(x)))
        return self.head(self.body(x).mean((2, 3)))


def _rooted(make, blocks, budget):
    """A model, an untouched copy, and its blocks compiled with the model as root."""
    from fxopt.remat import compile_blocks

    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    compiled = compile_blocks(blocks(model), budget, root=model, profile_runs=1)
    return model, reference, compiled


def test_compile_blocks_with_root_plans_what_runs_outside_the_blocks():
    model, reference, compiled = _rooted(_Stemmed, lambda m: m.body, 0.4)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # 0.4 is under the chain's floor: best plan
            for step, batch in enumerate((4, 4, 4, 7)):  # then another batch size
                x = torch.randn(batch, 3, 12, 12)
                for m in (model, reference):
                    m.zero_grad(set_to_none=True)
                    m(x).square().sum().backward()
                for ours, theirs in zip(model.parameters(), reference.parameters()):
                    assert torch.equal(ours.grad, theirs.grad), (step, batch)
                for ours, theirs in zip(model.buffers(), reference.buffers()):
                    assert torch.equal(ours, theirs), (step, batch)
        assert not [w for w in caught if "compiled nothing" in str(w.message)]
        # The stem's graph, the three blocks', the head's, for each batch size.
        assert len(compiled.plans) == 2 * 5
        stem, head = compiled.plans[0], compiled.plans[4]
        assert stem.recompute and stem.saved < stem.baseline_saved  # the stem was planned
        assert head.baseline_saved < stem.baseline_saved
        # Planned as one chain of five graphs, complete on the second step.
        assert all(plan.details.get("chain_graphs") == 5 for plan in compiled.plans[:5])
    finally:
        compiled.remove()
        torch._dynamo.reset()
    assert "forward" not in vars(model) and "forward" not in vars(model.body[0])


class _Looped(nn.Module):
    """A root whose own forward loops over its blocks, as most transformers' do."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_compile_blocks_says_when_dynamo_compiled_nothing_of_the_root():
    from fxopt.remat import compile_blocks

    model, reference, compiled = _rooted(_Looped, lambda m: m.layers, 0.9)
    try:
        x = torch.randn(16, 8)
        with pytest.warns(UserWarning, match=r"nothing of _Looped\.forward.*only the blocks"):
            for m in (model, reference):
                m(x).square().sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(x)
        assert not [w for w in caught if "compiled nothing" in str(w.message)]  # said once
        assert len(compiled.plans) == 3  # the blocks are planned all the same
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
        compiled.remove()
        # What the warning suggests: the module outside the loop among the blocks.
        compiled = compile_blocks([model.embed, *model.layers], memory_budget=0.9, profile_runs=1)
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        assert len(compiled.plans) == 4
        for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(ours.grad, theirs.grad)
    finally:
        compiled.remove()
        torch._dynamo.reset()


def _logged(forward):
    @functools.wraps(forward)  # a decorator as transformers' forwards have
    def wrapped_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapped_forward


class _Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 2)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])

    @_logged
    def forward(self, x):
        return self.head(torch.tanh(self.body(torch.tanh(self.embed(x)))))


def test_compile_blocks_keeps_each_roots_graphs_in_its_own_chain():
    """Three models of one class with a decorated forward: the root's graph breaks fall in
    the wrapped function, whose code every instance shares unless it is copied too."""
    from fxopt.remat import compile_blocks

    torch.manual_seed(0)
    models = [_Decorated() for _ in range(3)]
    references = copy.deepcopy(models)
    compiled = [compile_blocks(m.body, memory_budget=0.9, root=m, profile_runs=1) for m in models]
    try:
        x = torch.randn(16, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 0.9 is under these chains' floor
            for _ in range(2):
                for m in (*models, *references):
                    m(x).sum().backward()
        for result in compiled:  # embed, two blocks, head: one chain each
            assert [p.details.get("chain_graphs") for p in result.plans] == [4] * 4
        for m, reference in zip(models, references, strict=True):
            for ours, theirs in zip(m.parameters(), reference.parameters(), strict=True):
                assert torch.equal(ours.grad, theirs.grad)
    finally:
        for result in compiled:
            result.remove()
        torch._dynamo.reset()


def test_compile_blocks_root_must_be_the_model_around_the_blocks():
    from fxopt.remat import compile_blocks

    model = _Stemmed()
    with pytest.raises(UserInputError, match=r"root must be an nn\.Module"):
        compile_blocks(model.body, root="model")
    with pytest.raises(UserInputError, match="root is one of the blocks"):
        compile_blocks([model.stem, model], root=model)
    assert "forward" not in vars(model.stem)  # nothing compiled by a refused call


def test_a_chain_of_unknown_length_is_complete_when_its_first_graph_runs_again():
    from fxopt.remat.compile_backend import ChainMember, GraphChain, _Swappable

    planned = []

    class Counted(GraphChain):
        def plan_together(self):
            planned.append(len(self.members))
            self.done = True

    chain = Counted(backend=None, until_repeat=True)
    for _ in range(3):  # one step: each graph compiled, then run once
        member = ChainMember(None, [], {})
        member.runner = _Swappable(lambda *args: "ran", chain)
        chain.members.append(member)
        assert member.runner() == "ran" and not planned
    assert chain.members[1].runner() == "ran" and not planned  # a graph run twice in a step
    assert chain.members[0].runner() == "ran" and planned == [3]  # the next step


def _chain(length: int, size: int):
    """x → a0 → ... → a{n-1}, then their gradients in reverse: every forward value is
    saved for the backward."""
    from fxopt.remat.table import Table

    names = ["x", *(f"a{i}" for i in range(length)), *(f"g{i}" for i in range(length)), "out"]
    phases = ["input"] + ["forward"] * length + ["backward"] * length + ["output"]
    args = [()] + [(i,) for i in range(length)]  # a_i reads the value before it
    for j in range(length):  # g_j reads the gradient before it and a_{n-1-j}
        args.append((length - j, length + j) if j else (length,))
    args.append((2 * length,))
    storages = [None] + [size] * length + [1] * length + [None]
    return Table.build(names, phases, args, storages)


def test_graphs_of_one_compile_share_one_process_budget():
    """DDPOptimizer's pieces: what one piece cannot save, the next one saves instead, and
    a graph of another compile has a budget of its own."""
    from torch._guards import CompileContext, CompileId, compile_context

    from fxopt.remat.compile_backend import Partition

    small, large = _chain(1, 3000), _chain(12, 1000)
    partition = Partition(0.7, "greedy")
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=0))):
        with pytest.warns(UserWarning, match="best plan found"):
            first = partition.plan(small)  # one value: nothing to recompute
        second = partition.plan(large)
    assert first.saved == first.baseline_saved == 3000
    # The large graph runs while the small one's 3000 bytes are saved: the process baseline
    # peaks at 3000 + its peak, and the large graph's share is 0.7 of that less 3000.
    process_budget = int(0.7 * (3000 + second.baseline_peak))
    assert second.budget_bytes == process_budget - 3000
    assert second.peak <= second.budget_bytes < int(0.7 * second.baseline_peak)
    assert first.saved + second.peak <= process_budget

    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=1))):
        alone = partition.plan(large)  # a recompile: its own budget again
    assert alone.budget_bytes == int(0.7 * alone.baseline_peak) and alone.peak > second.peak
    unscoped = Partition(0.7, "greedy").plan(large)  # outside Dynamo: no ledger
    assert unscoped.budget_bytes == alone.budget_bytes


def test_blocks_of_compile_blocks_share_one_budget_per_round_of_compiles():
    """Each block is a compile of its own frame; the first compiles of all blocks share
    one process budget, and their recompiles (another batch size) another."""
    from torch._guards import CompileContext, CompileId, compile_context

    from fxopt.remat.compile_backend import Partition

    partition = Partition(0.5, "greedy", blocks=True)
    partition.piece = True  # as the backend sets it for every block
    chain = _chain(6, 1000)
    first = []
    for frame in range(3):  # three blocks, each its own frame, first compile
        with compile_context(CompileContext(CompileId(frame_id=frame, frame_compile_id=0))):
            first.append(partition.plan(chain))
    assert len(partition.ledgers) == 1
    assert sum(p.saved for p in first) <= 0.5 * sum(p.baseline_saved for p in first)
    with compile_context(CompileContext(CompileId(frame_id=0, frame_compile_id=1))):
        again = partition.plan(chain)  # block 0 recompiled: a new round, a new budget
    assert len(partition.ledgers) == 2 and again.saved == first[0].saved


def test_a_chain_plans_its_graphs_together_and_swaps_in_the_changed_ones():
    """The chain's choice replaces a graph's code only where its plan changed, and the
    caller's list of plans shows the joint plans."""
    from types import SimpleNamespace

    from fxopt.remat.compile_backend import ChainMember, GraphChain, Partition, _Swappable

    partition = Partition(0.5, "greedy")
    partition.piece = True  # as the backend sets it for a chain's graphs
    recompiled = []

    class Backend:
        _partition = partition

        def recompile(self, member, forced):
            recompiled.append((member, forced))
            return lambda *args: "recompiled"

    plans: list = []
    chain = GraphChain(Backend(), expected=2)
    for length in (6, 6):
        table = _chain(length, 1000)
        member = ChainMember(SimpleNamespace(), [], {}, table=table)
        member.plan = partition.plan(table)  # the graph's own plan, as compiled first
        member.plans, member.plan_index = plans, len(plans)
        plans.append(member.plan)
        member.runner = _Swappable(lambda *args: "own plan", chain)
        chain.members.append(member)
    assert chain.ready()
    first = chain.members[0].runner(1)  # the first call plans the chain, then runs
    assert chain.done and not chain.ready()
    changed = {id(m) for m, _ in recompiled}
    for member in chain.members:
        expected = "recompiled" if id(member) in changed else "own plan"
        assert member.runner(1) == expected
        assert member.plan is plans[member.plan_index]
        assert member.plan.details["chain_graphs"] == 2
    assert first == chain.members[0].runner(1)
    joint_peak = plans[0].details["chain_peak"]
    assert joint_peak <= plans[0].details["chain_budget"]
    assert joint_peak == max(plans[0].peak, plans[0].saved + plans[1].peak)


def test_a_fake_call_while_the_chain_compiles_does_not_plan_it():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.remat.compile_backend import GraphChain, _Swappable

    chain = GraphChain(backend=None)
    runner = _Swappable(lambda *args: len(args), chain)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))
    assert runner([fake, 3]) == 1 and not chain.done  # DDPOptimizer's boxed fake call
    chain.done = True  # (a real call would plan it: nothing to plan here)
    assert runner(torch.zeros(2)) == 1


def test_a_ddp_piece_is_planned_for_what_it_saves():
    """A piece's own peak is its backward's working set, often a floor; what it adds to
    the process's peak is what it saves, alive while the later pieces run."""
    from fxopt.remat.compile_backend import Partition, with_later_pieces
    from fxopt.remat.simulate import floor, simulate
    from fxopt.remat.table import Table

    # a0..a3 saved (10 bytes each); the last gradient, g0, is large (60 bytes) and reads
    # a0: the piece's own peak is there, whatever it saves.
    names = ["x", "a0", "a1", "a2", "a3", "g3", "g2", "g1", "g0", "out"]
    phases = ["input"] + ["forward"] * 4 + ["backward"] * 4 + ["output"]
    args = [(), (0,), (1,), (2,), (3,), (4,), (3, 5), (2, 6), (1, 7), (8,)]
    table = Table.build(names, phases, args, [None, 10, 10, 10, 10, 1, 1, 1, 60, None])
    baseline = simulate(table)
    assert floor(table)[0] == baseline.peak == 71
    stand_in, _ = with_later_pieces(table, 63, baseline)
    assert simulate(stand_in).peak_step == table.boundary  # the boundary is its peak

    alone = Partition(0.9, "greedy")
    with pytest.warns(UserWarning, match="best plan found"):
        whole = alone.plan(table)  # a graph of its own: 0.9 is under its floor
    assert whole.saved == baseline.saved
    piece = Partition(0.9, "greedy")
    piece.piece = True
    planned = piece.plan(table)
    assert planned.saved <= int(0.9 * 71) * 40 // 71 < whole.saved  # its share of 40
    assert planned.peak <= baseline.peak


def test_the_backend_knows_a_ddp_piece_by_its_graph_break_reason():
    from types import SimpleNamespace

    from fxopt.remat.compile_backend import Partition, _PieceAware

    partition = Partition(0.5, "greedy")
    seen = []
    aware = _PieceAware(lambda gm, inputs: seen.append(partition.piece), partition)
    piece = SimpleNamespace(
        compile_subgraph_reason=SimpleNamespace(reason="DDPOptimizer intentional graph-break")
    )
    aware(piece, [])
    aware(SimpleNamespace(), [])
    assert seen == [True, False]
