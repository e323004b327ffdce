"""Remat plans within the memory it is asked to save: what profiling a step holds.

The profile runs the joint graph on the step's own tensors (the model's parameters, not
copies), frees each parameter gradient as soon as it is made, and runs the schedule a plan
on the traced sizes chooses (:func:`fxopt.remat.profile.profile_within`), so that planning
holds about what the planned step will. Measured here with a dispatch mode that counts
the bytes of every storage an op makes while it is alive (the docs' cross-check of the
profiler's replay).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxopt import remat
from fxopt.remat import compile_backend
from fxopt.remat.capture import capture_joint
from fxopt.remat.profile import (
    estimate,
    joint_inputs,
    lean_recompute,
    lean_schedule,
    profile,
    profile_within,
)
from fxopt.remat.simulate import simulate


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.tanh(self.up(self.norm(x)))))


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.bn = nn.BatchNorm1d(width)  # training mode: a buffer the graph writes
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.bn(self.blocks(x).mean(1)))


def _loss(model, x):
    return model(x).square().mean()


def _captured(width: int = 32, depth: int = 6, batch: int = 16, length: int = 24):
    torch.manual_seed(0)
    model = Stack(width, depth).train()
    x = torch.randn(batch, length, width)
    joint = capture_joint(model, _loss, (x,))
    inputs = joint_inputs(joint, model, (x,))
    grads = range(joint.loss_index + 1, joint.loss_index + 1 + len(joint.grad_params))
    return model, joint, inputs, grads


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages ops make while the mode is on, each freed when its last
    tensor dies; the storages of ``existing`` tensors (the parameters and inputs, and views
    of them) are not counted."""

    def __init__(self, existing):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()
        self._existing = {t.untyped_storage()._cdata for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self._seen or key in self._existing or storage.nbytes() == 0:
                    continue
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def _rows(table):
    return [
        (
            r.name,
            r.phase,
            r.args,
            r.recomputable,
            r.reason,
            sum(table.storage_bytes[s] for s in r.owns),
        )
        for r in table.rows
    ]


def test_the_estimate_reads_the_traced_sizes_the_profile_measures():
    _, joint, inputs, grads = _captured()
    measured = profile(joint.gm, inputs, runs=0, excluded_outputs=grads)
    estimated = estimate(joint.gm, excluded_outputs=grads)
    assert _rows(estimated) == _rows(measured)
    assert simulate(estimated).peak == simulate(measured).peak


def test_a_scheduled_profile_describes_the_same_graph_and_holds_less():
    _, joint, inputs, grads = _captured()
    chosen = lean_recompute(estimate(joint.gm, excluded_outputs=grads), 0.5)
    schedule = lean_schedule(joint.gm, chosen)
    assert chosen and schedule is not None
    # Nodes the schedule recomputes run twice in it; gm's table is as if it ran once.
    names = {n.name for n in schedule.graph.nodes}
    assert {n.name for n in joint.gm.graph.nodes} - names <= {
        n.name for n in joint.gm.graph.nodes if "rng_state" in n.name
    }
    plain_mode, scheduled_mode = LiveBytes(inputs), LiveBytes(inputs)
    with plain_mode:
        plain = profile(joint.gm, inputs, runs=0, excluded_outputs=grads)
    with scheduled_mode:
        scheduled = profile(joint.gm, inputs, runs=0, excluded_outputs=grads, schedule=schedule)
    assert _rows(scheduled) == _rows(plain)
    assert simulate(scheduled).peak == simulate(plain).peak
    assert scheduled_mode.peak < plain_mode.peak


def test_the_profile_holds_no_parameter_gradient_to_the_end():
    # Wide layers on a few tokens: the gradients are most of what the step makes.
    model, joint, inputs, grads = _captured(width=128, depth=4, batch=2, length=4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    mode = LiveBytes(inputs)
    with mode:
        table = profile(joint.gm, inputs, runs=0, excluded_outputs=grads)
    activations = simulate(table).peak
    assert activations < weights / 10
    # Every gradient kept to the end would add the weights' bytes to the activations';
    # freed as made, one or two (the largest layer's) are alive at a time.
    assert mode.peak < 2 * activations + weights / 3


def test_compile_step_plans_with_the_lean_profile_and_matches_eager():
    model, x = Stack().train(), torch.randn(8, 24, 32)
    reference = Stack().train()
    reference.load_state_dict(model.state_dict())
    step = remat.compile_step(model, _loss, (x,), memory_budget=0.5)
    torch.manual_seed(1)
    loss = step(x)
    torch.manual_seed(1)
    expected = _loss(reference, x)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    other = torch.randn(4, 16, 32)  # another shape: another step, or a clear refusal
    assert remat.compile_step(model, _loss, (other,), memory_budget=0.5)(other).isfinite()


def test_the_backend_profiles_on_the_models_own_parameters(monkeypatch):
    made = []
    original = compile_backend._example

    def example(node):
        made.append(str(node.target))
        return original(node)

    monkeypatch.setattr(compile_backend, "_example", example)
    model, x = Stack().train(), torch.randn(8, 24, 32)
    compiled = torch.compile(model, backend=remat.backend(memory_budget=0.5))
    _loss(compiled, x).backward()
    assert made and not [name for name in made if name.startswith("primals")]


def test_profile_within_an_unmet_budget_still_profiles():
    _, joint, inputs, grads = _captured(depth=2)
    table = profile_within(joint.gm, inputs, 0.01, runs=0, excluded_outputs=grads)
    assert _rows(table) == _rows(profile(joint.gm, inputs, runs=0, excluded_outputs=grads))
