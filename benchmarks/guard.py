"""What the input guard costs per call: the check every optimized module runs first.

For each model, ``fxopt.optimize`` (speed preset's passes, no layout step, dynamic batch)
gives a guarded module; then, in one process, one torch thread:

    guard alone        InputGuard(*inputs) on the example: the contract check (dtype,
                       device, rank, static dims, symbol ranges, relations) and, for
                       export graphs, torch.export's own guard function
    contract alone     the contract check without torch.export's guard function
    guarded / bare     the optimized module with and without its guard, timed
                       interleaved round-robin (per-call time.process_time, medians)

and reports the guard's µs per call and as a fraction of the module's latency (ResNet-50
at batch 1 is the issue's yardstick).

    python benchmarks/guard.py            # ~3 min on this 2-core machine
    python benchmarks/guard.py --quick    # small models only, ~20 s
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

import fxopt
from common import RESULTS, command_line, machine_info, write_json
from fxopt import zoo
from fxopt.ir import contract, shapes
from fxopt.ir.copying import clone_module

FULL = [
    ("resnet50", {"image": 224, "batch": 1}, "fx"),
    ("resnet50", {"image": 224, "batch": 1}, "export"),
    ("bert", {"config": "base", "seq": 128, "batch": 1}, "fx"),
    ("bert", {"config": "base", "seq": 128, "batch": 1}, "export"),
    ("mlp", {}, "fx"),
]
QUICK = [("resnet18", {"image": 64}, "fx"), ("bert", {"seq": 16}, "export"), ("mlp", {}, "fx")]


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean CPU time of ``calls`` calls, in µs."""
    samples = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.process_time()
            for _ in range(calls):
                fn()
            samples.append((time.process_time() - start) / calls * 1e6)
        finally:
            gc.enable()
    return statistics.median(samples)


def interleaved_ms(modules: dict, inputs: tuple, rounds: int) -> dict[str, float]:
    """Median per-call CPU ms of each module, called round-robin."""
    times: dict[str, list[float]] = {name: [] for name in modules}
    with torch.inference_mode():
        for module in modules.values():  # warm-up
            module(*inputs)
            module(*inputs)
        for _ in range(rounds):
            for name, module in modules.items():
                start = time.process_time()
                module(*inputs)
                times[name].append((time.process_time() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def measure(name: str, options: dict, mode: str, rounds: int) -> dict:
    entry = zoo.create(name, **options)
    result = fxopt.optimize(
        entry.model, entry.example_inputs, mode=mode, autotune=False, benchmark_runs=0
    )
    guarded = result.module
    guard = contract.guard_of(guarded)
    assert guard is not None
    values = shapes.placeholder_values(guarded, entry.example_inputs)
    guard_us = per_call_us(lambda: guard(*values), calls=2000)
    contract_us = per_call_us(lambda: guard.contract.check(values), calls=2000)
    bare = contract.remove(clone_module(guarded))
    latency = interleaved_ms({"guarded": guarded, "bare": bare}, entry.example_inputs, rounds)
    return {
        "model": name,
        "options": options,
        "mode": mode,
        "contract": result.contract.describe(),
        "relations": len(result.contract.relations),
        "export_guards": guard.export_guards is not None,
        "guard_us": round(guard_us, 2),
        # fxopt's own check; the rest of guard_us is torch.export's guard function
        "contract_us": round(contract_us, 2),
        "latency_ms": {k: round(v, 4) for k, v in latency.items()},
        "guard_fraction_of_latency": guard_us / 1e3 / latency["bare"],
        "guarded_over_bare": latency["guarded"] / latency["bare"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models only")
    parser.add_argument("--out", type=Path, default=RESULTS / "guard.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    configs = QUICK if args.quick else FULL
    rows = []
    for name, options, mode in configs:
        rounds = 30 if name in ("resnet50", "bert") and not args.quick else 200
        row = measure(name, options, mode, rounds)
        rows.append(row)
        print(
            f"{name} ({mode}): guard {row['guard_us']:.1f} µs/call, "
            f"{row['guard_fraction_of_latency']:.2e} of {row['latency_ms']['bare']:.3f} ms; "
            f"guarded/bare {row['guarded_over_bare']:.3f}",
            flush=True,
        )
    write_json(
        args.out,
        {
            "benchmark": "guard",
            "command": command_line(),
            "machine": machine_info(),
            "config": {"quick": args.quick, "threads": 1},
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
