"""``fxopt convert MODEL -o OUT.circle [--config CFG.yaml] [--quantize uint8|int16
[--calibration N|file.py:NAME] | --weight-only q8_0|q4_0] [--no-validate] [--json]``.

Converts a model spec (``zoo:resnet18``, ``file.py:CALLABLE``...) to a Circle file, run in
onert (LiteRT where onert has no kernel) and compared with PyTorch on the example and on a
second input before it is written: a file that differs is an error, not a file on disk.
``--no-validate`` skips the check. ``--json`` prints
one object with the ARCHITECTURE.md keys (output, bytes, operators, op_counts, validated,
max_abs_error, time_ms) and more. Torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

from fxopt.cli._common import add_memory_check_argument, add_model_argument, print_dumps, print_json

HELP = "convert a model to Circle (ONE NPU format), validated in onert"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument(
        "-o", "--output", type=Path, required=True, metavar="OUT.circle", help="Circle file"
    )
    parser.add_argument("--config", type=Path, metavar="CFG.yaml", help="conversion config")
    parser.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the file in onert (LiteRT where onert has no kernel) and compare it with "
        "PyTorch before writing it (default: on)",
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
    parser.add_argument(
        "--quantize",
        choices=("uint8", "int16"),
        help="quantize after training (fxopt.quant, needs the 'quant' extra) and write an "
        "integer file: uint8 (8-bit activations, per-channel 8-bit weights; runs in onert) "
        "or int16 (16-bit activations, 8-bit weights; checked in LiteRT). Overrides the "
        "config's quantize key",
    )
    parser.add_argument(
        "--quantize-weights",
        choices=("per_channel", "per_tensor"),
        help="with --quantize: a weight scale per output channel (default, accurate) or per "
        "tensor (onert 0.1.0 runs those uint8 kernels 7-11x faster on CNNs)",
    )
    parser.add_argument(
        "--weight-only",
        choices=("q8_0", "q4_0"),
        help="quantize only the linear layers' weights, in ggml's block formats onert runs "
        "beside float activations: q8_0 (8.5 bits a weight) or q4_0 (4.5). Overrides the "
        "config's weight_only key",
    )
    parser.add_argument(
        "--calibration",
        metavar="N|FILE.py:NAME",
        help="with --quantize: N random batches drawn like the example (default: the "
        "config's calibration, 16), or an iterable of batches (or a function returning "
        "one) in a Python file",
    )
    add_memory_check_argument(parser, "convert")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def run(args: argparse.Namespace, console) -> int:
    from fxopt.circle import convert, load_config
    from fxopt.circle.converter import check_dump_after
    from fxopt.circle.errors import NotValidatedWarning
    from fxopt.models import load
    from fxopt.paths import writable

    writable(args.output, "-o")  # an unwritable path fails now, not after the conversion
    config = load_config(args.config)  # a bad config fails before any model is built
    config = _with_quantization(config, args)
    check_dump_after(args.dump_after, config)
    loaded = load(args.model, args.input)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotValidatedWarning)  # reported below instead
        circle = convert(
            loaded.model,
            loaded.example_inputs,
            config=config,
            dump_after=args.dump_after,
            validate=args.validate,
            memory_check=args.memory_check,
        )
    time_ms = (time.perf_counter() - start) * 1e3
    circle.save(args.output)
    validation = circle.validation
    report = {
        "model": args.model,
        "output": str(args.output),
        "bytes": circle.nbytes,
        "operators": len(circle.operators),
        "op_counts": circle.op_counts,
        "transposes": circle.transposes,
        "validated": validation.validated if validation else None,
        "validation": validation.message if validation else "not requested",
        "runtime": validation.runtime if validation else None,
        "max_abs_error": validation.max_abs_error if validation else None,
        "baked_inputs": circle.report["baked_inputs"],
        "quantization": _quantization_report(circle, loaded) if config.quantize != "none" else None,
        "weight_only": circle.report.get("weight_only"),
        "time_ms": round(time_ms, 1),
        "stages_ms": {k: round(v, 1) for k, v in circle.report["stages_ms"].items()},
        "passes": circle.report["passes"],
    }
    print_dumps(console, circle.report["dumps"])
    if args.json:
        print_json(report)
    else:
        console.print(circle.summary(), highlight=False)
        if report["quantization"]:
            console.print(_quantization_line(report["quantization"]), highlight=False)
        if report["weight_only"]:
            console.print(_weight_only_line(report["weight_only"]), highlight=False)
        if args.explain:
            from fxopt import report as render

            render.print_skipped(console, report)
        console.print(f"wrote {args.output}", highlight=False)
        if validation is not None and not validation.validated:
            console.print(f"[yellow]warning: {validation.message}[/]", highlight=False)
    return 0


def _with_quantization(config, args):
    """``config`` with ``--quantize`` / ``--calibration`` applied over its keys."""
    from dataclasses import replace

    from fxopt.errors import UserInputError

    if args.quantize:
        config = replace(config, quantize=args.quantize)
    if args.weight_only:
        config = replace(config, weight_only=args.weight_only)
    if args.quantize_weights:
        if config.quantize == "none":
            raise UserInputError(
                "--quantize-weights needs --quantize (or quantize in the config): a float "
                "file has no weight scales"
            )
        config = replace(config, quantize_weights=args.quantize_weights)
    if args.calibration is not None:
        if config.quantize == "none":
            raise UserInputError("--calibration needs --quantize (or quantize in the config)")
        calibration = args.calibration
        if calibration.lstrip("-").isdigit():
            calibration = int(calibration)
            if calibration < 1:
                raise UserInputError(f"--calibration must be at least 1, got {calibration}")
        config = replace(config, calibration=calibration)
    return config


def _quantization_line(section: dict) -> str:
    integer = ", ".join(f"{op} {n}" for op, n in section["quantized_ops"].items()) or "none"
    floats = ", ".join(f"{op} {n}" for op, n in section["float_ops"].items()) or "none"
    line = f"{section['scheme']}: integer ops {integer}; float ops {floats}"
    line += f"; {section['size_vs_float']}x the float file"
    vs_float = section.get("vs_float")
    if vs_float:
        line += f"; SQNR vs float {', '.join(f'{v:.1f}' for v in vs_float['sqnr_db'])} dB"
        top1 = [f"{100 * v:.0f}%" for v in vs_float["top1_agreement"] if v is not None]
        if top1:
            line += f"; top-1 agreement {', '.join(top1)}"
    return line


def _weight_only_line(section: dict) -> str:
    line = (
        f"weight-only {section['kind']}: {section['replaced']} linear layers packed, their "
        f"weights {_size(section['packed_bytes'])} (float: {_size(section['float_bytes'])})"
    )
    if section["left_float"]:
        line += f"; {len(section['left_float'])} left float (see --json)"
    vs_float = section.get("vs_float")
    if vs_float:
        line += f"; SQNR vs float {', '.join(f'{v:.1f}' for v in vs_float['sqnr_db'])} dB"
    return line


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _quantization_report(circle, loaded) -> dict:
    """The report's quantization section, with the file's size against the float file's."""
    from fxopt.circle import convert

    float_bytes = convert(loaded.model, loaded.example_inputs, validate=False).nbytes
    section = dict(circle.report["quantization"])
    section["float_bytes"] = float_bytes
    section["size_vs_float"] = round(circle.nbytes / float_bytes, 3)
    return section
