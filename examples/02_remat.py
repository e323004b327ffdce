"""Fit a training step into less memory: recompute activations in the backward pass.

    python examples/02_remat.py

fxopt captures forward + loss + backward as one graph, profiles it, picks activations to
recompute so the peak activation memory fits the budget, and runs the rewritten graph.
Gradients are those of ordinary eager training.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fxopt.remat import compile_step

torch.manual_seed(0)
model = nn.Sequential(
    *[layer for _ in range(6) for layer in (nn.Linear(256, 256), nn.BatchNorm1d(256), nn.GELU())],
    nn.Linear(256, 10),
).train()
x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
eager = copy.deepcopy(model)


def loss_fn(m, x, y):
    return F.cross_entropy(m(x), y)


optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
step = compile_step(model, loss_fn, (x, y), memory_budget=0.6, optimizer=optimizer)
plan = step.plan
print(f"planner {plan.planner}: recompute {len(plan.recompute)} nodes")
print(f"simulated peak activations {plan.baseline_peak / 2**20:.2f} MiB", end=" ")
print(f"-> {plan.peak / 2**20:.2f} MiB")
print(f"estimated extra compute {plan.estimated_overhead:.1%} of a step")

loss = step(x, y)  # one iteration: gradients in param.grad, then optimizer.step()
eager_loss = loss_fn(eager, x, y)
eager_loss.backward()
error = max(
    (a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), eager.parameters())
)
print(
    f"loss {loss.item():.4f} (eager {eager_loss.item():.4f}); max gradient difference {error:.1e}"
)
