"""compile_step(..., update_in_backward=True): the optimizer's update applied inside the
backward (pass apply-updates), against eager training with optimizer.step()."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.errors import PassError, UserInputError
from fxopt.remat import compile_step
from fxopt.remat.measure import measure_total
from fxopt.remat.updates import apply_updates


def mlp(width=256, layers=4):
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*blocks, nn.Linear(width, 10))


def bn_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


CASES = {
    # AdamW on a BN CNN in training mode; SGD with momentum on an MLP under a budget, so
    # recomputed forward values read weights in the backward (sqrt_n: a plan that does not
    # depend on measured timings, 0.56 of the baseline here).
    "bn-cnn-adamw": (bn_cnn, (4, 3, 12, 12), lambda ps: torch.optim.AdamW(ps, lr=1e-2), 1.0),
    "mlp-sgd-remat": (mlp, (16, 256), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.7),
}


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_equal_eager_training_bit_for_bit(case):
    make, shape, optimizer_of, budget = CASES[case]
    torch.manual_seed(0)
    model = make().train()
    eager = copy.deepcopy(model)
    optimizer, eager_optimizer = optimizer_of(model.parameters()), optimizer_of(eager.parameters())
    x, y = torch.randn(shape), torch.arange(shape[0]) % 10
    step = compile_step(
        model,
        loss_fn,
        (x, y),
        memory_budget=budget,
        planner="sqrt_n",
        optimizer=optimizer,
        update_in_backward=True,
        profile_runs=1,
    )
    assert [r.name for r in step.passes][-1] == "apply-updates"
    assert step.passes[-1].stats["updates"] == len(list(model.parameters()))
    if budget < 1.0:
        assert step.plan.recompute
    for batch in range(3):  # the first call also creates the optimizer state
        xb, yb = (x, y) if batch == 0 else (torch.randn(shape), torch.randint(0, 10, (shape[0],)))
        loss = step(xb, yb)
        eager_optimizer.zero_grad(set_to_none=True)
        expected = loss_fn(eager, xb, yb)
        expected.backward()
        eager_optimizer.step()
        assert torch.equal(loss, expected)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), eager.buffers()))
        assert all(p.grad is None for p in model.parameters())


def test_gradients_do_not_all_live_at_once():
    # Measured (torch profiler allocation events): everything the step allocates on top of
    # the parameters and the optimizer state, gradients included.
    torch.manual_seed(0)
    model = mlp(512, 6)
    eager = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters())
    eager_optimizer = torch.optim.AdamW(eager.parameters())
    x, y = torch.randn(32, 512), torch.arange(32) % 10
    step = compile_step(
        model, loss_fn, (x, y), memory_budget=1.0, optimizer=optimizer, update_in_backward=True
    )

    def eager_step():
        loss_fn(eager, x, y).backward()
        eager_optimizer.step()

    eager_step(), step(x, y)  # optimizer state made; later steps allocate none
    # Both measured from no gradients: freeing the last step's inside the measured call
    # would lower eager's starting level by the gradients' bytes, as the event order goes.
    eager_optimizer.zero_grad(set_to_none=True)
    memory = step.report()["memory"]
    assert memory["update_in_backward"] and not memory["gradients_alive_at_once"]
    assert memory["optimizer_state_bytes"] >= 2 * memory["parameter_bytes"]  # AdamW: m, v
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ours, theirs = measure_total(lambda: step(x, y)), measure_total(eager_step)
    assert theirs >= param_bytes  # every gradient alive at once (and more)
    assert ours < 0.6 * theirs, (ours, theirs)


def _sgd_in_backward(model, x, y):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return compile_step(
        model,
        loss_fn,
        (x, y),
        memory_budget=1.0,
        optimizer=optimizer,
        update_in_backward=True,
        profile_runs=1,
    )


def test_replan_keeps_updating_in_the_backward():
    torch.manual_seed(0)
    model = mlp(64, 3)
    x, y = torch.randn(8, 64), torch.arange(8) % 10
    step = _sgd_in_backward(model, x, y)
    other = step.replan(1.0, "sqrt_n")
    assert other.update_in_backward and [r.name for r in other.passes][-1] == "apply-updates"
    before = [p.detach().clone() for p in model.parameters()]
    other(x, y)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_misuse_is_a_clear_error():
    model = mlp(16, 1)
    x, y = torch.randn(4, 16), torch.arange(4)
    with pytest.raises(UserInputError, match="needs the optimizer"):
        compile_step(model, loss_fn, (x, y), update_in_backward=True)
    step = _sgd_in_backward(model, x, y)
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    with pytest.raises(UserInputError, match="zero_grad"):
        step(x, y)


def test_the_pass_refuses_a_position_that_is_not_a_gradient():
    def f(w, x):
        return (x @ w).sum(), 3

    gm = fx.symbolic_trace(f)
    with pytest.raises(PassError, match="output 1 is not a gradient node"):
        apply_updates(gm, {1: ("w", print)})
    with pytest.raises(PassError, match="no parameter placeholder named 'v'"):
        apply_updates(gm, {0: ("v", print)})
