"""How fast does the whole ``speed`` preset transform large graphs, beside torch's tools?

Two families of generated graphs, 1k / 10k / 100k nodes (``--sizes``), each tool on its
own freshly built graph, CPU seconds (median and minimum of the rounds at every size; one
sample of a tool slower than 20 s):

* ``conv-bn``: a module-level graph of Conv2d → BatchNorm2d (eval) → ReLU blocks with a
  residual add every fourth block, the shape ``symbolic_trace`` gives a CNN.
      fxopt fold-bn        FoldBatchNorm()(gm): the pass alone
      fxopt speed          PassManager(speed preset, max_rounds=4, copy=False,
                           recompile=False): all five passes to a fixed point, with lint,
                           invariants and each pass's verify(); the final recompile() is
                           timed separately ("recompile")
      torch fuse()         torch.fx.experimental.optimization.fuse(model) as users call it
                           (it copies the model, traces it and folds conv/bn pairs)
* ``mixed``: benchmarks/transform_speed.py's torch-op graphs (duplicates, dead branches,
  in-place and random ops).
      fxopt speed          as above
      torch CSEPass        CSEPass alone (its returned GraphModule recompiles: as shipped)
      torch CSEPass+DCE    the same, then Graph.eliminate_dead_code()

The tools of a family run round-robin, one sample each per round (``--repeats`` rounds),
so a slow phase of this shared machine (the same run varies by up to 1.5x from minute to
minute) hits all of them; ``same_round_ratios`` pairs fxopt with CSEPass round by round.

    python benchmarks/preset_speed.py                     # about 12 minutes
    python benchmarks/preset_speed.py --sizes 1000 10000
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import fx, nn
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

from common import RESULTS, command_line, machine_info, write_json
from fxopt.passes import PassManager, pipelines
from fxopt.passes.fold_bn import FoldBatchNorm
from transform_speed import build as build_mixed
from transform_speed import make_recipe

console = Console() if sys.stdout.isatty() else Console(width=130)
CHANNELS = 2  # tiny layers: the benchmark times graph rewriting, not weights
# CPU speed on these shared machines varies by 10-15 % from run to run: every tool gets
# `--repeats` samples (median) at every size, except one that takes longer than this.
SLOW_S = 20.0


class Blocks(nn.Module):
    """Holds the conv/bn modules of a generated conv-bn graph."""


def build_conv_bn(size: int) -> tuple[nn.Module, fx.GraphModule]:
    """A module-level graph of about ``size`` nodes, and the module it was built from."""
    root = Blocks()
    graph = fx.Graph()
    x = graph.placeholder("x")
    skip = x
    blocks = max(1, (size - 2) * 4 // 13)  # 3 nodes per block + one add per 4 blocks
    # Seeded: every tool and the parity check's reference get the same weights.
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(size)
        for i in range(blocks):
            conv = nn.Conv2d(CHANNELS, CHANNELS, 1)
            bn = nn.BatchNorm2d(CHANNELS).eval()
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            root.add_module(f"conv{i}", conv)
            root.add_module(f"bn{i}", bn)
            x = graph.call_module(f"conv{i}", (x,))
            x = graph.call_module(f"bn{i}", (x,))
            x = graph.call_function(torch.relu, (x,))
            if i % 4 == 3:
                x = graph.call_function(torch.add, (x, skip))
                skip = x
    graph.output(x)
    gm = fx.GraphModule(root.eval(), graph)
    return gm.eval(), gm


def _speed(gm: fx.GraphModule) -> fx.GraphModule:
    manager = PassManager(
        pipelines.get("speed").pass_names(), max_rounds=4, copy=False, recompile=False
    )
    return manager.run(gm).module


def _fold_bn(gm: fx.GraphModule) -> fx.GraphModule:
    FoldBatchNorm()(gm)
    return gm


def _fuse(gm: fx.GraphModule) -> fx.GraphModule:
    from torch.fx.experimental.optimization import fuse

    return fuse(gm)


def _cse(gm: fx.GraphModule) -> fx.GraphModule:
    return CSEPass(banned_ops=get_CSE_banned_ops())(gm).graph_module


def _cse_dce(gm: fx.GraphModule) -> fx.GraphModule:
    out = CSEPass(banned_ops=get_CSE_banned_ops())(gm).graph_module
    out.graph.eliminate_dead_code()
    return out


def _recompile(gm: fx.GraphModule) -> fx.GraphModule:
    gm.recompile()
    return gm


FAMILIES: dict[str, list[tuple[str, Callable]]] = {
    "conv-bn": [
        ("fxopt fold-bn", _fold_bn),
        ("fxopt speed", _speed),
        ("torch fuse()", _fuse),
        ("recompile", _recompile),
    ],
    "mixed": [
        ("fxopt speed", _speed),
        ("torch CSEPass", _cse),
        ("torch CSEPass+DCE", _cse_dce),
        ("recompile", _recompile),
    ],
}


def fresh(family: str, size: int, recipes: dict) -> fx.GraphModule:
    if family == "conv-bn":
        return build_conv_bn(size)[0]
    if size not in recipes:
        recipes[size] = make_recipe(size)
    return build_mixed(recipes[size], "torch")


def time_once(fn: Callable, gm: fx.GraphModule) -> tuple[float, fx.GraphModule]:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        out = fn(gm)
        return time.process_time() - start, out
    finally:
        gc.enable()


def check(family: str, size: int, name: str, out: fx.GraphModule, recipes: dict) -> float:
    """Max abs difference between the tool's result and the original graph's."""
    reference = fresh(family, size, recipes)
    reference.recompile()
    out.recompile()
    if family == "conv-bn":
        inputs = (torch.randn(2, CHANNELS, 4, 4),)
    else:
        n = sum(1 for n in reference.graph.nodes if n.op == "placeholder")
        inputs = tuple(torch.randn(4, 8) for _ in range(n))
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        expected = reference(*[x.clone() for x in inputs])
        torch.manual_seed(0)
        actual = out(*[x.clone() for x in inputs])
    pairs = zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual))
    return max(float((a - b).abs().max()) for a, b in pairs)


def measure(sizes: list[int], repeats: int) -> list[dict]:
    """Every tool of a family on every size, round-robin (one sample of each tool per
    round, so a slow phase of the machine hits all of them), on a fresh graph each time."""
    rows = []
    recipes: dict = {}
    for family, tools in FAMILIES.items():
        for size in sizes:
            samples: dict[str, list[float]] = {name: [] for name, _ in tools}
            nodes: dict[str, tuple[int, int]] = {}
            to_check: dict[str, fx.GraphModule] = {}  # the first output, at the smallest size
            for round_index in range(repeats):
                for name, fn in tools:
                    if samples[name] and samples[name][0] > SLOW_S:
                        continue  # one sample of a minute-long tool (fuse() at 100k) is enough
                    gm = fresh(family, size, recipes)
                    nodes_before = len(gm.graph.nodes)
                    seconds, out = time_once(fn, gm)
                    samples[name].append(seconds)
                    nodes[name] = (nodes_before, len(out.graph.nodes))
                    if round_index == 0 and size == min(sizes):
                        to_check[name] = out
                    gm = out = None  # freed before the next build
            for name, _ in tools:
                out = to_check.pop(name, None)
                error = check(family, size, name, out, recipes) if out is not None else None
                nodes_before, nodes_after = nodes[name]
                row = {
                    "family": family,
                    "tool": name,
                    "size": size,
                    "nodes_before": nodes_before,
                    "nodes_after": nodes_after,
                    "seconds": statistics.median(samples[name]),
                    "min_seconds": min(samples[name]),
                    "samples": samples[name],
                    "max_abs_error": error,
                }
                row["nodes_per_s"] = nodes_before / row["seconds"] if row["seconds"] else None
                rows.append(row)
                console.print(
                    f"{family:8} {name:18} {size:>7} nodes: {row['seconds']:.3f} s "
                    f"(min {row['min_seconds']:.3f}, {len(samples[name])} samples)"
                    + (f"  (max error {error:.1e})" if error is not None else "")
                )
    return rows


def same_round_ratios(rows: list[dict]) -> list[dict]:
    """fxopt speed / CSEPass alone, per round (both ran back to back), median over rounds:
    the figure this noisy machine cannot move much."""
    out = []
    keyed = {(r["family"], r["tool"], r["size"]): r for r in rows}
    for (family, tool, size), row in keyed.items():
        reference = keyed.get((family, "torch CSEPass", size))
        if tool != "fxopt speed" or reference is None:
            continue
        pairs = list(zip(row["samples"], reference["samples"]))
        per_node = [(s / row["nodes_before"]) / (c / reference["nodes_before"]) for s, c in pairs]
        out.append(
            {
                "family": family,
                "size": size,
                "versus": "torch CSEPass",
                "time_per_node_ratio": statistics.median(per_node),
                "rounds": len(pairs),
            }
        )
    return out


def growth(rows: list[dict]) -> list[dict]:
    out = []
    keyed = {(r["family"], r["tool"], r["size"]): r for r in rows}
    for (family, tool, size), row in keyed.items():
        bigger = [k for k in keyed if k[:2] == (family, tool) and k[2] == size * 10]
        for key in bigger:
            out.append(
                {
                    "family": family,
                    "tool": tool,
                    "from": size,
                    "to": key[2],
                    "ratio": keyed[key]["seconds"] / row["seconds"],
                }
            )
    return out


def print_table(rows: list[dict]) -> None:
    table = Table(title="speed preset vs torch tools (CPU s; nodes/s)", title_justify="left")
    for column in ("family", "tool", "nodes", "seconds", "nodes/s", "nodes after"):
        table.add_column(column, justify="left" if column in ("family", "tool") else "right")
    for r in rows:
        table.add_row(
            r["family"],
            r["tool"],
            str(r["nodes_before"]),
            f"{r['seconds']:.3f}",
            f"{r['nodes_per_s']:,.0f}",
            str(r["nodes_after"]),
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    rows = measure(sorted(args.sizes), args.repeats)
    print_table(rows)
    result = {
        "benchmark": "preset_speed",
        "machine": machine_info(),
        "command": command_line(),
        "rows": rows,
        "growth": growth(rows),
        "same_round_ratios": same_round_ratios(rows),
    }
    write_json(RESULTS / "preset_speed.json", result)
    console.print(f"wrote {RESULTS / 'preset_speed.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
