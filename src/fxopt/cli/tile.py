"""``fxopt tile MODEL|GRAPH.json [--library NAME|PATH] [--json]``: which kernels cover it.

MODEL is a model spec (``zoo:bert``, ``file.py:CALLABLE``...), captured with
:func:`fxopt.capture.trace`; a ``.json``/``.yaml`` path is a graph in the tiler's JSON
format. The table gives coverage, tiles per pattern and the uncovered ops grouped by op;
``--json`` prints one object: nodes, covered, tile_count, tiles[{pattern, nodes}] and
time_ms first (the keys scripts rely on), then the details of
:meth:`~fxopt.tiling.Tiling.to_json`. Torch is imported only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fxopt.cli._common import print_json, stdout

HELP = "cover a model's graph with a library of fused-kernel patterns, optimally"

GRAPH_SUFFIXES = (".json", ".yaml", ".yml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        metavar="MODEL_OR_GRAPH",
        help="zoo:NAME[?k=v&...], path/to/file.py:CALLABLE, pkg.module:CALLABLE, "
        "or a graph file (.json/.yaml)",
    )
    parser.add_argument(
        "--library",
        default="transformer",
        metavar="NAME_OR_PATH",
        help="built-in library (transformer, cnn, singles; join with '+') or a "
        "JSON/YAML file (default: transformer)",
    )
    parser.add_argument(
        "--solver",
        choices=("auto", "exact", "ilp", "greedy"),
        default="auto",
        help="auto: exact search, ILP for an oversized component (default); "
        "greedy: the non-optimal first-match baseline",
    )
    parser.add_argument(
        "--mode",
        choices=("fx", "export"),
        default="fx",
        help="capture level for a MODEL (default: fx)",
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE",
        help="float32 random input of this shape for a MODEL, e.g. 1x3x224x224 (repeatable)",
    )
    parser.add_argument(
        "--keep-noops",
        action="store_true",
        help="keep eval-mode dropout, identity and runtime checks as graph nodes",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--dot", type=Path, metavar="OUT.dot", help="write the tiling as DOT")
    parser.add_argument("--png", type=Path, metavar="OUT.png", help="draw the tiling as PNG")
    parser.add_argument(
        "--save-graph", type=Path, metavar="OUT.json", help="write the graph in JSON form"
    )


def _is_graph_file(target: str) -> bool:
    return Path(target).suffix.lower() in GRAPH_SUFFIXES


def run(args: argparse.Namespace, console) -> int:
    from fxopt.errors import UserInputError
    from fxopt.paths import writable, writable_image
    from fxopt.tiling import Graph, load_library, tile

    # Output paths and the library fail before any capture, not after the tiling.
    for option, path in (("--save-graph", args.save_graph), ("--dot", args.dot)):
        if path is not None:
            writable(path, option)
    if args.png is not None:
        writable_image(args.png, "--png")
    library = load_library(args.library)
    if _is_graph_file(args.target):
        if not Path(args.target).is_file():
            raise UserInputError(f"graph file not found: {args.target}")
        graph = Graph.from_json(args.target)
    else:
        from fxopt import models
        from fxopt.capture import trace
        from fxopt.op_failures import run_eagerly

        with console.status(f"capturing {args.target} ({args.mode})"):
            loaded = models.load(args.target, args.input)
            # A wrong --input fails here in one line naming the op; in the capture it would
            # print a traceback per failing op first. (The model is ours to run: it was
            # just loaded, and only its structure is tiled.)
            run_eagerly(loaded.model, loaded.example_inputs)
            gm = trace(loaded.model, loaded.example_inputs, mode=args.mode)
        graph = Graph.from_fx(gm, elide_noops=not args.keep_noops)
    result = tile(graph, library, solver=args.solver)
    if args.save_graph:
        args.save_graph.parent.mkdir(parents=True, exist_ok=True)
        args.save_graph.write_text(json.dumps(graph.to_json(), indent=1) + "\n")
    if args.dot:
        from fxopt.tiling.draw import to_dot

        args.dot.parent.mkdir(parents=True, exist_ok=True)
        args.dot.write_text(to_dot(result))
    if args.png:
        from fxopt.tiling.draw import draw_png

        draw_png(result, args.png, title=f"{args.target}: {_summary(result)}")
    if args.json:
        report = {"target": args.target, **result.to_json()}
        print_json(report)
        return 0
    _print_report(result, args.target)
    return 0


def _summary(result) -> str:
    return (
        f"{result.covered}/{result.nodes} nodes covered ({result.coverage:.1%}) by "
        f"{result.tile_count} tiles"
    )


def _print_report(result, target: str) -> None:
    from rich.table import Table

    out = stdout()
    proof = "optimal" if result.optimal else "not optimal"
    out.print(
        f"[bold]{target}[/]: {_summary(result)} of library '{result.library.name}' "
        f"({result.solver}, {proof}, {result.states} states, {result.time_ms:.1f} ms)",
        highlight=False,
    )
    tiles = Table(title="tiles per pattern", title_justify="left")
    tiles.add_column("pattern")
    tiles.add_column("tiles", justify="right")
    tiles.add_column("nodes covered", justify="right")
    sizes = {p.name: len(p) for p in result.library}
    for name, count in result.tiles_per_pattern().items():
        tiles.add_row(name, str(count), str(count * sizes[name]))
    out.print(tiles)
    groups = result.uncovered_by_op()
    if groups:
        left = Table(title="uncovered nodes by op", title_justify="left")
        left.add_column("op")
        left.add_column("nodes", justify="right")
        left.add_column("where (first ids)")
        for op, ids in groups.items():
            more = f" … +{len(ids) - 5}" if len(ids) > 5 else ""
            left.add_row(op, str(len(ids)), ", ".join(ids[:5]) + more)
        out.print(left)
    else:
        out.print("every node is covered")
    if result.unused_patterns:
        out.print(
            f"{len(result.unused_patterns)} unused pattern(s): "
            + "; ".join(f"{name} ({why})" for name, why in result.unused_patterns.items()),
            highlight=False,
            soft_wrap=True,
        )
