"""Remat inside torch.compile: fxopt's backend (fx code or Inductor) against compile_step and
torch's own min-cut partitioner under Inductor, at the same budgets.

Models (training mode, no dropout, so every variant's gradients are comparable to eager's):

    bn_cnn     8 × (conv 3×3 → BatchNorm → ReLU), 16 channels, batch 4, 32×32 (issue 18)
    resnet18   fxopt.zoo ResNet-18, batch 8, 64×64

Variants, per budget B (a fraction of each graph's baseline peak activation memory):

    eager                        the model as written
    fxopt step B                 fxopt.remat.compile_step (its own capture, fx code)
    fxopt backend B              torch.compile(backend=fxopt.remat.backend(B)), fx code
    fxopt backend+inductor B     the same partition, forward/backward compiled by Inductor
    inductor                     torch.compile(model) (Inductor, its default min-cut)
    inductor min-cut B           torch.compile(model) with activation_memory_budget=B

Measured in one process, one thread: peak activation memory (torch profiler allocation
events, parameters and their gradients excluded) and CPU time per step as ratios to eager,
setup time (compile + first step), and the largest gradient difference from eager. Writes
results/remat_compile.json.

    python benchmarks/remat_compile.py            # both models, budgets 0.5 and 0.7
    python benchmarks/remat_compile.py --quick    # bn_cnn only, budget 0.5
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn

from common import RESULTS, command_line, machine_info, steady_allocator, write_json
from fxopt import zoo
from fxopt.remat import backend, compile_step
from fxopt.remat.measure import boundary, with_boundary_marker
from remat import Variant, build_variants, console, measure_variants


def bn_cnn():
    blocks, channels = [], 3
    for _ in range(8):
        blocks += [nn.Conv2d(channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
        channels = 16
    torch.manual_seed(0)
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    x = torch.randn(4, 3, 32, 32)
    description = "8 × (conv 3×3, BatchNorm, ReLU), 16 channels, batch 4, 32×32"
    return description, model.train(), (x, torch.arange(4) % 10)


def resnet18():
    entry = zoo.create("resnet18", batch=8, image=64)
    x = entry.example_inputs[0]
    return entry.description, entry.model.train(), (x, torch.arange(8) % 1000)


MODELS = {"bn_cnn": bn_cnn, "resnet18": resnet18}


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def _stepping(forward, model, inputs, name, kind, budget=None) -> Variant:
    def run():
        loss = loss_fn(forward, *inputs)
        boundary()
        loss.backward()
        return loss

    return Variant(name, kind, run, model, planner="greedy" if budget else None, budget=budget)


def eager_variant(model, inputs) -> Variant:
    return _stepping(model, model, inputs, "eager", "eager")


def compiled_variant(model, inputs, name, kind, budget=None, **compile_options) -> Variant:
    """torch.compile'd, compiled by one first step here (counted as setup)."""
    forward = torch.compile(model, dynamic=False, **compile_options)
    variant = _stepping(forward, model, inputs, name, kind, budget)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        variant.run()
    variant.extra["first_step_s"] = time.perf_counter() - start
    variant.extra["warnings"] = [str(w.message)[:300] for w in caught if "fxopt" in str(w.message)]
    for p in model.parameters():
        p.grad = None
    return variant


def min_cut_variant(model, inputs, budget: float | None) -> Variant:
    """Inductor with its min-cut partitioner at ``budget`` (None: torch's default).

    Each variant gets its own backend callable: Dynamo caches a compiled frame per code
    object and backend, so a second ``torch.compile`` of the same model class with the
    same backend reuses the first one's graph, whatever the budget was meanwhile.
    """
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
            return compile_fx(gm, example_inputs)

    name = "inductor" if budget is None else f"inductor min-cut {budget}"
    return compiled_variant(model, inputs, name, "torch", budget, backend=inductor_at_budget)


def fxopt_backend_variant(model, inputs, budget: float, compiler: str) -> Variant:
    plans: list = []
    label = "fxopt backend" + ("+inductor" if compiler == "inductor" else "")
    variant = compiled_variant(
        model,
        inputs,
        f"{label} {budget}",
        "fxopt " + compiler,
        budget,
        backend=backend(budget, compiler=compiler, plans=plans),
    )
    variant.extra["plans"] = [
        {
            "estimated_peak_ratio": p.peak / p.baseline_peak,
            "recomputed": len(p.recompute),
            "budget_met": p.details.get("budget_met", True),
        }
        for p in plans
    ]
    return variant


def step_variant(model, inputs, budget: float) -> Variant:
    step = compile_step(model, loss_fn, inputs, memory_budget=budget)
    step.graph = with_boundary_marker(step.graph)
    variant = Variant(f"fxopt step {budget}", "fxopt step", lambda: step(*inputs), model)
    variant.planner, variant.budget = "greedy", budget
    p = step.plan
    variant.extra["plans"] = [
        {"estimated_peak_ratio": p.peak / p.baseline_peak, "recomputed": len(p.recompute)}
    ]
    return variant


def measure_model(key: str, budgets: tuple[float, ...], rounds: int) -> dict:
    description, model, inputs = MODELS[key]()
    console.print(f"[bold]{key}[/]: {description}")
    variants: list[Variant] = []

    def add(build, label):
        variants.extend(build_variants(build, label, model))

    def fresh():
        return copy.deepcopy(model)

    add(lambda: eager_variant(fresh(), inputs), "eager")
    add(lambda: min_cut_variant(fresh(), inputs, None), "inductor")
    for b in budgets:
        add(lambda b=b: step_variant(fresh(), inputs, b), f"fxopt step {b}")
        add(lambda b=b: fxopt_backend_variant(fresh(), inputs, b, "eager"), f"fxopt backend {b}")
        add(
            lambda b=b: fxopt_backend_variant(fresh(), inputs, b, "inductor"),
            f"fxopt backend+inductor {b}",
        )
        add(lambda b=b: min_cut_variant(fresh(), inputs, b), f"inductor min-cut {b}")
    rows = measure_variants(variants, rounds)
    return {"model": key, "description": description, "rows": rows}


def summary_table(result: dict) -> Table:
    table = Table(title=result["model"], title_justify="left")
    for col in ("variant", "status", "peak", "time", "setup s", "grad err"):
        table.add_column(col)
    for r in result["rows"]:
        if r["status"] != "ok":
            table.add_row(r["variant"], r["status"], "", "", "", (r["error"] or "")[:60])
            continue
        table.add_row(
            r["variant"],
            "ok",
            f"{r['peak_ratio']:.3f}",
            f"{r['time_ratio']:.2f}",
            f"{r['setup_s']:.1f}",
            f"{r['max_grad_error']:.1e}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="bn_cnn only, budget 0.5")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "remat_compile.json"))
    args = parser.parse_args(argv)
    allocator = steady_allocator()  # glibc malloc pinned: see docs/measuring.md
    torch.set_num_threads(1)
    # Cold compiles for every variant: a cache hit from an earlier run (or an earlier
    # variant: AOTAutograd's cache key does not hold activation_memory_budget) would be
    # another variant's graph, and no setup time.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    models = args.models or (["bn_cnn"] if args.quick else list(MODELS))
    budgets = (0.5,) if args.quick else (0.5, 0.7)
    start = time.perf_counter()
    data = {
        "machine": machine_info(),
        "allocator": allocator,
        "command": command_line(),
        "config": {"budgets": budgets, "rounds": args.rounds, "threads": 1},
        "models": [],
    }
    for key in models:
        result = measure_model(key, budgets, args.rounds)
        data["models"].append(result)
        console.print(summary_table(result))
    data["runtime_s"] = time.perf_counter() - start
    write_json(Path(args.out), data)
    console.print(f"wrote {args.out} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
