"""The ``fxopt`` command. The only module that reads options from outside.

Exit status: 0 on success, 2 for a user mistake (bad MODEL spec, missing file, bad shape,
unknown pass or preset, untraceable model), 1 for an internal failure (a pass that broke
or a result that failed verification). Errors print one line; ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fxopt import __version__
from fxopt.errors import FxoptError, UserInputError

DEMO_MODELS: tuple[tuple[str, str], ...] = (
    ("zoo:redundant", "fx"),
    ("zoo:redundant", "export"),
    ("zoo:mlp", "fx"),
    ("zoo:cnn_bn", "fx"),
    ("zoo:resnet18?image=32", "fx"),
    ("zoo:mobilenet_v2?image=32", "fx"),
    ("zoo:resnet18?image=32", "export"),
    ("zoo:bert", "fx"),
    ("zoo:gpt", "fx"),
)


# Subcommands that live beside their job. Each module has `HELP`, `add_arguments(parser)`
# and `run(args, console) -> int`, and imports torch only inside `run`, so `fxopt --help`
# stays fast. Listed here, not registered on import: the CLI's shape is readable in one place.
COMMAND_MODULES: dict[str, str] = {
    "tile": "fxopt.tiling.cli",
    "remat": "fxopt.remat.cli",
    "convert": "fxopt.circle.cli",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxopt", description="Graph optimizer for PyTorch: every rewrite verified."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"fxopt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_optimize_arguments(
        commands.add_parser("optimize", help="optimize a model for inference and verify it")
    )
    commands.add_parser("passes", help="list the available passes and presets")
    _add_demo_arguments(
        commands.add_parser("demo", help="optimize several built-in models and report")
    )
    for name, module_name in COMMAND_MODULES.items():
        module = importlib.import_module(module_name)
        module.add_arguments(commands.add_parser(name, help=module.HELP))
    return parser


def _add_optimize_arguments(opt: argparse.ArgumentParser) -> None:
    opt.add_argument(
        "model",
        metavar="MODEL",
        help="zoo:NAME[?k=v&...], path/to/file.py:CALLABLE or pkg.module:CALLABLE",
    )
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
        choices=("batch", "none"),
        default="batch",
        help="dims that may vary between calls: batch (dim 0 of every input; default) or "
        "none (the module accepts the example's shapes only)",
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
        choices=("plain", "original", "channels_last", "onednn", "onednn_channels_last"),
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
    opt.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="optimize even when the machine seems to have less memory free than the job needs",
    )
    opt.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    opt.add_argument("--report", type=Path, metavar="OUT.md", help="write a Markdown report")
    opt.add_argument("--plot", type=Path, metavar="OUT.png", help="write a bar chart")
    opt.add_argument(
        "--explain", action="store_true", help="print every site a pass skipped, with the reason"
    )
    opt.add_argument("--dump-after", metavar="PASS", help="print the graph after this pass")


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("out/demo"),
        help="directory for report.md, report.json and optimize.png",
    )
    demo.add_argument("--runs", type=int, default=30, help="timed calls per variant")
    demo.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def main(argv: Sequence[str] | None = None) -> int:
    # The torch profiler (remat measures memory with it) prints a USDT line per profiling
    # session to stderr unless kineto's log level is raised before torch loads it.
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return _run_command(args, console)
    except UserInputError as error:
        if args.debug:
            raise
        console.print(f"[bold red]fxopt: error:[/] {escape(str(error))}", **_ONE_LINE)
        return 2
    except FxoptError as error:
        if args.debug:
            raise
        console.print(
            f"[bold red]fxopt: {type(error).__name__}:[/] {escape(str(error))}", **_ONE_LINE
        )
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a bug in fxopt: one line, and how to see more
        if args.debug:
            raise
        console.print(
            f"[bold red]fxopt: internal error:[/] {type(error).__name__}: {escape(str(error))} "
            "(run with --debug for the traceback)",
            **_ONE_LINE,
        )
        return 1


def _run_command(args, console: Console) -> int:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise UserInputError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    if args.command == "optimize":
        return _optimize(args, console)
    if args.command == "passes":
        return _passes()
    if args.command == "demo":
        return _demo(args, console)
    if args.command in COMMAND_MODULES:
        return importlib.import_module(COMMAND_MODULES[args.command]).run(args, console)
    return 0


# Error lines: no highlighting, no wrapping; messages are escaped, since shapes such as
# float32[s0 >= 1, 8] would otherwise read as rich markup.
_ONE_LINE = {"highlight": False, "soft_wrap": True}


def _stdout() -> Console:
    # Piped output has no terminal width; 150 columns keep the report table unwrapped.
    return Console() if sys.stdout.isatty() else Console(width=150)


def _run_one(
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


def _optimize(args, console: Console) -> int:
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
        result = _run_one(
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
    for name, text in result["dumps"].items():
        console.print(f"[bold]graph after {name}[/]", highlight=False)
        console.print(text, highlight=False, markup=False)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(render.markdown([result]))
    if args.plot:
        render.plot([result], args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        _print_optimized(result, explain=args.explain)
    return 0


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

    out = _stdout()
    out.print(render.table([result]))
    for line in render.verified_lines(result):
        out.print(line, highlight=False, soft_wrap=True, markup=False)
    if explain:
        render.print_skipped(out, result)


def _passes() -> int:
    from rich.table import Table

    from fxopt.passes import PASSES, pipelines
    from fxopt.passes.registry import ALIASES
    from fxopt.remat.rewrite import Recompute
    from fxopt.remat.snapshots import AddSnapshots
    from fxopt.remat.split_dropouts import SplitDropouts

    out = _stdout()
    table = Table(title="passes", title_justify="left")
    for column in ("name", "job", "aliases", "what it does"):
        table.add_column(column)
    circle = _circle_pipelines()
    in_convert = set(circle[0].pass_names()) if circle else set()
    for name in sorted(PASSES):
        aliases = ", ".join(a for a, target in ALIASES.items() if target == name)
        job = "optimize, convert" if name in in_convert else "optimize"
        table.add_row(name, job, aliases, PASSES[name].description)
    for pass_ in circle[1].passes if circle else ():
        table.add_row(pass_.name, "convert", "", pass_.description)
    for cls in (SplitDropouts, AddSnapshots, Recompute):
        table.add_row(cls.name, "remat", "", cls.description)
    out.print(table)
    presets = Table(title="pipelines", title_justify="left")
    presets.add_column("name")
    presets.add_column("passes, in order")
    for name in pipelines.PRESETS:
        presets.add_row(name, " → ".join(pipelines.get(name).pass_names()) or "(none)")
    if circle:
        steps = [*circle[0].pass_names(), "lower", *circle[1].pass_names()]
        presets.add_row("convert", " → ".join(steps))
    else:
        presets.add_row("convert", "(install fxopt[circle])")
    presets.add_row("remat", "split-dropouts → add-snapshots → plan → recompute")
    out.print(presets)
    return 0


def _circle_pipelines() -> tuple | None:
    """The converter's default pipelines (ATen passes, Circle passes), or None when the
    circle extra is not installed."""
    try:
        from fxopt.circle.config import CircleConfig
        from fxopt.circle.passes import aten_pipeline, circle_pipeline
    except ImportError:
        return None
    config = CircleConfig()
    return aten_pipeline(config), circle_pipeline(config)


def _demo(args, console: Console) -> int:
    from fxopt import report as render
    from fxopt.paths import writable_directory

    writable_directory(args.out, "--out")
    reports = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("optimizing", total=len(DEMO_MODELS))
        for spec, mode in DEMO_MODELS:
            progress.update(task, description=f"optimizing {spec} ({mode})")
            reports.append(_run_one(spec, mode, runs=args.runs, autotune=True))
            progress.advance(task)
    out = _stdout()
    out.print(render.table(reports, title="fxopt demo: preset 'speed' on built-in models"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(render.markdown(reports, "fxopt demo"))
    render.write_json(reports, args.out / "report.json")
    png = render.plot(reports, args.out / "optimize.png")
    out.print(f"wrote {args.out / 'report.md'}, {args.out / 'report.json'} and {png}")
    if not all(r["verified"] for r in reports):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
