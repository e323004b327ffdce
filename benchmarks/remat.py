"""How much activation memory does fxopt remat save, at what time cost, against the peers?

For ResNet-152 (bottlenecks [3, 8, 36, 3], batch 8, 64×64, BatchNorm in training mode)
and BERT-base (HF ``BertModel`` from a config, random weights, 12 layers, hidden 768,
batch 2, 128 tokens, dropout 0.1 in training mode), one training step (forward, loss,
backward; no optimizer) is measured, in one process, for:

    eager                      the model as written
    checkpoint                 torch.utils.checkpoint (non-reentrant) on every block
    min-cut B                  AOTAutograd with torch's min-cut partitioner at
                               activation_memory_budget B ∈ {1.0, 0.5, 0.2, 0.0}, fx code
                               (nop compilers, no Inductor), via functorch's aot_module
    fxopt PLANNER B            fxopt.remat: one capture and profile, then a plan per
                               planner and budget (fraction of the baseline's peak)

Per variant: peak activation+temporary memory and saved activations at the
forward/backward boundary (torch profiler allocation events, parameters and parameter
gradients excluded: fxopt.remat.measure), both as ratios to eager; median CPU time of a
step (one thread, variants interleaved round-robin) as a ratio to eager; the largest
gradient difference from eager under the same RNG seed. fxopt rows also carry the cost
model's estimates. Writes results/remat.json and results/remat.png (peak vs time).

    python benchmarks/remat.py --quick      # ResNet-50 64×64 batch 4, 4-layer BERT: minutes
    python benchmarks/remat.py              # the full configuration
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from common import RESULTS, command_line, machine_info, write_json
from fxopt import zoo
from fxopt.remat import compile_step
from fxopt.remat.measure import boundary, measure_step, with_boundary_marker

console = Console() if sys.stdout.isatty() else Console(width=150)

# 0.2 and 0.15: reachable on BERT since dropouts are recomputed by RNG-state replay
# (every-block checkpoint's peak is ~0.14 of eager's).
FXOPT_GRID = {
    "greedy": (0.7, 0.5, 0.4, 0.3, 0.2, 0.15),
    "optimal": (0.5, 0.4, 0.3, 0.2, 0.15),
    "every_n": (0.7, 0.5),
    "sqrt_n": (0.5,),
}
MIN_CUT_BUDGETS = (1.0, 0.5, 0.2, 0.0)


@dataclass
class Variant:
    name: str
    kind: str  # eager | checkpoint | min-cut | fxopt
    run: Callable[[], object] | None
    model: torch.nn.Module
    planner: str | None = None
    budget: float | None = None
    setup_s: float = 0.0
    status: str = "ok"
    error: str | None = None
    samples: list[float] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- models


def resnet(quick: bool):
    from fxopt.zoo.resnet import Bottleneck

    name, opts = (
        ("resnet50", {"batch": 4, "image": 32})
        if quick
        else ("resnet152", {"batch": 8, "image": 64})
    )
    entry = zoo.create(name, **opts)
    model = entry.model.train()
    x = entry.example_inputs[0]
    y = torch.randint(0, 1000, (x.shape[0],), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, x, y):
        return F.cross_entropy(m(x), y)

    blocks = lambda m: [b for b in m.modules() if isinstance(b, Bottleneck)]  # noqa: E731
    return entry.description, model, (x, y), loss_fn, blocks


def bert(quick: bool):
    from transformers import BertConfig, BertModel

    layers, seq = (4, 64) if quick else (12, 128)
    config = BertConfig(num_hidden_layers=layers, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = BertModel(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=generator)
    mask = torch.ones(2, seq, dtype=torch.long)
    mask[-1, seq - seq // 4 :] = 0
    # The additive 4-D mask HF builds from a 0/1 mask, built here: HF's own construction
    # branches on the mask's values, which AOTAutograd (min-cut and fxopt) cannot trace.
    mask = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min

    def loss_fn(m, ids, mask):
        return m(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean()

    description = (
        f"HF BertModel (transformers), {layers} layers, hidden 768, batch 2, seq {seq}, "
        "dropout 0.1, eager attention, additive 4-D padding mask, training mode"
    )
    return description, model, (ids, mask), loss_fn, lambda m: list(m.encoder.layer)


MODELS = {"resnet": resnet, "bert": bert}


# --------------------------------------------------------------------------- variants


def eager_variant(model, inputs, loss_fn) -> Variant:
    def run():
        loss = loss_fn(model, *inputs)
        boundary()
        loss.backward()
        return loss

    return Variant("eager", "eager", run, model)


def checkpoint_variant(model, inputs, loss_fn, blocks) -> Variant:
    from torch.utils.checkpoint import checkpoint

    def wrapped(forward, *args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    for block in blocks(model):
        block.forward = functools.partial(wrapped, block.forward)
    variant = eager_variant(model, inputs, loss_fn)
    variant.name, variant.kind = "checkpoint every block", "checkpoint"
    return variant


def min_cut_variant(model, inputs, loss_fn, budget: float) -> Variant:
    from functorch.compile import aot_module
    from torch._functorch.compilers import nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    compiled = aot_module(
        model,
        fw_compiler=nop,
        bw_compiler=nop,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )
    variant = eager_variant(compiled, inputs, loss_fn)
    variant.model = model
    variant.name, variant.kind, variant.budget = f"min-cut {budget}", "min-cut", budget
    return variant


def fxopt_variants(model, inputs, loss_fn, time_limit: float) -> list[Variant]:
    start = time.perf_counter()
    base = compile_step(model, loss_fn, inputs, memory_budget=1.0, profile_runs=3)
    setup = time.perf_counter() - start
    variants = []
    for planner, budgets in FXOPT_GRID.items():
        for budget in budgets:
            name = f"fxopt {planner} {budget}"
            v = Variant(name, "fxopt", None, model, planner=planner, budget=budget)
            try:
                start = time.perf_counter()
                step = base.replan(budget, planner, time_limit_s=time_limit)
                v.setup_s = setup + time.perf_counter() - start
                step.graph = with_boundary_marker(step.graph)
                v.run = functools.partial(step, *inputs)
                p = step.plan
                v.extra = {
                    "estimated_peak_ratio": p.peak / p.baseline_peak,
                    "estimated_saved_ratio": p.saved / p.baseline_saved,
                    "estimated_overhead": p.estimated_overhead,
                    "recomputed": len(p.recompute),
                    "plan_s": time.perf_counter() - start,
                    "plan_details": {k: v for k, v in p.details.items() if _jsonable(v)},
                }
            except Exception as error:
                v.status, v.error = _failure(error)
            variants.append(v)
    return variants


def _jsonable(value) -> bool:
    return isinstance(value, (int, float, str, bool, type(None)))


def _failure(error: Exception) -> tuple[str, str]:
    from fxopt.remat import BudgetError

    text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}"
    return ("unreachable" if isinstance(error, BudgetError) else "failed"), text[:400]


# --------------------------------------------------------------------------- measuring


def grads_of(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _check_against_eager(runnable: list) -> list:
    """Run each variant once from the same seed and fresh gradients; record its largest
    gradient difference from the first (eager). The variants still runnable after it."""
    reference = None
    for v in runnable:
        try:
            for p in v.model.parameters():
                p.grad = None
            torch.manual_seed(1234)
            start = time.perf_counter()
            v.run()  # the first call also compiles min-cut variants
            v.extra["first_call_s"] = time.perf_counter() - start
            grads = grads_of(v.model)
            if reference is None:
                reference = grads
            # A parameter the loss does not use has no gradient in eager (None) and a zero
            # one under AOTAutograd: compare as zeros.
            v.extra["max_grad_error"] = max(
                (
                    float(((a if a is not None else 0) - (b if b is not None else 0)).abs().max())
                    for a, b in zip(grads, reference)
                    if a is not None or b is not None
                ),
                default=0.0,
            )
        except Exception as error:
            v.status, v.error = _failure(error)
            traceback.print_exc(limit=4, file=sys.stderr)
    return [v for v in runnable if v.status == "ok"]


def measure_variants(variants: list[Variant], rounds: int) -> list[dict]:
    """Gradient check against the first variant (eager), then peak memory (one profiled
    step each), then CPU time per step (round-robin): one JSON row per variant."""
    runnable = _check_against_eager([v for v in variants if v.status == "ok"])
    for v in runnable:  # memory: one profiled step each
        m = measure_step(v.run, v.model)
        v.extra["peak_bytes"], v.extra["saved_bytes"] = m.peak_bytes, m.saved_bytes
    for done in range(1, rounds + 1):  # time: round-robin, CPU time per step
        for v in runnable:
            for p in v.model.parameters():
                p.grad = None
            start = time.process_time()
            v.run()
            v.samples.append(time.process_time() - start)
        if done % max(1, rounds // 15) == 0 or done == rounds:
            console.print(f"  round {done}/{rounds}")
    eager = next(v for v in variants if v.kind == "eager")
    base_t = statistics.median(eager.samples)
    rows = []
    for v in variants:
        row = {
            "variant": v.name,
            "kind": v.kind,
            "planner": v.planner,
            "budget": v.budget,
            "status": v.status,
            "error": v.error,
            "setup_s": round(v.setup_s, 2),
            **v.extra,
        }
        if v.status == "ok":
            med = statistics.median(v.samples)
            row.update(
                median_s=med,
                samples_s=v.samples,
                time_ratio=med / base_t,
                peak_ratio=v.extra["peak_bytes"] / eager.extra["peak_bytes"],
                saved_ratio=v.extra["saved_bytes"] / eager.extra["saved_bytes"],
            )
        rows.append(row)
    return rows


def build_variants(
    build: Callable[[], Variant | list[Variant]], label: str, model: torch.nn.Module
) -> list[Variant]:
    """``build()``'s variants, timed; one failed variant (with the reason) if it raised."""
    start = time.perf_counter()
    try:
        made = build()
    except Exception as error:
        status, text = _failure(error)
        console.print(f"  {label}: {status}: {text}")
        traceback.print_exc(limit=3, file=sys.stderr)
        made = Variant(label, label.split()[0], None, model, status=status, error=text)
    made = made if isinstance(made, list) else [made]
    for v in made:
        v.setup_s = v.setup_s or time.perf_counter() - start
    console.print(f"  built {label} in {time.perf_counter() - start:.1f} s")
    return made


def measure_model(key: str, quick: bool, rounds: int, time_limit: float) -> dict:
    description, model, inputs, loss_fn, blocks = MODELS[key](quick)
    console.print(f"[bold]{key}[/]: {description}")
    variants: list[Variant] = []

    def add(build: Callable[[], Variant | list[Variant]], label: str) -> None:
        variants.extend(build_variants(build, label, model))

    add(lambda: eager_variant(copy.deepcopy(model), inputs, loss_fn), "eager")
    add(lambda: checkpoint_variant(copy.deepcopy(model), inputs, loss_fn, blocks), "checkpoint")
    for b in MIN_CUT_BUDGETS:
        add(lambda b=b: min_cut_variant(copy.deepcopy(model), inputs, loss_fn, b), f"min-cut {b}")
    add(lambda: fxopt_variants(copy.deepcopy(model), inputs, loss_fn, time_limit), "fxopt")

    rows = measure_variants(variants, rounds)
    return {"model": key, "description": description, "rows": rows}


def plot(data: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = data["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    styles = {
        "eager": ("k", "o"),
        "checkpoint": ("tab:red", "s"),
        "min-cut": ("tab:orange", "^"),
        "greedy": ("tab:blue", "o"),
        "optimal": ("tab:green", "D"),
        "every_n": ("tab:purple", "v"),
        "sqrt_n": ("tab:brown", "P"),
    }
    for ax, result in zip(axes[0], models):
        groups: dict[str, list] = {}
        for r in result["rows"]:
            if r["status"] != "ok":
                continue
            key = r["planner"] or r["kind"]
            groups.setdefault(key, []).append(r)
        for key, rows in groups.items():
            color, marker = styles.get(key, ("gray", "x"))
            rows = sorted(rows, key=lambda r: r["time_ratio"])
            ax.plot(
                [r["time_ratio"] for r in rows],
                [r["peak_ratio"] for r in rows],
                marker=marker,
                color=color,
                linestyle="-" if len(rows) > 1 else "none",
                label=key if key in ("eager", "checkpoint", "min-cut") else f"fxopt {key}",
            )
            for r in rows:
                if r["budget"] is not None:
                    ax.annotate(f"{r['budget']:g}", (r["time_ratio"], r["peak_ratio"]), fontsize=7)
        ax.axhline(0.5, color="gray", linewidth=0.5, linestyle=":")
        ax.axvline(1.1, color="gray", linewidth=0.5, linestyle=":")
        ax.set_title(result["model"])
        ax.set_xlabel("step time / eager (CPU, 1 thread)")
        ax.set_ylabel("peak activation memory / eager")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_table(result: dict) -> Table:
    table = Table(title=result["model"], title_justify="left")
    for col in ("variant", "status", "peak", "saved", "time", "est. peak", "grad err"):
        table.add_column(col)
    for r in result["rows"]:
        if r["status"] != "ok":
            table.add_row(r["variant"], r["status"], "", "", "", "", (r["error"] or "")[:60])
            continue
        est = r.get("estimated_peak_ratio")
        table.add_row(
            r["variant"],
            "ok",
            f"{r['peak_ratio']:.2f}",
            f"{r['saved_ratio']:.2f}",
            f"{r['time_ratio']:.2f}",
            "" if est is None else f"{est:.2f}",
            f"{r['max_grad_error']:.1e}",
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller configs (minutes)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7/5)")
    parser.add_argument("--time-limit", type=float, default=30.0, help="MILP seconds per plan")
    parser.add_argument("--out", default=str(RESULTS / "remat.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = args.rounds or (7 if args.quick else 5)
    start = time.perf_counter()
    data = {
        "machine": machine_info(),
        "command": command_line(),
        "config": {
            "quick": args.quick,
            "rounds": rounds,
            "fxopt_grid": FXOPT_GRID,
            "min_cut_budgets": MIN_CUT_BUDGETS,
            "milp_time_limit_s": args.time_limit,
        },
        "models": [],
    }
    for key in args.models:
        result = measure_model(key, args.quick, rounds, args.time_limit)
        data["models"].append(result)
        console.print(summary_table(result))
    data["runtime_s"] = time.perf_counter() - start
    data["machine"]["load_avg_1min"] = machine_info()["load_avg_1min"]
    from pathlib import Path

    out = Path(args.out)
    write_json(out, data)
    plot(data, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
