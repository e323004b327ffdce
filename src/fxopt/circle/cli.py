"""``fxopt convert MODEL -o OUT.circle [--config CFG.yaml] [--validate] [--json]``.

Converts a model spec (``zoo:resnet18``, ``file.py:CALLABLE``...) to a Circle file;
``--validate`` runs it in onert and compares every output with PyTorch. ``--json`` prints
one object with the ARCHITECTURE.md keys (output, bytes, operators, op_counts, validated,
max_abs_error, time_ms) and more. Torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HELP = "convert a model to Circle (ONE NPU format), optionally validated in onert"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="zoo:NAME[?k=v&...], path/to/file.py:CALLABLE or pkg.module:CALLABLE",
    )
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="OUT.circle", help="Circle file"
    )
    parser.add_argument("--config", type=Path, metavar="CFG.yaml", help="conversion config")
    parser.add_argument(
        "--validate", action="store_true", help="run in onert and compare with PyTorch"
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="float32 random input of this shape, e.g. 1x3x224x224 (repeatable)",
    )
    parser.add_argument(
        "--dump-after",
        metavar="PASS",
        help="print the graph after this stage (decompose, lower) or pass (e.g. cse, "
        "fuse-activations)",
    )
    parser.add_argument(
        "--explain", action="store_true", help="list every site a pass skipped, and why"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace, console) -> int:
    from fxopt.circle import convert, load_config, validate
    from fxopt.circle.convert import check_dump_after, example_outputs
    from fxopt.models import load
    from fxopt.paths import writable

    writable(args.output, "-o")  # an unwritable path fails now, not after the conversion
    config = load_config(args.config)  # a bad config fails before any model is built
    check_dump_after(args.dump_after, config)
    loaded = load(args.model, args.input)
    start = time.perf_counter()
    circle = convert(loaded.model, loaded.example_inputs, config=config, dump_after=args.dump_after)
    time_ms = (time.perf_counter() - start) * 1e3
    circle.save(args.output)
    validation = None
    if args.validate:
        expected = example_outputs(loaded.model, loaded.example_inputs)
        validation = validate(
            circle, loaded.example_inputs, expected, rtol=config.rtol, atol=config.atol
        )
    report = {
        "model": args.model,
        "output": str(args.output),
        "bytes": len(circle.bytes),
        "operators": len(circle.operators),
        "op_counts": circle.op_counts,
        "transposes": circle.transposes,
        "validated": validation.validated if validation else None,
        "validation": validation.message if validation else "not requested",
        "max_abs_error": validation.max_abs_error if validation else None,
        "time_ms": round(time_ms, 1),
        "stages_ms": {k: round(v, 1) for k, v in circle.report["stages_ms"].items()},
        "passes": circle.report["passes"],
    }
    for name, text in circle.report["dumps"].items():
        console.print(f"[bold]graph after {name}[/]", highlight=False)
        console.print(text, highlight=False, markup=False)
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        console.print(circle.summary(), highlight=False)
        if args.explain:
            from fxopt import report as render

            render.print_skipped(console, report)
        console.print(f"wrote {args.output}", highlight=False)
        if validation is not None:
            style = "green" if validation.validated else "red"
            console.print(f"[{style}]validation: {validation.message}[/]", highlight=False)
    if validation is not None and not validation.validated and validation.max_abs_error is not None:
        return 1  # converted, but the runtime disagrees with PyTorch
    return 0
