"""How fast do fxopt's ``cse`` and ``dce`` passes transform large graphs?

Generates fx graphs of 1k, 10k and 100k nodes (``--sizes``) and times, in one run and on
the same graphs, each tool on its own freshly built copy (CPU seconds, median of repeats):

    fxopt cse                     CommonSubexpressionElimination()(gm): analyze + transform
    fxopt dce                     DeadCodeElimination()(gm), on the graph cse left
    fxopt cse+dce                 the two above, summed per repeat
    fxopt PassManager             PassManager(["cse", "dce"], copy=False).run(gm): the two
                                  passes plus lint, each pass's verify() and one recompile()
    torch CSEPass (no recompile)  torch.fx.passes.dialect.common.cse_pass.CSEPass with
                                  get_CSE_banned_ops(), minus the recompile() of the new
                                  GraphModule it returns: the rewrite alone, like fxopt cse
    torch eliminate_dead_code     torch.fx.Graph.eliminate_dead_code(), on what CSEPass left
    torch CSEPass+DCE (...)       the two above, summed per repeat
    torch CSEPass                 CSEPass as shipped (its new GraphModule recompiles)
    recompile                     GraphModule.recompile() of the unoptimized graph (codegen)

Two graph kinds with the same structure: "torch" (torch.relu, operator.add, x.view(...),
torch.sigmoid_ ... as fx.symbolic_trace records them) and "aten" (torch.ops.aten.*
overloads as torch.export records them; CSEPass's ban list only knows ATen ops).

Also checks, at the smallest size, that each tool's output graph computes what the
original does (same inputs, same RNG seed) and counts the nodes each tool removed.

    python benchmarks/transform_speed.py                 # 1k, 10k, 100k: about 5 minutes
    python benchmarks/transform_speed.py --sizes 1000 5000 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import operator
import random
import statistics
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import fx
from torch.fx.passes.dialect.common import cse_pass
from torch.fx.passes.dialect.common.cse_pass import CSEPass, get_CSE_banned_ops

from common import RESULTS, Timeout, command_line, machine_info, timed, write_json
from fxopt.passes import PassManager
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.passes.dce import DeadCodeElimination

aten = torch.ops.aten
# Wide enough for the final table when the output is a file or a pipe (rich assumes 80).
console = Console() if sys.stdout.isatty() else Console(width=150)

# --------------------------------------------------------------------------- graphs
#
# A graph is first generated as a *recipe* (a list of (op, input indices)), once per size,
# then built into an fx.Graph for each tool: building is a tight loop of create_node, so
# every tool gets an identical fresh graph without deepcopy (which recompiles).

#: Every tensor in the generated graphs has this shape; small, so the 1k parity check is
#: quick, and views keep it so any two values can be added.
SHAPE = (4, 8)

# op name -> (fx op kind, target, args builder) per graph kind.
_Args = Callable[..., tuple]
DIALECTS: dict[str, dict[str, tuple[str, object, _Args]]] = {
    "torch": {
        "relu": ("call_function", torch.relu, lambda x: (x,)),
        "sigmoid": ("call_function", torch.sigmoid, lambda x: (x,)),
        "add": ("call_function", operator.add, lambda x, y: (x, y)),
        "mul": ("call_function", operator.mul, lambda x, y: (x, y)),
        "view": ("call_method", "view", lambda x: (x, -1, SHAPE[1])),
        "sigmoid_": ("call_function", torch.sigmoid_, lambda x: (x,)),
        "rand_like": ("call_function", torch.rand_like, lambda x: (x,)),
    },
    "aten": {
        "relu": ("call_function", aten.relu.default, lambda x: (x,)),
        "sigmoid": ("call_function", aten.sigmoid.default, lambda x: (x,)),
        "add": ("call_function", aten.add.Tensor, lambda x, y: (x, y)),
        "mul": ("call_function", aten.mul.Tensor, lambda x, y: (x, y)),
        "view": ("call_function", aten.view.default, lambda x: (x, [-1, SHAPE[1]])),
        "sigmoid_": ("call_function", aten.sigmoid_.default, lambda x: (x,)),
        "rand_like": ("call_function", aten.rand_like.default, lambda x: (x,)),
    },
}
PURE = {"relu", "sigmoid", "add", "mul", "view"}
UNARY = ("relu", "sigmoid", "view")

# Mix of steps. One step emits 1-3 nodes; the fractions are of steps, not nodes.
# Chosen to look like a traced model: mostly chains of elementwise ops and views, with
# some repeated subexpressions, unused branches and a few in-place and random ops.
P_DUPLICATE = 0.12  # a copy of an earlier pure call (half the time with one of its users)
P_DEAD = 0.08  # a 1-3 op branch nobody uses
P_INPLACE = 0.02  # a = relu/sigmoid(...), often a twin of an earlier value; sigmoid_(a)
P_RANDOM = 0.015  # r = rand_like(cur); cur = cur + r
P_DEAD_RANDOM = 0.005  # rand_like(cur) whose result is unused (must not be removed)
#: Graph inputs per node: torch.export lifts parameters to placeholders, so big graphs
#: have many (ResNet-18 exported: ~100 of ~300 nodes); 2% is on the low side.
INPUTS_PER_NODE = 1 / 50
PURE_WEIGHTS = {"relu": 0.2, "sigmoid": 0.3, "add": 0.2, "mul": 0.15, "view": 0.15}


@dataclass(frozen=True)
class Recipe:
    size: int
    instrs: tuple[tuple[str, tuple[int, ...]], ...]  # (op, input indices); output last

    @property
    def n_inputs(self) -> int:
        return sum(1 for op, _ in self.instrs if op == "placeholder")


# One branch per kind of instruction, drawn with its probability: the ladder is the
# generator's grammar, read top to bottom, so it stays one function.
def make_recipe(size: int, seed: int = 0) -> Recipe:  # noqa: C901
    """A random graph of exactly ``size`` nodes (placeholders and output included)."""
    rng = random.Random(seed)
    instrs: list[tuple[str, tuple[int, ...]]] = []
    unused: dict[int, None] = {}  # live values nobody reads yet: they become outputs
    window: deque[int] = deque(maxlen=16)  # recent live values, second operands
    pure: list[int] = []  # pure calls, candidates for duplication
    pure_users: dict[int, list[int]] = {}

    def emit(op: str, *args: int) -> int:
        instrs.append((op, args))
        return len(instrs) - 1

    def live(op: str, *args: int) -> int:
        index = emit(op, *args)
        for a in args:
            unused.pop(a, None)
        unused[index] = None
        window.append(index)
        if op in PURE:
            pure.append(index)
            for a in set(args):
                pure_users.setdefault(a, []).append(index)
        return index

    inputs = [emit("placeholder") for _ in range(max(4, round(size * INPUTS_PER_NODE)))]
    next_input = itertools.cycle(inputs)
    cur = live("relu", next(next_input))

    def operand() -> int:
        return next(next_input) if rng.random() < 0.3 else rng.choice(window)

    def pure_op(x: int) -> tuple:
        op = rng.choices(list(PURE_WEIGHTS), weights=list(PURE_WEIGHTS.values()))[0]
        return (op, x) if op in UNARY else (op, x, operand())

    limit = size - 1  # room for the output node
    while len(instrs) < limit:
        room = limit - len(instrs)
        r = rng.random()
        if r < P_DUPLICATE and room >= 3:
            original = rng.choice(pure[-512:])
            op, args = instrs[original]
            copy = live(op, *args)
            users = pure_users.get(original)
            if users and rng.random() < 0.5 and room >= 4:
                user_op, user_args = instrs[rng.choice(users)]
                copy = live(user_op, *(copy if a == original else a for a in user_args))
            cur = live("add", cur, copy)
        elif (r := r - P_DUPLICATE) < P_DEAD:
            value = cur
            for _ in range(rng.randint(1, min(3, room))):
                value = emit(*pure_op(value))
        elif (r := r - P_DEAD) < P_INPLACE and room >= 4:
            # Often the written value is a twin of an earlier one, read again after the write:
            #   h = relu(y) ... a = relu(y); sigmoid_(a); cur = cur * a + h
            # Merging a into h (CSE) would make the last read of h see the write.
            twins = [i for i in pure[-64:] if instrs[i][0] in ("relu", "sigmoid")]
            twin = rng.choice(twins) if twins else None
            op, args = instrs[twin] if twin is not None else ("relu", (cur,))
            a = live(op, *args)
            emit("sigmoid_", a)
            cur = live("mul", cur, a)
            if twin is not None:
                cur = live("add", cur, twin)
        elif (r := r - P_INPLACE) < P_RANDOM and room >= 2:
            cur = live("add", cur, live("rand_like", cur))
        elif r - P_RANDOM < P_DEAD_RANDOM:
            emit("rand_like", cur)
        else:
            cur = live(*pure_op(cur))
    emit("output", *unused)
    return Recipe(size, tuple(instrs))


def build(recipe: Recipe, kind: str) -> fx.GraphModule:
    """A fresh GraphModule for ``recipe`` in the ``kind`` dialect ("torch" or "aten").

    Its Python code is *not* generated: ``GraphModule(root, graph)`` recompiles, which
    takes longer than building the graph (7 s at 100k nodes here), and no timed tool runs
    the module. Call ``gm.recompile()`` before calling it.
    """
    table = DIALECTS[kind]
    graph = fx.Graph()
    nodes: list[fx.Node] = []
    for op, args in recipe.instrs:
        if op == "placeholder":
            nodes.append(graph.placeholder(f"x{len(nodes)}"))
        elif op == "output":
            graph.output(tuple(nodes[a] for a in args))
        else:
            fx_op, target, make_args = table[op]
            nodes.append(graph.create_node(fx_op, target, make_args(*(nodes[a] for a in args))))
    return _module_without_codegen(torch.nn.Module(), graph)


def _module_without_codegen(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` without generating its code (our graphs have no
    get_attr or call_module nodes, so nothing else of ``root`` is needed)."""
    gm = fx.GraphModule(root, fx.Graph())
    gm._graph = graph  # what the `graph` setter does, minus its recompile()
    graph.owning_module = gm
    return gm


def count_nodes(gm: fx.GraphModule) -> int:
    return len(gm.graph.nodes)


# --------------------------------------------------------------------------- tools
#
# A tool is one or more timed stages applied in turn to one fresh graph; each stage is a
# row, and a multi-stage tool adds a row for the sum (per repeat). Each stage gets the
# module the previous stage returned (CSEPass returns a new one).

Stage = Callable[[fx.GraphModule], fx.GraphModule]


def _fxopt_cse(gm):
    CommonSubexpressionElimination()(gm)
    return gm


def _fxopt_dce(gm):
    DeadCodeElimination()(gm)
    return gm


def _fxopt_manager(gm):
    return PassManager(["cse", "dce"], copy=False).run(gm).module


def _torch_cse(gm):
    # The ban list is opt-in: CSEPass() alone merges random and in-place ops too.
    return CSEPass(banned_ops=get_CSE_banned_ops())(gm).graph_module


def _torch_cse_no_codegen(gm):
    # CSEPass ends with `GraphModule(gm, new_graph)`, which recompiles; fxopt's passes leave
    # that to the PassManager. Skipping it here times the rewrite alone.
    with mock.patch.object(cse_pass, "GraphModule", _module_without_codegen):
        return _torch_cse(gm)


def _torch_dce(gm):
    gm.graph.eliminate_dead_code()
    return gm


def _recompile(gm):
    gm.recompile()
    return gm


@dataclass(frozen=True)
class Tool:
    name: str  # name of the sum row, when there are several stages
    stages: tuple[tuple[str, Stage, str], ...]  # (row name, function, note)

    @property
    def rows(self) -> list[tuple[str, str]]:
        names = [(name, note) for name, _, note in self.stages]
        if len(self.stages) > 1:
            names.append((self.name, "sum of the stages above, per repeat"))
        return names


FXOPT_CSE = ("fxopt cse", _fxopt_cse, "CommonSubexpressionElimination()(gm)")
FXOPT_DCE = ("fxopt dce", _fxopt_dce, "DeadCodeElimination()(gm) on the graph cse left")
FXOPT_MANAGER = (
    "fxopt PassManager",
    _fxopt_manager,
    "PassManager(['cse', 'dce'], copy=False).run(gm): adds lint, verify, recompile",
)
TORCH_CSE = ("torch CSEPass", _torch_cse, "as shipped: its new GraphModule recompiles")
TORCH_CSE_NO_CODEGEN = (
    "torch CSEPass (no recompile)",
    _torch_cse_no_codegen,
    "CSEPass with the recompile of its new GraphModule skipped",
)
TORCH_DCE = (
    "torch eliminate_dead_code",
    _torch_dce,
    "Graph.eliminate_dead_code() on the module CSEPass returned",
)
RECOMPILE = ("recompile", _recompile, "GraphModule.recompile() of the unoptimized graph")

TOOLS = (
    Tool("fxopt cse+dce", (FXOPT_CSE, FXOPT_DCE)),
    Tool("fxopt PassManager", (FXOPT_MANAGER,)),
    Tool("torch CSEPass+DCE (no recompile)", (TORCH_CSE_NO_CODEGEN, TORCH_DCE)),
    Tool("torch CSEPass", (TORCH_CSE,)),
    Tool("recompile", (RECOMPILE,)),
)

# Parity check only (not timed): every stage prefix, and each DCE on the raw graph.
PIPELINES: dict[str, list[Stage]] = {
    "fxopt cse": [_fxopt_cse],
    "fxopt dce": [_fxopt_dce],
    "fxopt cse → dce": [_fxopt_cse, _fxopt_dce],
    "fxopt PassManager": [_fxopt_manager],
    "torch CSEPass": [_torch_cse],
    "torch eliminate_dead_code": [_torch_dce],
    "torch CSEPass → eliminate_dead_code": [_torch_cse, _torch_dce],
}


# --------------------------------------------------------------------------- parity


def check_parity(recipe: Recipe, kind: str, seed: int = 0) -> list[dict]:
    """Run the original and each tool's result on the same inputs and RNG seed."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(SHAPE, generator=gen) for _ in range(recipe.n_inputs)]

    def run(gm: fx.GraphModule) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args = [x.clone() for x in inputs]  # in-place ops may write into inputs
        torch.manual_seed(seed + 1)
        return list(gm(*args)), args  # outputs, and the inputs as left after the call

    explanations = _explain(recipe, kind)
    original = build(recipe, kind)
    original.recompile()
    expected_out, expected_in = run(original)
    finite = sum(bool(t.isfinite().all()) for t in expected_out) / len(expected_out)
    rows = []
    for name, stages in PIPELINES.items():
        gm = build(recipe, kind)
        for stage in stages:
            gm = stage(gm)
        gm.recompile()
        try:
            got_out, got_in = run(gm)
            out_diffs = [_max_diff(a, b) for a, b in zip(expected_out, got_out)]
            in_diffs = [_max_diff(a, b) for a, b in zip(expected_in, got_in)]
            bad = sum(d != 0 for d in out_diffs + in_diffs)
            max_diff = max(out_diffs + in_diffs)
            detail = "; ".join(
                f"{sum(d != 0 for d in diffs)} of {len(diffs)} {what} differ"
                for what, diffs in (("outputs", out_diffs), ("inputs after the call", in_diffs))
                if any(d != 0 for d in diffs)
            )
        except Exception as error:  # a broken graph is a result, not a crash
            bad, max_diff, detail = -1, math.inf, f"{type(error).__name__}: {error}"[:200]
        rows.append(
            {
                "tool": name,
                "graph": kind,
                "size": recipe.size,
                "nodes_before": count_nodes(original),
                "nodes_after": count_nodes(gm),
                "removed": count_nodes(original) - count_nodes(gm),
                "match": bad == 0,
                "max_abs_diff": max_diff,
                "detail": detail,
                "reference_outputs_finite": round(finite, 3),
                "why": explanations.get(name, ""),
            }
        )
    return rows


def _explain(recipe: Recipe, kind: str) -> dict[str, str]:
    """Where torch's passes and fxopt's disagree, in words (for the parity table)."""
    fxopt_dce, torch_dce = _fxopt_dce(build(recipe, kind)), _torch_dce(build(recipe, kind))
    original = {n.name: n for n in build(recipe, kind).graph.nodes}
    kept = {n.name for n in fxopt_dce.graph.nodes} - {n.name for n in torch_dce.graph.nodes}
    removed = Counter(_op_name(original[name]) for name in kept)
    cse = CommonSubexpressionElimination()(build(recipe, kind))
    declined = Counter(skip.reason.rsplit(": ", 1)[-1] for skip in cse.skipped)
    notes = {}
    if removed:
        notes["torch eliminate_dead_code"] = "also removed what fxopt dce keeps: " + _counts(
            removed
        )
    if declined:
        notes["torch CSEPass"] = "fxopt cse declined to merge: " + _counts(declined)
    return notes


def _op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "__name__", None) or str(target)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{n}× {what}" for what, n in counter.most_common())


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0
    return float((a - b)[~same].abs().nan_to_num(math.inf).max())


# --------------------------------------------------------------------------- timing


def measure(args: argparse.Namespace) -> dict:
    tools = [t for t in TOOLS if not args.tools or t.name in args.tools]
    kinds = args.graphs
    started = time.perf_counter()
    samples: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    status: dict[tuple[str, str, int], str] = {}
    nodes: dict[tuple[str, str, int], tuple[int, int]] = {}
    parity: list[dict] = []
    build_s: dict[int, float] = {}
    gave_up: set[tuple[str, str]] = set()  # (tool, kind) that timed out at a smaller size

    # Warm up every tool (lazy imports, first-call caches) on a small graph.
    warm = make_recipe(300, seed=args.seed)
    for kind, tool in itertools.product(kinds, tools):
        gm = build(warm, kind)
        for _, stage, _ in tool.stages:
            gm = stage(gm)

    total = sum(_repeats(args, s) for s in args.sizes) * len(tools) * len(kinds)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=total)
        for size in args.sizes:
            progress.update(task, description=f"generate {size:,}")
            recipe = make_recipe(size, seed=args.seed)
            if size == min(args.sizes) and not args.no_check:
                for kind in kinds:
                    progress.update(task, description=f"parity {kind} {size:,}")
                    parity += check_parity(recipe, kind, seed=args.seed)
            repeats = _repeats(args, size)
            for rep in range(repeats):
                # Round-robin: every tool once per repeat, so load drift hits all alike.
                for kind, tool in itertools.product(kinds, tools):
                    progress.update(
                        task,
                        description=(f"{size:>7,} {kind:5} {tool.name:18} {rep + 1}/{repeats}"),
                    )
                    spent = sum(c for c, _ in samples.get((tool.name, kind, size), []))
                    if (tool.name, kind) not in gave_up and not (rep and spent > args.budget):
                        _run_tool(
                            tool,
                            recipe,
                            kind,
                            args.timeout,
                            build_s,
                            samples,
                            nodes,
                            status,
                            gave_up,
                        )
                    progress.advance(task)

    rows = []
    for kind, tool, size in itertools.product(kinds, tools, args.sizes):
        for name, note in tool.rows:
            key = (name, kind, size)
            cpu = [c for c, _ in samples.get(key, [])]
            row = {
                "tool": name,
                "graph": kind,
                "size": size,
                "note": note,
                "status": status.get(key, "not run"),
            }
            if cpu and row["status"] == "ok":
                before, after = nodes[key]
                median = statistics.median(cpu)
                row |= {
                    "seconds": median,
                    "seconds_min": min(cpu),
                    "seconds_samples": cpu,
                    "wall_seconds_samples": [w for _, w in samples[key]],
                    "nodes_per_s": before / median if median > 0 else None,
                    "nodes_before": before,
                    "nodes_after": after,
                    "removed": before - after,
                }
            rows.append(row)
    return {
        "benchmark": "transform_speed",
        "machine": machine_info(),
        "command": command_line(),
        "config": {
            "sizes": args.sizes,
            "graphs": kinds,
            "repeats": {str(s): _repeats(args, s) for s in args.sizes},
            "timeout_s": args.timeout,
            "budget_s": args.budget,
            "seed": args.seed,
            "clock": "time.process_time (CPU s), median of repeats; gc paused while timed",
            "torch_threads": torch.get_num_threads(),
            "mix": {
                "p_duplicate": P_DUPLICATE,
                "p_dead": P_DEAD,
                "p_inplace": P_INPLACE,
                "p_random": P_RANDOM,
                "p_dead_random": P_DEAD_RANDOM,
                "inputs_per_node": INPUTS_PER_NODE,
                "shape": list(SHAPE),
            },
        },
        "build_seconds": {str(s): t for s, t in build_s.items()},
        "rows": rows,
        "growth": growth(rows),
        "parity": parity,
        "runtime_s": round(time.perf_counter() - started, 1),
    }


def _run_tool(tool, recipe, kind, timeout, build_s, samples, nodes, status, gave_up) -> None:
    """Build a fresh graph and time each stage of ``tool`` on it (one repeat)."""
    t0 = time.perf_counter()
    gc.disable()  # a full collection per thousand new nodes makes building 1.5× slower
    try:
        gm = build(recipe, kind)
    finally:
        gc.enable()
    build_s[recipe.size] = min(build_s.get(recipe.size, math.inf), time.perf_counter() - t0)
    first = count_nodes(gm)
    total_cpu = total_wall = 0.0
    for name, stage, _ in tool.stages:
        key = (name, kind, recipe.size)
        before = count_nodes(gm)
        try:
            gm, cpu, wall = timed(lambda g=gm, f=stage: f(g), limit=timeout)
        except Timeout:
            names = [row for row, _ in tool.rows]
            for row in names[names.index(name) :]:  # this stage, the later ones and the sum
                status[(row, kind, recipe.size)] = f"not measured (>{timeout:g} s)"
            gave_up.add((tool.name, kind))
            return
        samples.setdefault(key, []).append((cpu, wall))
        nodes[key] = (before, count_nodes(gm))
        status.setdefault(key, "ok")
        total_cpu, total_wall = total_cpu + cpu, total_wall + wall
    if len(tool.stages) > 1:
        key = (tool.name, kind, recipe.size)
        samples.setdefault(key, []).append((total_cpu, total_wall))
        nodes[key] = (first, count_nodes(gm))
        status.setdefault(key, "ok")


def _repeats(args: argparse.Namespace, size: int) -> int:
    return args.repeats if size <= 10_000 else args.repeats_large


def growth(rows: list[dict]) -> list[dict]:
    """time(next size) / time(size) per row: equals the size ratio for a linear tool."""
    out = []
    by_key = {(r["tool"], r["graph"], r["size"]): r for r in rows}
    for (tool, kind, size), row in by_key.items():
        larger = sorted(s for t, k, s in by_key if (t, k) == (tool, kind) and s > size)
        if not larger or "seconds" not in row or "seconds" not in by_key[(tool, kind, larger[0])]:
            continue
        big = by_key[(tool, kind, larger[0])]
        ratio = big["seconds"] / row["seconds"]
        size_ratio = big["nodes_before"] / row["nodes_before"]
        out.append(
            {
                "tool": tool,
                "graph": kind,
                "from": size,
                "to": larger[0],
                "ratio": ratio,
                "size_ratio": size_ratio,
                # log-log slope: 1 = linear, 2 = quadratic
                "exponent": math.log(ratio) / math.log(size_ratio) if ratio > 0 else None,
            }
        )
    return out


# --------------------------------------------------------------------------- report


def print_tables(result: dict) -> None:
    sizes = result["config"]["sizes"]
    table = Table(title="Transform speed (CPU s, median; nodes/s)", title_justify="left")
    table.add_column("tool")
    table.add_column("graph")
    for s in sizes:
        table.add_column(f"{s:,}", justify="right")
    pairs = list(itertools.pairwise(sizes))
    for a, b in pairs:
        table.add_column(f"t({b:,})/\nt({a:,})", justify="right")
    rows = {(r["tool"], r["graph"], r["size"]): r for r in result["rows"]}
    ratios = {(g["tool"], g["graph"], g["from"]): g["ratio"] for g in result["growth"]}
    for tool, kind in dict.fromkeys((r["tool"], r["graph"]) for r in result["rows"]):
        cells = []
        for s in sizes:
            r = rows[(tool, kind, s)]
            if "seconds" in r:
                cells.append(f"{_fmt_s(r['seconds'])}\n[dim]{_fmt_rate(r['nodes_per_s'])}/s[/]")
            else:
                cells.append(f"[yellow]{r['status']}[/]")
        for a, _ in pairs:
            ratio = ratios.get((tool, kind, a))
            cells.append("—" if ratio is None else f"{ratio:.1f}")
        table.add_row(tool, kind, *cells)
    console.print(table)

    if result["parity"]:
        ptable = Table(title="Parity and nodes removed (smallest size)", title_justify="left")
        for col in ("tool", "graph", "nodes", "removed", "same outputs", "where it differs"):
            ptable.add_column(col)
        for p in result["parity"]:
            ok = (
                "[green]yes[/]"
                if p["match"]
                else (f"[red]NO[/]: {p['detail']}, max |Δ| {p['max_abs_diff']:.3g}")
            )
            ptable.add_row(
                p["tool"],
                p["graph"],
                f"{p['nodes_before']} → {p['nodes_after']}",
                str(p["removed"]),
                ok,
                p.get("why", ""),
            )
        console.print(ptable)


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "—"
    return f"{rate / 1e6:.2f}M" if rate >= 1e6 else f"{rate / 1e3:.0f}k"


def plot(result: dict, path: Path) -> None:
    """Log-log time vs graph size, one panel per graph kind, one line per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = result["config"]["graphs"]
    sizes = result["config"]["sizes"]
    tools = list(dict.fromkeys(r["tool"] for r in result["rows"]))
    colors = dict(zip(tools, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(
        1, len(kinds), figsize=(6 * len(kinds), 5.5), sharey=True, squeeze=False
    )
    timed_rows = [r for r in result["rows"] if "seconds" in r]
    for ax, kind in zip(axes[0], kinds):
        for tool in tools:
            points = [
                (r["size"], r["seconds"])
                for r in timed_rows
                if (r["tool"], r["graph"]) == (tool, kind)
            ]
            if points:
                xs, ys = zip(*points)
                style = "-" if tool.startswith("fxopt") else "--"
                ax.plot(xs, ys, style, marker="o", color=colors[tool], label=tool)
        if len(sizes) > 1 and timed_rows:
            low = min(r["seconds"] for r in timed_rows if r["size"] == sizes[0])
            ax.plot(
                sizes,
                [low * s / sizes[0] for s in sizes],
                ":",
                color="grey",
                label="linear (slope 1)",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes in graph")
        ax.set_title(f"{kind} graph")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("CPU seconds (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Graph transform time vs size (solid: fxopt, dashed: torch.fx)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--graphs", nargs="+", default=list(DIALECTS), choices=list(DIALECTS))
    parser.add_argument(
        "--tools",
        nargs="+",
        choices=[t.name for t in TOOLS],
        help="time only these tools (default: all)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="repeats at sizes ≤ 10k")
    parser.add_argument("--repeats-large", type=int, default=1, help="repeats above 10k")
    parser.add_argument(
        "--budget",
        type=float,
        default=20.0,
        help="stop repeating a tool at one size after this many CPU s",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="give up on a tool (and larger sizes) after this many s per call",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the parity check")
    parser.add_argument("--out", type=Path, default=RESULTS / "transform_speed.json")
    args = parser.parse_args(argv)
    args.sizes = sorted(set(args.sizes))
    torch.set_num_threads(1)

    result = measure(args)
    write_json(args.out, result)
    png = args.out.with_suffix(".png")
    plot(result, png)
    print_tables(result)
    console.print(f"wrote {args.out} and {png} in {result['runtime_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
