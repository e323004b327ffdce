"""``fxopt demo [--out DIR]``: the ``speed`` preset on several built-in models, reported.

Writes report.md, report.json and optimize.png in DIR; exits 1 if any model fails its
verification. Torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from fxopt.cli._common import stdout
from fxopt.cli.optimize import run_one

HELP = "optimize several built-in models and report"

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
    ("zoo:llama", "fx"),
    ("zoo:llama?step=decode", "export"),
)


def add_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("out/demo"),
        help="directory for report.md, report.json and optimize.png",
    )
    demo.add_argument("--runs", type=int, default=30, help="timed calls per variant")
    demo.add_argument("--threads", type=int, default=1, help="intra-op threads while timing")


def run(args, console: Console) -> int:
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
            reports.append(run_one(spec, mode, runs=args.runs, autotune=True))
            progress.advance(task)
    out = stdout()
    out.print(render.table(reports, title="fxopt demo: preset 'speed' on built-in models"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(render.markdown(reports, "fxopt demo"))
    render.write_json(reports, args.out / "report.json")
    png = render.plot(reports, args.out / "optimize.png")
    out.print(f"wrote {args.out / 'report.md'}, {args.out / 'report.json'} and {png}")
    if not all(r["verified"] for r in reports):
        return 1
    return 0
