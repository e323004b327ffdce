"""How well and how fast does ``fxopt.tiling`` cover transformer graphs with its built-in
``transformer`` library, beside the greedy first-match choice of torch.fx rewriting?

Graphs:

* ``encoder L=1, 2, 4, 24, 96``: a compact BERT encoder (``zoo:bert``, config ``tiny``,
  16 tokens, ``L`` layers) captured with ``torch.fx`` (``fxopt.capture.trace``), eval-mode
  dropout elided: 53 to 3.3k nodes.
* ``HF BertModel``: ``transformers.BertModel`` built from ``BertConfig()`` (bert-base: 12
  layers, hidden 768; random weights, nothing downloaded), captured with
  ``torch.export.export`` (ATen before core decomposition, so ``aten.linear``,
  ``aten.layer_norm``, ``aten.scaled_dot_product_attention`` stay whole).

Per graph (CPU time, median of ``--repeats``):

    fxopt            tile(graph, "transformer"): match every pattern + exact solve
                     (solver="auto"); states explored, components, cycle cuts
    fxopt ILP        the same placements solved by HiGHS (solver="ilp"); must agree
    greedy           patterns in library order, each placement in graph order, taken
                     when it overlaps nothing taken before: the choice torch.fx
                     SubgraphMatcher / replace_pattern make when called once per pattern
                     (simulated on fxopt's placements, which apply the same validity rules)

    python benchmarks/tiling.py               # about 2 minutes (most of it capturing)
    python benchmarks/tiling.py --layers 1 2 4 --no-hf
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from common import RESULTS, command_line, machine_info, timed, write_json
from fxopt import zoo
from fxopt.capture import trace
from fxopt.tiling import Graph, Library, load_library, tile

console = Console() if sys.stdout.isatty() else Console(width=150)
LIBRARY = "transformer"


def encoder_graph(layers: int) -> Graph:
    entry = zoo.create("bert", config="tiny", seq=16, layers=layers)
    return Graph.from_fx(trace(entry.model, entry.example_inputs, mode="fx"))


def hf_bert_graph() -> Graph:
    from transformers import BertConfig, BertModel

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertModel(BertConfig()).eval()
    ids = torch.randint(0, 1000, (1, 128))
    mask = torch.ones(1, 128, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.export.export(model, (ids,), {"attention_mask": mask}).module()
    # torch.export's input-guard submodule is not part of the model's computation.
    for node in list(module.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            module.graph.erase_node(node)
    return Graph.from_fx(module)


def measure(name: str, layers: int | None, graph: Graph, repeats: int) -> dict:
    library = load_library(LIBRARY)
    runs = [timed(lambda: tile(graph, library)) for _ in range(repeats)]
    result = runs[0][0]
    ilp_runs = [timed(lambda: tile(graph, library, solver="ilp")) for _ in range(repeats)]
    ilp = ilp_runs[0][0]
    greedy_runs = [timed(lambda: tile(graph, library, solver="greedy")) for _ in range(repeats)]
    greedy = greedy_runs[0][0]
    # First-match depends on the order patterns are tried; the optimum does not.
    alphabetical = Library(library.name, tuple(sorted(library, key=lambda p: p.name)))
    greedy_abc = tile(graph, alphabetical, solver="greedy")
    fxopt_abc = tile(graph, alphabetical)
    row = {
        "model": name,
        "layers": layers,
        "nodes": result.nodes,
        "placements": result.placements,
        "components": result.components,
        "states": result.states,
        "cuts": result.cuts,
        "covered": result.covered,
        "coverage": result.coverage,
        "tiles": result.tile_count,
        "optimal": result.optimal,
        "solver": result.solver,
        "seconds": statistics.median(cpu for _, cpu, _ in runs),
        "samples": [cpu for _, cpu, _ in runs],
        "match_ms": statistics.median(r.match_ms for r, _, _ in runs),
        "solve_ms": statistics.median(r.solve_ms for r, _, _ in runs),
        "ilp": {
            "covered": ilp.covered,
            "tiles": ilp.tile_count,
            "seconds": statistics.median(cpu for _, cpu, _ in ilp_runs),
            "solve_ms": statistics.median(r.solve_ms for r, _, _ in ilp_runs),
            "agrees": (ilp.covered, ilp.cost) == (result.covered, result.cost),
        },
        "greedy": {
            "covered": greedy.covered,
            "coverage": greedy.coverage,
            "tiles": greedy.tile_count,
            "seconds": statistics.median(cpu for _, cpu, _ in greedy_runs),
            "tiles_per_pattern": greedy.tiles_per_pattern(),
        },
        "greedy_alphabetical": {
            "covered": greedy_abc.covered,
            "coverage": greedy_abc.coverage,
            "tiles": greedy_abc.tile_count,
            "tiles_per_pattern": greedy_abc.tiles_per_pattern(),
        },
        "alphabetical_same_optimum": (fxopt_abc.covered, fxopt_abc.cost)
        == (result.covered, result.cost),
        "tiles_per_pattern": result.tiles_per_pattern(),
        "uncovered_by_op": {op: len(ids) for op, ids in result.uncovered_by_op().items()},
        "elided": len(graph.elided),
    }
    return row


def growth(rows: list[dict]) -> list[dict]:
    """Time and state ratios between consecutive encoder sizes, with the log-log slope
    (1 = linear in L)."""
    encoders = [r for r in rows if r["layers"] is not None]
    out = []
    for a, b in itertools.pairwise(encoders):
        scale = b["layers"] / a["layers"]
        ratio = b["seconds"] / a["seconds"] if a["seconds"] else None
        out.append(
            {
                "from": a["layers"],
                "to": b["layers"],
                "time_ratio": ratio,
                "slope": math.log(ratio) / math.log(scale) if ratio else None,
                "states_ratio": b["states"] / a["states"] if a["states"] else None,
                "nodes_ratio": b["nodes"] / a["nodes"],
            }
        )
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encoders = [r for r in rows if r["layers"] is not None]
    layers = [r["layers"] for r in encoders]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(layers, [r["seconds"] * 1e3 for r in encoders], "o-", label="fxopt tile (total CPU)")
    left.plot(layers, [r["match_ms"] for r in encoders], "s--", label="  of which matching")
    left.plot(layers, [r["solve_ms"] for r in encoders], "^--", label="  of which exact solve")
    left.plot(layers, [r["ilp"]["solve_ms"] for r in encoders], "x:", label="ILP solve (HiGHS)")
    base = encoders[0]["seconds"] * 1e3
    left.plot(
        layers, [base * n / layers[0] for n in layers], color="grey", lw=0.8, label="linear in L"
    )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("encoder layers L")
    left.set_ylabel("ms")
    left.set_title("Tiling time grows linearly with depth")
    left.legend(fontsize=8)
    names = [r["model"] for r in rows]
    x = range(len(rows))
    width = 0.27
    series = (
        ("fxopt (optimal)", lambda r: r),
        ("greedy, library order", lambda r: r["greedy"]),
        ("greedy, alphabetical order", lambda r: r["greedy_alphabetical"]),
    )
    for k, (label, pick) in enumerate(series):
        offset = (k - 1) * width
        right.bar(
            [i + offset for i in x], [pick(r)["coverage"] * 100 for r in rows], width, label=label
        )
        for i, r in enumerate(rows):
            right.annotate(
                str(pick(r)["tiles"]),
                (i + offset, pick(r)["coverage"] * 100 + 1),
                ha="center",
                fontsize=6,
                rotation=90,
            )
    right.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    right.set_ylim(0, 118)
    right.set_ylabel("% of nodes covered")
    right.set_title("Coverage (bar) and tile count (label)")
    right.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 24, 96])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip HF BertModel")
    parser.add_argument("--out", type=Path, default=RESULTS / "tiling.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for layers in args.layers:
        start = time.perf_counter()
        graph = encoder_graph(layers)
        captured = time.perf_counter() - start
        console.print(f"encoder L={layers}: {len(graph)} nodes (captured in {captured:.1f} s)")
        rows.append(measure(f"encoder L={layers}", layers, graph, args.repeats))
    hf_note = None
    if args.hf:
        try:
            graph = hf_bert_graph()
            console.print(f"HF BertModel: {len(graph)} nodes")
            rows.append(measure("HF BertModel (bert-base)", None, graph, args.repeats))
        except ImportError:
            hf_note = "skipped: transformers is not installed (pip install -e '.[hf]')"
            console.print(hf_note)
    table = Table(title=f"tiling with the '{LIBRARY}' library", title_justify="left")
    for column in (
        "graph",
        "nodes",
        "covered",
        "tiles",
        "ms (CPU)",
        "states",
        "ILP agrees",
        "ILP solve ms",
        "greedy covered",
        "greedy tiles",
        "greedy a-z covered",
        "greedy a-z tiles",
    ):
        table.add_column(column, justify="left" if column == "graph" else "right")
    for r in rows:
        table.add_row(
            r["model"],
            str(r["nodes"]),
            f"{r['covered']} ({r['coverage']:.1%})",
            str(r["tiles"]),
            f"{r['seconds'] * 1e3:.1f}",
            str(r["states"]),
            str(r["ilp"]["agrees"]),
            f"{r['ilp']['solve_ms']:.1f}",
            f"{r['greedy']['covered']} ({r['greedy']['coverage']:.1%})",
            str(r["greedy"]["tiles"]),
            f"{r['greedy_alphabetical']['covered']} ({r['greedy_alphabetical']['coverage']:.1%})",
            str(r["greedy_alphabetical"]["tiles"]),
        )
    console.print(table)
    data = {
        "machine": machine_info(),
        "command": command_line(),
        "library": LIBRARY,
        "repeats": args.repeats,
        "rows": rows,
        "growth": growth(rows),
        "hf_note": hf_note,
    }
    write_json(args.out, data)
    png = args.out.with_suffix(".png")
    plot(rows, png)
    console.print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
