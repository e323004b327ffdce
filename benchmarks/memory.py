"""How much memory beyond the model does each job need? fxopt beside the peer tools.

Every job runs in a fresh process. Once the model and its inputs are built, the process's
resident high-water mark is reset (``/proc/self/clear_refs``); the job's peak resident
memory beyond that point, as a multiple of the model's weight bytes, is what a machine
must hold on top of the model (docs/measuring: RSS of a fresh process, not the allocator
replay, since this is about what a machine can run). fxopt's own jobs also report their
peak per phase (``report["memory"]``), kept in the JSON.

Jobs, on Llama-shaped ``LlamaForCausalLM`` models (random weights, ids of 1 × 32 tokens):

    optimize        fxopt.optimize(model, ids)                (defaults: speed preset)
    torch.compile   torch.compile(model)(ids), one call       (Inductor, no freezing)
    torch.export    torch.export.export(model, (ids,))
    convert         fxopt.circle.convert(model, (ids,)).save(path)   (validated in a runtime)
    tico            tico.convert(model, (ids,)).save(path)   (the `peers` extra)

and training the same models (eager attention, batch 2 × 256 tokens, ``--tokens``, with a
padding mask, the LM loss; parameter gradients are part of every step's peak; before each step,
``malloc_trim`` gives back what the allocator kept from the step before, so a step is
measured from what is live):

    train eager     forward + backward, first step and the steady (second) step
    compile_step    fxopt.remat.compile_step at budget 0.5: first step (capture, profile,
                    plan, run) and the steady step
    remat backend   torch.compile(model, backend=fxopt.remat.backend(0.5)): the same
    aot_eager       torch.compile(model, backend="aot_eager"): the same

and the command line as a user runs it, on ``benchmarks/large_graph.py:llama_<size>``
(wall time and the whole process's max RSS, the model it builds included):

    fxopt optimize  fxopt optimize MODEL --json
    fxopt convert   fxopt convert MODEL -o OUT.circle --json    (validated in a runtime)

Sizes: about 0.1, 0.7 and 3 GiB of fp32 weights (``--sizes``); ``--xl`` adds a 6 GiB
(1.6B-parameter) Llama for optimize, torch.compile, convert and the two commands.

    python benchmarks/memory.py                # ~40 min on this 2-core machine
    python benchmarks/memory.py --quick        # the 0.1 GiB models only, ~5 min
    python benchmarks/memory.py --xl --jobs optimize convert torch.compile --sizes xl

Outputs: results/memory.json and results/memory.png (peak beyond the model against model
size, per job); RESULTS.md's section is generated from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import RESULTS, ROOT, command_line, machine_info, write_json

#: Llama-shaped decoders (hidden, layers, intermediate, heads): ~0.1, 0.7, 3 and 6 GiB fp32.
LLAMA = {
    "small": (512, 4, 1792, 8),
    "medium": (1024, 8, 3584, 16),
    "large": (2048, 14, 5632, 16),
    "xl": (2048, 28, 5632, 16),
}
INFERENCE_JOBS = ("optimize", "torch.compile", "torch.export", "convert", "tico")
TRAINING_JOBS = ("train eager", "compile_step", "remat backend", "aot_eager")
#: The command line as a user runs it, on the model ``benchmarks/large_graph.py:llama_<size>``
#: builds: its whole process (the model, torch and all), wall time and max RSS.
CLI_JOBS = ("fxopt optimize", "fxopt convert")
JOBS = INFERENCE_JOBS + TRAINING_JOBS + CLI_JOBS
VOCAB = 32000
#: Tokens per training sequence (batch 2), by default: enough that activations, the memory
#: remat trades for time, weigh beside the gradients (at 64 tokens they are 0.2x the
#: weights of the 0.7 GiB model, and the end of the backward, all gradients, is every
#: step's peak).
TOKENS = 256
#: Training jobs run this many steps: the first (setup included) and a steady one.
STEPS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium", "large"])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
    parser.add_argument("--xl", action="store_true", help="add the 6 GiB Llama (inference)")
    parser.add_argument("--quick", action="store_true", help="the small models only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="per training sequence")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per job, seconds")
    parser.add_argument("--merge", action="store_true", help="keep rows of other jobs/sizes")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    parser.add_argument("--child", nargs=2, metavar=("JOB", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(*args.child, threads=args.threads, tokens=args.tokens)))
        return
    sizes = ["small"] if args.quick else list(args.sizes)
    if args.xl and "xl" not in sizes:
        sizes.append("xl")
    plan = [(job, size) for size in sizes for job in args.jobs if size != "xl" or job in XL_JOBS]
    old = json.loads(args.out.read_text()) if args.merge and args.out.exists() else {}
    rows = [r for r in old.get("rows", []) if (r["job"], r["size"]) not in set(plan)]
    for job, size in plan:
        row = run_fresh(job, size, args.threads, args.tokens, args.timeout)
        rows.append(row)
        print(_line(row), flush=True)
    earlier = old.get("commands") or ([old["command"]] if old.get("command") else [])
    merged = args.merge and bool(old)
    # A merge keeps the machine line of the run the file came from; the machine of each
    # run merged into it is listed beside its command (``merged_runs``).
    this_run = {"command": command_line(), "machine": machine_info()}
    data = {
        "machine": old["machine"] if merged else this_run["machine"],
        "command": command_line(),
        # Every run whose rows this file holds (--merge re-runs some into it).
        "commands": [*earlier, command_line()] if args.merge else [command_line()],
        "merged_runs": [*old.get("merged_runs", []), this_run] if merged else [],
        "config": {
            "threads": args.threads,
            "llama": LLAMA,
            "vocab": VOCAB,
            "inference_ids": [1, 32],
            "training_ids": [2, args.tokens],
        },
        "rows": sorted(rows, key=_order),
    }
    write_json(args.out, data)
    plot(data, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


XL_JOBS = ("optimize", "torch.compile", "convert", *CLI_JOBS)


def _order(row: dict) -> tuple:
    return (list(LLAMA).index(row["size"]), JOBS.index(row["job"]))


def _line(row: dict) -> str:
    if row.get("error"):
        return f"{row['job']:>14} {row['size']:>6}: {row['error'][:160]}"
    if "max_rss_gib" in row:
        done = "verified" if row.get("verified") or row.get("validated") else "NOT verified"
        return (
            f"{row['job']:>14} {row['size']:>6}: {done}, {row['wall_s']:.1f} s, "
            f"{row['max_rss_gib']:.2f} GiB max RSS in all"
        )
    steps = row.get("steps_beyond_x")
    shown = f"first {steps[0]:.2f}x, steady {steps[1]:.2f}x" if steps else ""
    return (
        f"{row['job']:>14} {row['size']:>6}: weights {row['weight_gib']:.2f} GiB, peak beyond "
        f"+{row['peak_beyond_x']:.2f}x ({row['peak_beyond_gib']:.2f} GiB) {shown} "
        f"in {row['wall_s']:.1f} s"
    )


def run_fresh(job: str, size: str, threads: int, tokens: int, timeout: float) -> dict:
    """One job in a fresh process; its row (or the error it ended with)."""
    if job in CLI_JOBS:
        return run_command_line(job, size, threads, timeout)
    command = [
        sys.executable,
        __file__,
        "--child",
        job,
        size,
        "--threads",
        str(threads),
        "--tokens",
        str(tokens),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    try:
        child = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"job": job, "size": size, "error": f"longer than {timeout:.0f} s"}
    if child.returncode != 0:
        last = [line for line in child.stderr.strip().splitlines() if line.strip()][-1:]
        return {"job": job, "size": size, "error": (last or ["exit"])[0][:400]}
    row = json.loads(child.stdout.strip().splitlines()[-1])
    row["process_s"] = round(time.perf_counter() - started, 1)
    return row


def run_command_line(job: str, size: str, threads: int, timeout: float) -> dict:
    """``fxopt optimize|convert benchmarks/large_graph.py:llama_<size> --json`` in a fresh
    process: its wall time, its whole max RSS (``ru_maxrss``: the model it builds
    included) and what its JSON says (verified / validated)."""
    command = job.split()[1]
    model = f"benchmarks/large_graph.py:llama_{size}"
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryFile("w+") as errors:
        argv = [sys.executable, "-m", "fxopt.cli", command, model, "--json"]
        if command == "optimize":  # convert has no --threads: torch's default (all cores)
            argv += ["--threads", str(threads)]
        else:
            argv += ["-o", str(Path(folder) / "model.circle")]
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        started = time.perf_counter()
        child = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=errors, text=True
        )
        timer = threading.Timer(timeout, child.kill)
        timer.start()
        stdout = child.stdout.read()  # type: ignore[union-attr]
        # Reaped here, not by Popen: wait4 gives this child's own max RSS.
        _, status, usage = os.wait4(child.pid, 0)
        timer.cancel()
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        errors.seek(0)
        stderr = errors.read()
    max_rss = usage.ru_maxrss * 1024
    if wall >= timeout:
        return {"job": job, "size": size, "error": f"longer than {timeout:.0f} s"}
    if child.returncode != 0:
        last = [line for line in stderr.strip().splitlines() if line.strip()][-1:]
        return {"job": job, "size": size, "error": (last or ["exit"])[0][:400]}
    report = json.loads(stdout)
    row = {
        "job": job,
        "size": size,
        "command": " ".join(["fxopt", *argv[3:]]).replace(folder, "TMP"),
        "max_rss_gib": round(max_rss / 2**30, 3),
        "wall_s": round(wall, 1),
    }
    if command == "optimize":
        row.update(verified=report["verified"], phases_s=report["phases_s"])
        row["weight_bytes"] = report["memory"]["weight_bytes"]
    else:
        row.update(validated=report["validated"], validation=report["validation"])
        row.update(file_bytes=report["bytes"], stages_ms=report["stages_ms"])
    return row


# --- the child: one job ---------------------------------------------------------------------


def run_child(job: str, size: str, threads: int, tokens: int) -> dict:
    import torch

    from fxopt import memory

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    training = job in TRAINING_JOBS
    model, inputs, loss_fn = _llama_training(size, tokens) if training else _llama(size)
    weights = memory.weight_bytes(model)
    _trim()  # what building the model freed is not the job's
    memory.reset_process_peak()
    baseline = memory.resident_bytes()
    started = time.perf_counter()
    extra = JOB_RUNNERS[job](model, inputs, loss_fn)
    wall = time.perf_counter() - started
    peak = memory.process_peak()
    beyond = peak - baseline
    row = {
        "job": job,
        "size": size,
        "weight_bytes": weights,
        "weight_gib": round(weights / 2**30, 3),
        "baseline_bytes": baseline,
        "peak_beyond_bytes": beyond,
        "peak_beyond_gib": round(beyond / 2**30, 3),
        "peak_beyond_x": round(beyond / weights, 3),
        "wall_s": round(wall, 2),
    }
    if "step_peaks" in extra:
        row["steps_beyond_x"] = [round((p - baseline) / weights, 3) for p in extra["step_peaks"]]
        row["steps_s"] = extra["step_s"]
    row.update({k: v for k, v in extra.items() if k not in ("step_peaks", "step_s")})
    return row


def _config(size: str, **options):
    from transformers import LlamaConfig

    hidden, layers, intermediate, heads = LLAMA[size]
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        use_cache=False,
        **options,
    )


def _llama(size: str):
    import torch
    from transformers import LlamaForCausalLM

    config = _config(size)

    class Logits(torch.nn.Module):
        """The LM's logits from token ids (the decoder as an inference job sees it)."""

        def __init__(self):
            super().__init__()
            self.lm = LlamaForCausalLM(config)

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    model = Logits().eval()
    return model, (torch.randint(0, VOCAB, (1, 32)),), None


def _llama_training(size: str, tokens: int = TOKENS):
    import torch
    from transformers import LlamaForCausalLM

    # Eager attention: compile_step cannot capture transformers' sdpa mask code, which
    # branches on the mask's values (issue 38); every job runs the same model.
    model = LlamaForCausalLM(_config(size, attn_implementation="eager")).train()
    ids = torch.randint(0, VOCAB, (2, tokens))
    mask = torch.ones(2, tokens, dtype=torch.long)
    mask[1, tokens * 3 // 4 :] = 0  # a padded sequence

    def loss_fn(model, ids, mask):
        return model(input_ids=ids, attention_mask=mask, labels=ids).loss

    return model, (ids, mask), loss_fn


def _optimize(model, inputs, _):
    import fxopt

    result = fxopt.optimize(model, inputs)
    report = result.report
    return {
        "verified": report["verified"],
        "layout": (report.get("layout") or {}).get("chosen"),
        "speedup": report["speedup"],
        "phases_s": report["phases_s"],
        "memory": report["memory"],
    }


def _compile(model, inputs, _):
    import torch

    compiled = torch.compile(model)
    with torch.no_grad():
        compiled(*inputs)
    return {}


def _export(model, inputs, _):
    import torch

    torch.export.export(model, inputs)
    return {}


def _convert(model, inputs, _):
    import fxopt.circle

    with tempfile.TemporaryDirectory() as folder:
        circle = fxopt.circle.convert(model, inputs)
        circle.save(Path(folder) / "model.circle")
    return {
        "validated": bool(circle.validation and circle.validation.validated),
        "validation": circle.validation.message if circle.validation else None,
        "file_bytes": circle.nbytes,
        "operators": len(circle.operators),
        "stages_ms": {k: round(v) for k, v in circle.report["stages_ms"].items()},
        "memory": circle.report["memory"],
    }


def _tico(model, inputs, _):
    import tico

    with tempfile.TemporaryDirectory() as folder:
        tico.convert(model, inputs).save(str(Path(folder) / "model.circle"))
    return {}


def _steps(step, inputs) -> dict:
    """Run ``step`` STEPS times; the peak of each (the first includes setup)."""
    from fxopt import memory

    peaks, seconds = [], []
    for _ in range(STEPS):
        # Memory the allocator kept from the step before is given back first, so each step
        # is measured from what is live (glibc keeps freed heap pages resident).
        _trim()
        memory.reset_process_peak()
        began = time.perf_counter()
        step(*inputs)
        seconds.append(round(time.perf_counter() - began, 3))
        peaks.append(memory.process_peak())
    return {"step_peaks": peaks, "step_s": seconds}


def _trim() -> None:
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _train_eager(model, inputs, loss_fn):
    def step(*xs):
        model.zero_grad(set_to_none=True)
        loss_fn(model, *xs).backward()

    return _steps(step, inputs)


def _compile_step(model, inputs, loss_fn):
    from fxopt import remat

    state: dict = {"budget": 0.5}

    def step(*xs):
        model.zero_grad(set_to_none=True)
        if "step" not in state:
            try:
                state["step"] = remat.compile_step(model, loss_fn, xs, memory_budget=0.5)
            except remat.BudgetError as error:
                # compile_step refuses a budget no plan meets; the backend takes its best
                # plan instead: the same here, at the lowest budget reached.
                state["budget"] = min(1.0, round(error.best_fraction + 0.005, 3))
                state["step"] = remat.compile_step(
                    model, loss_fn, xs, memory_budget=state["budget"]
                )
        state["step"](*xs)

    return {**_steps(step, inputs), "budget": state["budget"]}


def _backend(model, inputs, loss_fn, backend=None):
    import torch

    from fxopt import remat

    compiled = torch.compile(model, backend=backend or remat.backend(memory_budget=0.5))

    def step(*xs):
        model.zero_grad(set_to_none=True)
        loss_fn(compiled, *xs).backward()

    return _steps(step, inputs)


def _aot_eager(model, inputs, loss_fn):
    return _backend(model, inputs, loss_fn, backend="aot_eager")


JOB_RUNNERS = {
    "optimize": _optimize,
    "torch.compile": _compile,
    "torch.export": _export,
    "convert": _convert,
    "tico": _tico,
    "train eager": _train_eager,
    "compile_step": _compile_step,
    "remat backend": _backend,
    "aot_eager": _aot_eager,
}


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (inference, training) = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, jobs, title in (
        (inference, INFERENCE_JOBS, "inference jobs"),
        (training, TRAINING_JOBS, "training, first step"),
    ):
        for job in jobs:
            rows = [r for r in data["rows"] if r["job"] == job and not r.get("error")]
            if not rows:
                continue
            xs = [r["weight_gib"] for r in rows]
            ys = [
                r["steps_beyond_x"][0] if "steps_beyond_x" in r else r["peak_beyond_x"]
                for r in rows
            ]
            style = (
                "-o" if job in ("optimize", "convert", "compile_step", "remat backend") else "--s"
            )
            axis.plot(xs, ys, style, label=job)
        axis.set_xscale("log")
        sizes = sorted({r["weight_gib"] for r in data["rows"] if "weight_gib" in r})
        axis.set_xticks(sizes, [f"{size:.1f}" for size in sizes])
        axis.minorticks_off()
        axis.set_xlabel("weights (GiB, fp32)")
        axis.set_ylabel("peak memory beyond the model (× weights)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle("Peak resident memory beyond the model, fresh process per job")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
