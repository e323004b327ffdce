"""The speed preset at two revisions of fxopt, same run: CPU time and output graphs.

For a change to the passes' internals that must not change what the ``speed`` preset
makes of a graph ("same graph, no slower"): each revision runs the preset in its own fresh
interpreter (a git worktree of ``--base`` with its ``src`` on the path, and this checkout's
``src``), one child process per revision, family and size, the two revisions alternating
sample by sample (base first in odd rounds, this first in even ones) so a slow phase of
the shared machine hits both. The graphs are benchmarks/preset_speed.py's, built by this
checkout's generators for both revisions (only ``fxopt`` comes from the revision):

* ``conv-bn``: Conv2d → BatchNorm2d (eval) → ReLU blocks with a residual add every
  fourth block, a module-level fx graph;
* ``mixed``: benchmarks/transform_speed.py's torch-op graphs (duplicates, dead branches,
  in-place and random ops).

Each child builds the graph, runs the preset once on a small graph of the same family
(untimed: lazy imports and first-call caches), then times ``PassManager(speed preset's
passes, max_rounds=4, copy=False, recompile=False).run(gm)`` on the freshly built graph
as preset_speed.py does (CPU seconds, cyclic GC paused). It reports the nodes before and
after, the output graph's histogram of node ops (by ``op`` and by ``op:target``, a
module's type standing for its name) and a digest of its structure (op, target and
arguments as node positions, in graph order). Per family and size: the median CPU seconds
at each revision, this/base, the per-round paired ratio, and whether every sample of both
revisions gave the same graph (node counts and histograms; ``same_structure`` also
compares the digests). Writes results/preset_ab.json.

    python benchmarks/preset_ab.py --base 5fae798                       # 100k nodes
    python benchmarks/preset_ab.py --base HEAD~3 --sizes 1000 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from common import RESULTS, ROOT, command_line, machine_info, write_json

BENCHMARKS = Path(__file__).resolve().parent
FAMILIES = ("conv-bn", "mixed")
console = Console() if sys.stdout.isatty() else Console(width=130)

# Runs in a fresh interpreter with one revision's src on sys.path (PYTHONPATH, so ahead of
# an editable install of this checkout) and this checkout's benchmarks dir after it:
# one JSON line out.
_CHILD = """
import gc, hashlib, json, sys, time, warnings
from collections import Counter
warnings.simplefilter("ignore")
spec = json.loads(sys.argv[1])
sys.path.append(spec["benchmarks"])  # after the revision's src: generators only
sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
import torch
torch.set_num_threads(1)
from torch import fx
import fxopt
assert fxopt.__file__.startswith(spec["src"]), (fxopt.__file__, spec["src"])
from fxopt.passes import PassManager, pipelines
import preset_speed, transform_speed
for module in (preset_speed, transform_speed):
    assert module.__file__.startswith(spec["benchmarks"]), (module.__file__, spec["benchmarks"])

def speed_names():
    # pipelines.get(name) at 5fae798 and now; pipelines.speed() in case a revision lacks get.
    get = getattr(pipelines, "get", None)
    preset = get("speed") if get is not None else pipelines.speed()
    return preset.pass_names()

def build(family, size):
    if family == "conv-bn":
        return preset_speed.build_conv_bn(size)[0]
    return transform_speed.build(transform_speed.make_recipe(size), "torch")

def run_speed(gm):  # as preset_speed._speed
    manager = PassManager(speed_names(), max_rounds=4, copy=False, recompile=False)
    return manager.run(gm)

def target_name(gm, modules, node):
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_function":
        try:
            return fx.node._get_qualified_name(node.target)
        except Exception:
            return repr(node.target)
    if node.op == "call_method":
        return str(node.target)
    return ""  # placeholder / get_attr / output: names are not structure

def describe(gm):
    modules = dict(gm.named_modules())
    position, ops, targets = {}, Counter(), Counter()
    digest = hashlib.sha256()
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        target = target_name(gm, modules, node)
        ops[node.op] += 1
        targets[f"{node.op}:{target}" if target else node.op] += 1
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{position[n]}")
        digest.update(repr((node.op, target, args)).encode())
        digest.update(b"\\n")
    return {
        "nodes": len(gm.graph.nodes),
        "ops": dict(sorted(ops.items())),
        "targets": dict(sorted(targets.items())),
        "digest": digest.hexdigest(),
    }

family, size = spec["family"], spec["size"]
run_speed(build(family, min(size, spec["warmup_size"])))  # untimed warm-up
gm = build(family, size)
nodes_before = len(gm.graph.nodes)
gc.collect()
gc.disable()
try:
    start = time.process_time()
    result = run_speed(gm)
    seconds = time.process_time() - start
finally:
    gc.enable()
pass_ms = Counter()
for record in result.records:
    pass_ms[record.name] += record.time_ms
out = describe(result.module)
print(json.dumps({
    "seconds": seconds,
    "nodes_before": nodes_before,
    "nodes_after": out.pop("nodes"),
    **out,
    "rounds": result.rounds,
    "applied": result.applied,
    "pass_ms": dict(pass_ms),
    "fxopt": fxopt.__file__,
}))
"""


def run_child(src: Path, family: str, size: int, warmup_size: int, cwd: Path) -> dict:
    spec = {
        "family": family,
        "size": size,
        "warmup_size": warmup_size,
        "src": str(src),
        "benchmarks": str(BENCHMARKS),
    }
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=cwd,  # an empty directory: nothing importable from the cwd (sys.path[0])
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(
            f"speed preset failed under {src} ({family}, {size}):\n{result.stderr[-3000:]}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def summarize(family: str, size: int, base: list[dict], head: list[dict]) -> dict:
    base_s = statistics.median(x["seconds"] for x in base)
    head_s = statistics.median(x["seconds"] for x in head)
    first = base[0]
    same_graph = all(
        (x["nodes_before"], x["nodes_after"], x["ops"], x["targets"])
        == (first["nodes_before"], first["nodes_after"], first["ops"], first["targets"])
        for x in base + head
    )
    passes = sorted({name for x in base + head for name in x["pass_ms"]})
    return {
        "family": family,
        "size": size,
        "nodes_before": first["nodes_before"],
        "nodes_after_base": first["nodes_after"],
        "nodes_after_head": head[0]["nodes_after"],
        "same_graph": same_graph,
        "same_structure": all(x["digest"] == first["digest"] for x in base + head),
        "seconds_base": base_s,
        "seconds_head": head_s,
        "head_over_base": head_s / base_s,
        # Samples of the same round ran back to back: the ratio a slow phase moves least.
        "paired_head_over_base": statistics.median(
            h["seconds"] / b["seconds"] for b, h in zip(base, head)
        ),
        "samples_base": [x["seconds"] for x in base],
        "samples_head": [x["seconds"] for x in head],
        "pass_ms_base": {
            p: statistics.median(x["pass_ms"].get(p, 0.0) for x in base) for p in passes
        },
        "pass_ms_head": {
            p: statistics.median(x["pass_ms"].get(p, 0.0) for x in head) for p in passes
        },
        "rounds_base": [x["rounds"] for x in base],
        "rounds_head": [x["rounds"] for x in head],
        "ops_base": first["ops"],
        "ops_head": head[0]["ops"],
        "targets_base": first["targets"],
        "targets_head": head[0]["targets"],
    }


def print_table(rows: list[dict], base: str) -> None:
    table = Table(
        title=f"speed preset, {base} (base) vs this checkout (CPU s, median)", title_justify="left"
    )
    for column in ("family", "size", "base s", "this s", "this/base", "paired", "same graph"):
        table.add_column(column, justify="left" if column == "family" else "right")
    for r in rows:
        same = "yes" if r["same_graph"] else "no"
        if r["same_graph"] and not r["same_structure"]:
            same = "yes (order differs)"
        table.add_row(
            r["family"],
            str(r["size"]),
            f"{r['seconds_base']:.3f}",
            f"{r['seconds_head']:.3f}",
            f"{r['head_over_base']:.3f}",
            f"{r['paired_head_over_base']:.3f}",
            same,
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup-size", type=int, default=500, help="nodes of the untimed warm-up graph"
    )
    args = parser.parse_args(argv)
    base_commit = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
    head_commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--", "src"))
    cases = [(family, size) for family in FAMILIES for size in sorted(args.sizes)]
    samples: dict[tuple[str, int], dict[str, list[dict]]] = {
        case: {"base": [], "head": []} for case in cases
    }
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        (Path(tmp) / "cwd").mkdir()
        subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "worktree",
                "add",
                "-q",
                "--detach",
                str(worktree),
                base_commit,
            ],
            check=True,
        )
        try:
            sides = {"base": worktree / "src", "head": ROOT / "src"}
            for round_index in range(args.rounds):
                order = ("base", "head") if round_index % 2 == 0 else ("head", "base")
                for family, size in cases:
                    for side in order:
                        sample = run_child(
                            sides[side], family, size, args.warmup_size, cwd=Path(tmp) / "cwd"
                        )
                        samples[family, size][side].append(sample)
                        print(
                            f"round {round_index + 1}/{args.rounds} {family} {size} {side}: "
                            f"{sample['seconds']:.3f} s, {sample['nodes_before']} → "
                            f"{sample['nodes_after']} nodes",
                            file=sys.stderr,
                        )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)])
    rows = [summarize(family, size, **samples[family, size]) for family, size in cases]
    print_table(rows, args.base)
    for r in rows:
        if not r["same_graph"]:
            console.print(
                f"[bold]{r['family']} {r['size']}[/]: graphs differ: "
                f"{r['nodes_after_base']} → {r['nodes_after_head']} nodes; "
                f"ops {r['ops_base']} → {r['ops_head']}"
            )
    write_json(
        RESULTS / "preset_ab.json",
        {
            "benchmark": "preset_ab",
            "machine": machine_info(),
            "command": command_line(),
            "base": args.base,
            "base_commit": base_commit,
            "head_commit": head_commit,
            "head_src_uncommitted_changes": dirty,
            "rounds": args.rounds,
            "warmup_size": args.warmup_size,
            "rows": rows,
        },
    )
    console.print(f"wrote {RESULTS / 'preset_ab.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
