"""``fxopt remat MODEL --budget 0.5 [--planner NAME] [--offload] [--json] [--plot pareto.png]``.

Trains one step of MODEL (in training mode) with a synthetic loss, the sum of its
floating-point outputs (:func:`fxopt.remat.sum_of_outputs`: a tensor, or any nesting of
tuples, lists and dicts), eagerly and through fxopt.remat; prints the plan (what is
recomputed, bytes, estimated cost) and the measured result: peak activation memory and
saved activations (profiler allocation events, parameters and their gradients excluded),
median step time, and whether the gradients match eager's. With ``--offload`` the greedy
planner may also keep saved activations on the host (at ``--bandwidth`` GB/s each way);
on a CPU the memory that saves is the planner's simulation, and the output says so.
"""

from __future__ import annotations

from pathlib import Path

from fxopt.cli._common import add_model_argument, print_dumps, print_json

HELP = "fit a training step into less memory by recomputing activations"
BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)


def add_arguments(parser) -> None:
    add_model_argument(parser)
    parser.add_argument(
        "--budget",
        default="0.5",
        help="peak activation memory: a fraction in (0, 1] of the baseline peak, or bytes "
        "with a unit (e.g. 64MB, 1.5GiB) (default 0.5)",
    )
    parser.add_argument(
        "--planner",
        default="greedy",
        help="every_n, sqrt_n, greedy or optimal (default greedy)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="let the greedy planner also keep saved activations on the host",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=25.0,
        metavar="GB/S",
        help="host <-> device bandwidth of the offload cost model, each way "
        "(default 25: PCIe 4.0 x16)",
    )
    parser.add_argument(
        "--input", action="append", default=[], metavar="SHAPE", help="float32 input shape"
    )
    parser.add_argument("--runs", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--plot", type=Path, metavar="OUT.png", help="estimated peak vs cost, all planners"
    )
    parser.add_argument(
        "--dump-after",
        metavar="PASS",
        help="print the joint graph after this rewrite: split-dropouts, add-snapshots or recompute",
    )
    parser.add_argument(
        "--explain", action="store_true", help="list every site a rewrite skipped, and why"
    )


def parse_budget(text: str) -> float | int:
    """'0.5' → 0.5 (a fraction); '64MB' → 64000000 bytes; '2GiB' → 2147483648."""
    from fxopt.errors import UserInputError

    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    raw = text.strip().lower()
    for unit, factor in units.items():
        if raw.endswith(unit):
            try:
                return int(float(raw[: -len(unit)]) * factor)
            except ValueError:
                break
    else:
        if raw.endswith("b") and raw[:-1].isdigit():
            return int(raw[:-1])
        try:
            return float(raw)
        except ValueError:
            pass
    raise UserInputError(f"bad --budget '{text}': give a fraction like 0.5 or bytes like 64MB")


def run(args, console) -> int:
    from fxopt import models
    from fxopt.ir.copying import own_written_buffers, shared_copy
    from fxopt.remat import BudgetError, Offload, compile_step, sum_of_outputs
    from fxopt.remat.measure import boundary, measure_step, with_boundary_marker

    budget = _checked_options(args)
    loaded = models.load(args.model, args.input)
    model = loaded.model.train()
    inputs = loaded.example_inputs

    loss_fn = sum_of_outputs
    # The eager reference reads the same weights (its own parameter objects, so gradients
    # of its own) and updates buffers of its own: no copy of the weights.
    remat_model, eager_model = model, shared_copy(model)
    own_written_buffers(eager_model)
    with console.status(f"capturing, profiling and planning {args.model}"):
        step = compile_step(
            remat_model,
            loss_fn,
            inputs,
            memory_budget=budget,
            planner=args.planner,
            offload=Offload(args.bandwidth * 1e9) if args.offload else None,
            dump_after=(args.dump_after,) if args.dump_after else (),
            strict=True,  # the command reports a plan: a budget it misses is the answer
        )
    print_dumps(console, step.dumps)
    step.graph = with_boundary_marker(step.graph)

    def eager():
        loss = loss_fn(eager_model, *inputs)
        boundary()
        loss.backward()

    def optimized():
        step(*inputs)

    max_error, grads_match = _compare_gradients((eager, eager_model), (optimized, remat_model))
    memory = {
        "eager": measure_step(eager, eager_model),
        "optimized": measure_step(optimized, remat_model),
    }
    times = _step_times({"eager": eager, "optimized": optimized}, args.runs)
    report = step.report()
    result = {
        "model": args.model,
        "planner": args.planner,
        "budget": budget,
        "baseline": _figures(memory["eager"], times["eager"]),
        "optimized": _figures(memory["optimized"], times["optimized"]),
        "recomputed": report["recomputed"],
        "offload": report["offload"],
        "passes": report["passes"],
        "setup_s": report["setup_s"],
        "memory": report["setup_memory"],
        "grads_match": grads_match,
        "max_grad_error": max_error,
        "estimated": {
            "peak_activation_bytes": report["optimized"]["peak_activation_bytes"],
            "baseline_peak_activation_bytes": report["baseline"]["peak_activation_bytes"],
            "overhead": report["estimated_overhead"],
        },
    }
    if args.plot:
        _plot(step, args.plot, BudgetError)
    if args.json:
        print_json(result)
    else:
        _print_result(args, report, result)
    return 0 if result["grads_match"] else 1


def _checked_options(args) -> float | int:
    """The budget, once every option is known to be valid (before any expensive work)."""
    from fxopt.errors import UserInputError
    from fxopt.paths import writable_image
    from fxopt.remat import PLANNERS
    from fxopt.remat.runtime import REWRITES

    if args.plot is not None:
        writable_image(args.plot, "--plot")  # fails now, not after the training steps
    budget = parse_budget(args.budget)
    if args.planner not in PLANNERS:
        raise UserInputError(
            f"unknown planner '{args.planner}'; valid planners: {', '.join(PLANNERS)}"
        )
    if args.runs < 1:
        raise UserInputError(f"--runs must be at least 1, got {args.runs}")
    if args.offload and args.planner != "greedy":
        raise UserInputError(
            f"--offload is planned by the 'greedy' planner only, not '{args.planner}'"
        )
    if not args.bandwidth > 0:
        raise UserInputError(f"--bandwidth must be positive GB/s, got {args.bandwidth}")
    if args.dump_after is not None and args.dump_after not in REWRITES:
        raise UserInputError(
            f"cannot dump the graph after '{args.dump_after}': not a remat rewrite; valid "
            f"names: {', '.join(REWRITES)}"
        )
    return budget


def _compare_gradients(*runs) -> tuple[float, bool]:
    """Run each (step, model) once, from no gradients and the same seed: the largest
    difference between the gradients of the first and the second, and whether it is
    within tolerance of the first's largest gradient."""
    import torch

    grads = []
    for fn, m in runs:
        for p in m.parameters():
            p.grad = None
        torch.manual_seed(0)
        fn()
        grads.append([p.grad for p in m.parameters()])
    errors = [float((a - b).abs().max()) for a, b in zip(*grads) if a is not None]
    max_error = max(errors, default=0.0)
    scale = max((float(a.abs().max()) for a in grads[0] if a is not None), default=1.0)
    return max_error, max_error <= 1e-5 + 1e-4 * scale


def _step_times(steps: dict, runs: int) -> dict[str, list[float]]:
    """CPU seconds of ``runs`` calls of each step, interleaved so load hits all alike."""
    import time

    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(runs):
        for name, fn in steps.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return times


def _figures(memory, times: list[float]) -> dict:
    import statistics

    return {
        "peak_activation_bytes": memory.peak_bytes,
        "saved_activation_bytes": memory.saved_bytes,
        "step_ms": statistics.median(times) * 1e3,
    }


def _print_result(args, report: dict, result: dict) -> None:
    """The plan (up to 40 recomputed nodes) and the measured steps, as tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    out = Console()
    plan_table = Table(title=f"recomputed by '{args.planner}' ({len(report['recomputed'])})")
    for col in ("node", "op", "bytes", "est. time"):
        plan_table.add_column(col)
    for item in report["recomputed"][:40]:
        plan_table.add_row(
            item["name"], item["op"], f"{item['bytes']:,}", f"{item['time_s'] * 1e6:.0f} µs"
        )
    if len(report["recomputed"]) > 40:
        plan_table.add_row(f"... {len(report['recomputed']) - 40} more", "", "", "")
    out.print(plan_table)
    offload = report["offload"]
    if offload:
        moved = Table(title=f"offloaded to the host ({len(offload['nodes'])})")
        for col in ("node", "op", "bytes"):
            moved.add_column(col)
        for item in offload["nodes"][:40]:
            moved.add_row(item["name"], item["op"], f"{item['bytes']:,}")
        if len(offload["nodes"]) > 40:
            moved.add_row(f"... {len(offload['nodes']) - 40} more", "", "")
        out.print(moved)
        where = (
            "simulated: host and device are one memory here, so the measured peak below "
            "does not show it"
            if offload["simulated"]
            else "applied"
        )
        out.print(
            f"offload: {offload['bytes'] / 2**20:.2f} MiB, modelled transfer "
            f"{offload['transfer_s'] * 1e3:.2f} ms per step at "
            f"{offload['bandwidth_bytes_s'] / 1e9:g} GB/s ({where})"
        )
    summary = Table(title=f"{args.model}: one training step, budget {args.budget}")
    for col in ("", "peak activations", "saved at boundary", "step ms"):
        summary.add_column(col)
    for name in ("baseline", "optimized"):
        f = result[name]
        summary.add_row(
            name,
            f"{f['peak_activation_bytes'] / 2**20:.2f} MiB",
            f"{(f['saved_activation_bytes'] or 0) / 2**20:.2f} MiB",
            f"{f['step_ms']:.1f}",
        )
    out.print(summary)
    out.print(
        f"gradients {'match' if result['grads_match'] else 'DIFFER'} "
        f"(max abs error {result['max_grad_error']:.2e}); "
        f"estimated overhead {report['estimated_overhead']:.1%}"
    )
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in result["setup_s"].items())
    out.print(f"setup: {phases}")
    if args.explain:
        from fxopt import report as render

        render.print_skipped(out, report)


def _plot(step, path: Path, budget_error) -> None:
    """Estimated peak (fraction of baseline) vs estimated recompute overhead, per planner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fxopt.remat import PLANNERS, plan

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name in PLANNERS:
        points = []
        for budget in BUDGETS:
            try:
                p = plan(step.table, budget, name, time_limit_s=10.0)
            except budget_error:
                continue
            points.append((p.estimated_overhead, p.peak / p.baseline_peak, budget))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    ax.set_xlabel("estimated recompute time / step time")
    ax.set_ylabel("simulated peak / baseline peak")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
