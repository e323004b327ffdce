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
setup time (compile + first step), and the largest gradient difference from eager. Then a
frontier sweep on bn_cnn: fxopt+Inductor and min-cut at each of FRONTIER's budgets, to
compare the two at equal memory. Writes results/remat_compile.json and .png (the sweep).

    python benchmarks/remat_compile.py            # both models at 0.5 and 0.7, the sweep
    python benchmarks/remat_compile.py --quick    # bn_cnn only, budget 0.5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch._dynamo.utils import counters

from common import RESULTS, command_line, machine_info, steady_allocator, write_json
from fxopt import zoo
from fxopt.bench import paired_ratio
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

#: Timed rounds per model by default: a BN CNN step takes ~10 ms, where 15 samples leave
#: the fxopt/min-cut ratio within ±5 % of noise; 200 rounds of its 17 variants take ~40 s.
ROUNDS = {"bn_cnn": 200, "resnet18": 15}

#: Compiles of each Inductor variant compared (fxopt+Inductor, min-cut) per budget: one
#: plan compiled five times spread 3-5 % in time on the BN CNN (the frontier sweep shows
#: it each run), as much as the difference being measured, so the comparison averages
#: several.
COMPILES = {"bn_cnn": 3, "resnet18": 1}


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
    graphs = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        variant.run()
    variant.extra["first_step_s"] = time.perf_counter() - start
    if counters["stats"]["unique_graphs"] == graphs:
        # Every variant compiles the same code object (the model class's forward): past
        # Dynamo's recompile limit it would run eagerly and be measured as compiled.
        raise RuntimeError(f"{name}: Dynamo compiled no graph (recompile limit reached?)")
    variant.extra["warnings"] = [str(w.message)[:300] for w in caught if "fxopt" in str(w.message)]
    for p in model.parameters():
        p.grad = None
    return variant


def min_cut_variant(model, inputs, budget: float | None, copy_of: int = 1) -> Variant:
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

    name = "inductor" if budget is None else f"inductor min-cut {budget}" + _copy(copy_of)
    return compiled_variant(model, inputs, name, "torch", budget, backend=inductor_at_budget)


def _copy(index: int) -> str:
    """The name suffix of the index-th compile of one variant (none for the first)."""
    return f" (copy {index})" if index > 1 else ""


def fxopt_backend_variant(model, inputs, budget: float, compiler: str, copy_of: int = 1) -> Variant:
    plans: list = []
    label = "fxopt backend" + ("+inductor" if compiler == "inductor" else "")
    variant = compiled_variant(
        model,
        inputs,
        f"{label} {budget}{_copy(copy_of)}",
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


def compare_under_inductor(rows: list[dict], budgets: tuple[float, ...]) -> list[dict]:
    """fxopt backend+inductor against inductor min-cut at each budget, paired by round;
    with several compiles of each, a round's time is the mean over its compiles."""
    out = []
    for b in budgets:
        ours = _copies(rows, f"fxopt backend+inductor {b}")
        theirs = _copies(rows, f"inductor min-cut {b}")
        if ours and theirs:
            ratio = paired_ratio(_round_means(ours), _round_means(theirs))
            out.append({"budget": b, "compiles": len(ours), "time_vs_min_cut": ratio})
    return out


def _copies(rows: list[dict], name: str) -> list[dict]:
    """The measured rows of ``name`` and its further compiles (``name (copy i)``)."""
    found = [r for r in rows if r["variant"] == name or r["variant"].startswith(name + " (")]
    return found if found and all(r["status"] == "ok" for r in found) else []


def _round_means(copies: list[dict]) -> list[float]:
    return [statistics.fmean(round_) for round_ in zip(*(r["samples_s"] for r in copies))]


def measure_model(
    key: str,
    budgets: tuple[float, ...],
    rounds: int,
    compiles: int = 1,
    inductor_only: bool = False,
) -> dict:
    """Every variant at each budget, timed round-robin; ``inductor_only``: the frontier
    sweep, fxopt+Inductor and min-cut alone, and each min-cut point at equal memory."""
    description, model, inputs = MODELS[key]()
    console.print(f"[bold]{key}[/]: {description}" + (" (under Inductor)" * inductor_only))
    variants: list[Variant] = []

    def add(build, label):
        variants.extend(build_variants(build, label, model))

    def fresh():
        return copy.deepcopy(model)

    add(lambda: eager_variant(fresh(), inputs), "eager")
    add(lambda: min_cut_variant(fresh(), inputs, None), "inductor")
    for b in budgets:
        if not inductor_only:
            add(lambda b=b: step_variant(fresh(), inputs, b), f"fxopt step {b}")
            add(
                lambda b=b: fxopt_backend_variant(fresh(), inputs, b, "eager"),
                f"fxopt backend {b}",
            )
        for i in range(1, compiles + 1):  # each compile lays out its code and buffers anew
            add(
                lambda b=b, i=i: fxopt_backend_variant(fresh(), inputs, b, "inductor", i),
                f"fxopt backend+inductor {b}{_copy(i)}",
            )
            add(
                lambda b=b, i=i: min_cut_variant(fresh(), inputs, b, i),
                f"inductor min-cut {b}{_copy(i)}",
            )
    rows = measure_variants(variants, rounds)
    result = {
        "model": key,
        "description": description,
        "budgets": budgets,
        "rows": rows,
        "inductor_comparison": compare_under_inductor(rows, budgets),
    }
    if inductor_only:
        result["equal_memory"] = at_equal_memory(rows)
    return result


#: Budgets of the frontier sweep: where each tool's plans under Inductor land in peak
#: memory and step time, so the two can be compared at equal memory, not only at equal
#: budget numbers (the two budgets measure different things: a fraction of the graph's
#: peak for fxopt, of its saved activations between "save all" and "recompute all" for
#: min-cut).
FRONTIER = (0.1, 0.3, 0.5, 0.55, 0.6, 0.65, 0.7, 0.8)


#: Peaks within this fraction of each other are the same memory: the same plan from the
#: two tools measured 64 bytes apart in 2.7 MB.
SAME_PEAK = 1e-3


def at_equal_memory(rows: list[dict]) -> list[dict]:
    """For each min-cut point, fxopt's point at no more peak memory (within
    :data:`SAME_PEAK`) that is closest to it (the highest budget of those), and its time
    over min-cut's, paired by round; None where fxopt has no point that low. Not the
    fastest such point: several budgets give one plan, and the fastest of its copies
    would be picked for its noise."""
    ok = [r for r in rows if r["status"] == "ok"]
    ours = [r for r in ok if r["variant"].startswith("fxopt backend+inductor ")]
    out = []
    for theirs in (r for r in ok if r["variant"].startswith("inductor min-cut ")):
        most = theirs["peak_ratio"] * (1 + SAME_PEAK)
        fits = [r for r in ours if r["peak_ratio"] <= most]
        best = max(fits, key=lambda r: (r["peak_ratio"], r["budget"]), default=None)
        out.append(
            {
                "min_cut": theirs["variant"],
                "min_cut_peak": theirs["peak_ratio"],
                "fxopt": best and best["variant"],
                "fxopt_peak": best and best["peak_ratio"],
                "time_vs_min_cut": best and paired_ratio(best["samples_s"], theirs["samples_s"]),
            }
        )
    return out


def plot_frontier(frontier: dict, path: Path) -> None:
    """Peak memory against step time, one line per tool, each point labelled by budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    tools = (  # labels below the points for one tool, above for the other: they meet
        ("fxopt backend+inductor", "tab:blue", "o", -10),
        ("inductor min-cut", "tab:orange", "^", 5),
    )
    for prefix, color, marker, label_dy in tools:
        rows = [r for r in frontier["rows"] if r["variant"].startswith(prefix + " ")]
        rows = [r for r in rows if r["status"] == "ok"]
        ax.plot(
            [r["time_ratio"] for r in rows],
            [r["peak_ratio"] for r in rows],
            marker=marker,
            color=color,
            linestyle="none",
            label=prefix,
        )
        # Budgets that give one plan land at one peak: one label for them, at the left.
        same: dict[float, list[dict]] = {}
        for r in rows:
            same.setdefault(round(r["peak_ratio"], 4), []).append(r)
        for group in same.values():
            budgets = sorted(r["budget"] for r in group)
            label = f"{budgets[0]:g}" + (f"–{budgets[-1]:g}" if len(budgets) > 1 else "")
            left = min(group, key=lambda r: r["time_ratio"])
            ax.annotate(
                label,
                (left["time_ratio"], left["peak_ratio"]),
                xytext=(3, label_dy),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )
    for r in frontier["rows"]:
        if r["variant"] in ("eager", "inductor") and r["status"] == "ok":
            ax.plot(r["time_ratio"], r["peak_ratio"], "ks" if r["variant"] == "eager" else "kD")
            ax.annotate(r["variant"], (r["time_ratio"], r["peak_ratio"]), fontsize=8)
    ax.set_xlabel("step time (ratio to eager)")
    ax.set_ylabel("peak activation memory (ratio to eager)")
    ax.set_title(f"{frontier['model']} under Inductor: each point one budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    parser.add_argument("--budgets", nargs="+", type=float, default=None)
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed rounds (default: per model, ROUNDS)"
    )
    parser.add_argument("--out", default=str(RESULTS / "remat_compile.json"))
    parser.add_argument(
        "--no-frontier", action="store_true", help="skip the bn_cnn budget sweep under Inductor"
    )
    args = parser.parse_args(argv)
    allocator = steady_allocator()  # glibc malloc pinned: see docs/measuring.md
    torch.set_num_threads(1)
    # Cold compiles for every variant: a cache hit from an earlier run (or an earlier
    # variant: AOTAutograd's cache key does not hold activation_memory_budget) would be
    # another variant's graph, and no setup time.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    # One compile per variant of the same forward: 2 per budget and model, and more in a
    # frontier sweep, past Dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = 256
    models = args.models or (["bn_cnn"] if args.quick else list(MODELS))
    budgets = tuple(args.budgets or ((0.5,) if args.quick else (0.5, 0.7)))
    start = time.perf_counter()
    data = {
        "machine": machine_info(),
        "allocator": allocator,
        "command": command_line(),
        "config": {
            "budgets": budgets,
            "rounds": {key: args.rounds or ROUNDS[key] for key in models},
            "threads": 1,
        },
        "models": [],
    }
    for key in models:
        result = measure_model(key, budgets, args.rounds or ROUNDS[key], COMPILES[key])
        data["models"].append(result)
        console.print(summary_table(result))
    if not (args.quick or args.no_frontier):
        rounds = args.rounds or ROUNDS["bn_cnn"]
        data["frontier"] = measure_model("bn_cnn", FRONTIER, rounds, inductor_only=True)
        console.print(summary_table(data["frontier"]))
        plot_frontier(data["frontier"], Path(args.out).with_suffix(".png"))
    data["runtime_s"] = time.perf_counter() - start
    write_json(Path(args.out), data)
    console.print(f"wrote {args.out} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
