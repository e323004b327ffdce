"""``fxopt optimize MODEL [--preset NAME | --passes a,b] [--json] [--report OUT.md] ...``.

Captures MODEL, runs the pass pipeline, picks a layout, verifies the result and times it
(:func:`fxopt.api.optimize`); prints the report table and the verification lines, or one
JSON object (keys in docs/architecture.md). Torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console

from fxopt.cli._common import (
    add_memory_check_argument,
    add_model_argument,
    print_dumps,
    print_json,
    stdout,
)
from fxopt.errors import UserInputError

HELP = "optimize a model for inference and verify it"


def add_arguments(opt: argparse.ArgumentParser) -> None:
    add_model_argument(opt)
    opt.add_argument("--preset", help="pass preset (default: speed)")
    opt.add_argument("--passes", help="comma-separated pass names (instead of --preset)")
    opt.add_argument(
        "--mode",
        choices=("auto", "fx", "export"),
        default="auto",
        help="capture level: module-level fx, ATen-level export, or auto (fx when it "
        "captures the model faithfully, else export; default)",
    )
    opt.add_argument(
        "--dynamic",
        choices=("batch", "all", "none"),
        default="batch",
        help="dims that may vary between calls: batch (dim 0 of every input; default), "
        "all (every dim the model lets vary: sequence and cache lengths) or none (the "
        "module accepts the example's shapes only)",
    )
    opt.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="float32 random input of this shape, e.g. 1x3x224x224 (repeatable)",
    )
    opt.add_argument(
        "--no-autotune",
        dest="autotune",
        action="store_false",
        help="skip the layout step (fused kernels, channels-last, the original model)",
    )
    opt.add_argument(
        "--layout",
        choices=(
            "plain",
            "original",
            "channels_last",
            "onednn",
            "onednn_inductor",
            "plain_inductor",
            "onednn_channels_last",
        ),
        help="use this layout candidate (built and verified, not timed) instead of the fastest",
    )
    opt.add_argument(
        "--fast-math",
        action="store_true",
        help="also apply rewrites exact for finite inputs only (x + 0 → x, oneDNN's fused "
        "ReLU, attention on SDPA unchecked); the report lists them",
    )
    opt.add_argument(
        "--runs",
        type=int,
        default=30,
        help="timed calls per variant (at most: timing stops after 10 s once 5 calls of each ran;"
        " 0 skips timing; default 30)",
    )
    opt.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads while timing (default 1: steadier on shared CPUs)",
    )
    add_memory_check_argument(opt, "optimize")
    opt.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    opt.add_argument("--report", type=Path, metavar="OUT.md", help="write a Markdown report")
    opt.add_argument("--plot", type=Path, metavar="OUT.png", help="write a bar chart")
    opt.add_argument(
        "--explain", action="store_true", help="print every site a pass skipped, with the reason"
    )
    opt.add_argument("--dump-after", metavar="PASS", help="print the graph after this pass")


def run(args, console: Console) -> int:
    from fxopt import report as render
    from fxopt.paths import writable, writable_image

    passes = _chosen_passes(args)
    _check_dump_after(args.dump_after, passes, args.preset)
    if args.runs < 0:
        raise UserInputError(f"--runs must be 0 or more, got {args.runs}")
    if args.report is not None:  # before the work, not after it
        writable(args.report, "--report")
    if args.plot is not None:
        writable_image(args.plot, "--plot")
    with console.status(f"optimizing {args.model} ({args.mode})") as status:
        result = run_one(
            args.model,
            args.mode,
            progress=_phase_progress(status, f"optimizing {args.model} ({args.mode})"),
            inputs=args.input,
            preset=args.preset,
            passes=passes,
            runs=args.runs,
            autotune=args.autotune,
            dynamic=args.dynamic,
            dump_after=args.dump_after,
            memory_check=args.memory_check,
            layout=args.layout,
            fast_math=args.fast_math,
        )
    print_dumps(console, result["dumps"])
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(render.markdown([result]))
    if args.plot:
        render.plot([result], args.plot)
    if args.json:
        print_json(result)
    else:
        _print_optimized(result, explain=args.explain)
    return 0


def run_one(
    spec: str,
    mode: str,
    *,
    inputs=(),
    preset=None,
    passes=None,
    runs=30,
    autotune=None,
    dynamic="batch",
    dump_after=None,
    progress=None,
    memory_check=True,
    layout=None,
    fast_math=False,
):
    """Load the model ``spec`` and optimize it: its report dict."""
    from fxopt import api, models

    loaded = models.load(spec, inputs)
    result = api.optimize(
        loaded.model,
        loaded.example_inputs,
        progress=progress,
        preset=preset,
        passes=passes,
        mode=mode,
        dynamic=None if dynamic == "none" else dynamic,
        benchmark_runs=runs,
        name=spec.removeprefix("zoo:"),
        autotune=None if autotune else False,
        dump_after=(dump_after,) if dump_after else (),
        memory_check=memory_check,
        layout=layout,
        fast_math=fast_math,
    )
    return result.report


def _phase_progress(status, what: str):
    """Each phase as it starts: in the spinner on a terminal, else one line on stderr (a
    log or CI job otherwise shows nothing for a minute on a big model)."""
    interactive = sys.stderr.isatty()
    started = time.perf_counter()

    def on_start(phase: str) -> None:
        if interactive:
            status.update(f"{what}: {phase}")
        else:
            elapsed = time.perf_counter() - started
            print(f"fxopt: {what}: {phase} (at {elapsed:.1f} s)", file=sys.stderr, flush=True)

    return on_start


def _check_dump_after(name: str | None, passes: list[str] | None, preset: str | None) -> None:
    """A --dump-after naming no pass of the pipeline fails before any work."""
    from fxopt.passes import pipelines, resolve

    if name is None:
        return
    names = (
        [resolve(p).name for p in passes]
        if passes is not None
        else pipelines.get(preset or "speed").pass_names()
    )
    if name not in names:
        raise UserInputError(
            f"cannot dump the graph after '{name}': not a pass of this pipeline; its passes: "
            f"{', '.join(names) or '(none)'}"
        )


def _chosen_passes(args) -> list[str] | None:
    """The --passes names (None: a preset), checked before any work: an unknown pass or
    preset, or both options at once, is an error."""
    from fxopt.passes import pipelines, resolve

    if args.passes is None:
        pipelines.get(args.preset or "speed")
        return None
    if args.preset is not None:
        raise UserInputError("give --passes or --preset, not both")
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not passes:
        raise UserInputError(f"--passes {args.passes!r} names no pass; e.g. --passes cse,dce")
    for name in passes:
        resolve(name)  # unknown names fail before any work
    return passes


def _print_optimized(result: dict, *, explain: bool) -> None:
    """The report table, the verification lines and, with ``explain``, the skipped sites."""
    from fxopt import report as render

    out = stdout()
    out.print(render.table([result]))
    for line in render.verified_lines(result):
        out.print(line, highlight=False, soft_wrap=True, markup=False)
    if explain:
        render.print_skipped(out, result)
