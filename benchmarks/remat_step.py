"""The whole training step: activations, gradients and optimizer state, and setup time.

Two sections, one process, one thread:

**Memory with the optimizer in the step.** ResNet and BERT from benchmarks/remat.py (the
``--quick`` sizes by default: ResNet-50 32×32 batch 4, 4-layer BERT seq 64; ``--full``: the
remat.py sizes), AdamW. Per variant: the bytes that persist between steps (parameters and
optimizer state), the peak of everything one step allocates on top of them (activations,
gradients, optimizer temporaries; ``fxopt.remat.measure.measure_total``), their sum, each
as a ratio to eager's; the CPU time per step as a ratio to eager's; and whether the
parameters after the step equal eager's bit for bit.

    eager                      forward, backward, optimizer.step()
    fxopt B                    compile_step(memory_budget=B, optimizer=...): graph, then step
    fxopt B in-backward        update_in_backward=True: each update in the backward

**Setup time.** compile_step's phases (capture, profile, plan, rewrite) against
``torch.compile(model, backend="aot_eager")``'s first step on the same model (ResNet-152,
batch 8, 64×64 with ``--full``).

Writes results/remat_step.json.

    python benchmarks/remat_step.py            # quick sizes, both sections
    python benchmarks/remat_step.py --full
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from common import RESULTS, command_line, machine_info, steady_allocator, write_json
from fxopt.remat import compile_step
from fxopt.remat.measure import measure_total
from remat import MODELS, console

BUDGETS = (1.0, 0.5)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer) -> int:
    return sum(
        _bytes(v for v in values.values() if torch.is_tensor(v))
        for values in optimizer.state.values()
    )


def memory_section(key: str, quick: bool, rounds: int) -> dict:
    description, model, inputs, loss_fn, _ = MODELS[key](quick)
    console.print(f"[bold]{key}[/]: {description}")
    variants = {}

    def eager_of(net):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)

        def run():
            optimizer.zero_grad(set_to_none=True)
            loss_fn(net, *inputs).backward()
            optimizer.step()

        return run, optimizer

    start_state = copy.deepcopy(model)
    variants["eager"] = (model, *eager_of(model))
    for budget in BUDGETS:
        for in_backward in (False, True):
            net = copy.deepcopy(start_state)
            optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
            try:
                step = compile_step(
                    net,
                    loss_fn,
                    inputs,
                    memory_budget=budget,
                    optimizer=optimizer,
                    update_in_backward=in_backward,
                )
            except Exception as error:  # an unreachable budget is a result, not a crash
                console.print(f"  fxopt {budget}: {type(error).__name__}: {error}")
                continue

            def run(step=step, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                step(*inputs)

            name = f"fxopt {budget}" + (" in-backward" if in_backward else "")
            variants[name] = (net, run, optimizer)
    # One step each from the same start: parameters must equal eager's (dropout: same seed).
    after = {}
    for name, (net, run, _) in variants.items():
        torch.manual_seed(0)
        run()
        after[name] = [p.detach().clone() for p in net.parameters()]
    rows = []
    for name, (net, run, optimizer) in variants.items():
        torch.manual_seed(0)
        transient = measure_total(run)
        persistent = _bytes(net.parameters()) + _state_bytes(optimizer)
        rows.append(
            {
                "variant": name,
                "parameter_bytes": _bytes(net.parameters()),
                "optimizer_state_bytes": _state_bytes(optimizer),
                "step_peak_bytes": transient,
                "total_bytes": persistent + transient,
                "params_equal_eager_after_one_step": all(
                    torch.equal(a, b) for a, b in zip(after[name], after["eager"])
                ),
                "samples_s": [],
            }
        )
    for _ in range(rounds):
        for row, (_, run, _) in zip(rows, variants.values()):
            start = time.process_time()
            run()
            row["samples_s"].append(time.process_time() - start)
    eager = rows[0]
    for row in rows:
        row["median_s"] = statistics.median(row["samples_s"])
        row["time_ratio"] = row["median_s"] / eager["median_s"]
        row["total_ratio"] = row["total_bytes"] / eager["total_bytes"]
        row["step_peak_ratio"] = row["step_peak_bytes"] / eager["step_peak_bytes"]
        console.print(
            f"  {row['variant']:24s} total {row['total_ratio']:.3f}  step peak "
            f"{row['step_peak_ratio']:.3f}  time {row['time_ratio']:.2f}  "
            f"equal {row['params_equal_eager_after_one_step']}"
        )
    return {"model": key, "description": description, "rows": rows}


def setup_section(quick: bool) -> dict:
    description, model, inputs, loss_fn, _ = MODELS["resnet"](quick)
    console.print(f"[bold]setup[/]: {description}")
    start = time.perf_counter()
    budget = 0.7 if quick else 0.5  # the quick ResNet-50 at 32 px cannot reach 0.5
    step = compile_step(copy.deepcopy(model), loss_fn, inputs, memory_budget=budget)
    fxopt_s = time.perf_counter() - start
    torch._dynamo.reset()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=False)
    start = time.perf_counter()
    loss_fn(compiled, *inputs).backward()
    aot_eager_s = time.perf_counter() - start
    result = {
        "description": description,
        "budget": budget,
        "fxopt_compile_step_s": fxopt_s,
        "fxopt_phases_s": step.setup_s,
        "aot_eager_first_step_s": aot_eager_s,
        "ratio": fxopt_s / aot_eager_s,
    }
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in step.setup_s.items())
    console.print(
        f"  compile_step {fxopt_s:.1f} s ({phases}); aot_eager first step {aot_eager_s:.1f} s"
    )
    return result


def _keep_sections_not_run(path: Path, data: dict, run: list[str]) -> None:
    """A section not run this time keeps its figures from the file, with the command and
    date of the run they came from (so RESULTS.md can say so)."""
    if not path.exists():
        return
    old = json.loads(path.read_text())
    for section in ("memory", "setup"):
        if section not in run and old.get(section):
            data[section] = old[section]
            origin = old.get("sections_from", {}).get(section) or {
                "command": old.get("command"),
                "date": old.get("machine", {}).get("date"),
            }
            data.setdefault("sections_from", {})[section] = origin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="remat.py's full sizes")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--sections", nargs="+", default=["memory", "setup"], choices=["memory", "setup"]
    )
    parser.add_argument("--out", default=str(RESULTS / "remat_step.json"))
    args = parser.parse_args(argv)
    allocator = steady_allocator()  # glibc malloc pinned: see docs/measuring.md
    torch.set_num_threads(1)
    quick = not args.full
    start = time.perf_counter()
    data = {
        "machine": machine_info(),
        "allocator": allocator,
        "command": command_line(),
        "config": {"quick": quick, "rounds": args.rounds, "budgets": BUDGETS},
        "memory": [
            memory_section(key, quick, args.rounds)
            for key in (args.models if "memory" in args.sections else [])
        ],
        "setup": setup_section(quick) if "setup" in args.sections else None,
    }
    data["runtime_s"] = time.perf_counter() - start
    _keep_sections_not_run(Path(args.out), data, args.sections)
    write_json(Path(args.out), data)
    console.print(f"wrote {args.out} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
