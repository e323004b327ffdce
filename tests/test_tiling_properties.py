"""Property tests of the tiler on random DAGs: the exact solver is optimal (it equals the
HiGHS ILP optimum and a brute force), its tiles are valid and schedulable, and nothing
depends on hash order."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fxopt.tiling import Graph, Pattern, match, tile
from fxopt.tiling.placements import find_placements
from tests.test_tiling import is_acyclic, is_schedulable

OPS = ("relu", "sigmoid", "add", "mul")
BINARY = {"add", "mul"}


@st.composite
def dags(draw, max_nodes: int = 12):
    """A random DAG over OPS: binary ops read two earlier values (or graph inputs)."""
    size = draw(st.integers(2, max_nodes))
    nodes = []
    for i in range(size):
        op = draw(st.sampled_from(OPS))
        sources = [f"n{j}" for j in range(i)] + ["x", "y"]
        arity = 2 if op in BINARY else 1
        # Prefer recent values: chains and diamonds, like real graphs.
        inputs = [
            draw(st.sampled_from(sources[max(0, i - 3) :] if draw(st.booleans()) else sources))
            for _ in range(arity)
        ]
        nodes.append({"id": f"n{i}", "op": op, "inputs": inputs})
    readers = {v for n in nodes for v in n["inputs"]}
    outputs = [n["id"] for n in nodes if n["id"] not in readers or draw(st.booleans())]
    return Graph.from_json({"nodes": nodes, "outputs": outputs})


@st.composite
def crossed_dags(draw):
    """Chains of "crossed" gadgets — a1 = relu, b1 = sigmoid, a2 = add(a1, b1),
    b2 = mul(b1, a1) — whose relu_add and sigmoid_mul tiles are each convex but cannot both
    be chosen, wired to each other and to random extra nodes: the cycle cuts at work."""
    nodes: list[dict] = []
    values = ["x", "y"]
    for k in range(draw(st.integers(1, 3))):
        src_a, src_b = draw(st.sampled_from(values)), draw(st.sampled_from(values))
        a1, b1, a2, b2 = (f"g{k}_{n}" for n in ("a1", "b1", "a2", "b2"))
        nodes += [
            {"id": a1, "op": "relu", "inputs": [src_a]},
            {"id": b1, "op": "sigmoid", "inputs": [src_b]},
            {"id": a2, "op": "add", "inputs": draw(st.permutations([a1, b1]))},
            {"id": b2, "op": "mul", "inputs": draw(st.permutations([b1, a1]))},
        ]
        values += [a2, b2]
        for e in range(draw(st.integers(0, 2))):
            op = draw(st.sampled_from(OPS))
            arity = 2 if op in BINARY else 1
            ins = [draw(st.sampled_from(values)) for _ in range(arity)]
            nodes.append({"id": f"g{k}_e{e}", "op": op, "inputs": ins})
            values.append(f"g{k}_e{e}")
    readers = {v for n in nodes for v in n["inputs"]}
    outputs = [n["id"] for n in nodes if n["id"] not in readers]
    return Graph.from_json({"nodes": nodes, "outputs": outputs})


def pat(name: str, *nodes: tuple[str, str, list], outputs=None) -> Pattern:
    return Pattern(name, [{"id": i, "op": op, "inputs": ins} for i, op, ins in nodes], outputs)


# Two- and three-node kernels over OPS, with every output declared so that they match often.
LIBRARY = [
    pat("relu_add", ("a", "relu", ["*"]), ("b", "add", ["a", "*"]), outputs=["a", "b"]),
    pat("add_relu", ("a", "add", ["*", "*"]), ("b", "relu", ["a"])),
    pat("mul_add", ("a", "mul", ["*", "*"]), ("b", "add", ["a", "*"]), outputs=["a", "b"]),
    pat("relu_sigmoid", ("a", "relu", ["*"]), ("b", "sigmoid", ["a"]), outputs=["a", "b"]),
    pat("sigmoid_mul", ("a", "sigmoid", ["*"]), ("b", "mul", ["a", "*"]), outputs=["a", "b"]),
    pat(
        "chain3",
        ("a", "relu", ["*"]),
        ("b", "sigmoid", ["a"]),
        ("c", "add", ["b", "*"]),
        outputs=["a", "b", "c"],
    ),
    pat("square", ("a", "relu", ["*"]), ("b", "mul", ["a", "a"])),
    pat(
        "fork",
        ("a", "relu", ["*"]),
        ("b", "sigmoid", ["a"]),
        ("c", "mul", ["a", "b"]),
        outputs=["a", "b", "c"],
    ),
    *(pat(op, (op, op, [])) for op in OPS),
]


@st.composite
def libraries(draw):
    chosen = draw(st.lists(st.sampled_from(LIBRARY), min_size=1, max_size=8, unique_by=id))
    if draw(st.booleans()):
        chosen = [
            Pattern(p.name, p.nodes, p.outputs, draw(st.sampled_from([1, 2, 3, 0.5])))
            for p in chosen
        ]
    return chosen


def brute_force(graph: Graph, library) -> tuple[int, float]:
    """Best (coverage, cost) over every subset of placements that is disjoint and
    schedulable: the definition, with no cleverness."""
    placements = [p for pattern in library for p in find_placements(graph, pattern)]
    costs = any(p.cost is not None for p in library)
    best = (0, 0.0)
    for r in range(len(placements) + 1):
        for subset in itertools.combinations(placements, r):
            covered = [v for p in subset for v in p.mapping]
            if len(covered) != len(set(covered)):
                continue
            value = (len(covered), sum((p.pattern.cost or 1.0) if costs else 1 for p in subset))
            better = value[0] > best[0] or (value[0] == best[0] and value[1] < best[1])
            if better and _acyclic(graph, subset):
                best = value
    return best


def _acyclic(graph: Graph, subset) -> bool:
    group = list(range(len(graph)))
    for k, p in enumerate(subset):
        for v in p.mapping:
            group[v] = len(graph) + k
    succ: dict[int, set[int]] = {}
    for v in range(len(graph)):
        for u in graph.preds[v]:
            if group[u] != group[v]:
                succ.setdefault(group[u], set()).add(group[v])
    return is_acyclic(set(group), succ)


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(dags(), libraries())
def test_exact_solver_equals_the_ilp_optimum(graph, library):
    exact = tile(graph, library, solver="exact")
    ilp = tile(graph, library, solver="ilp")
    assert exact.covered == ilp.covered
    assert abs(exact.cost - ilp.cost) < 1e-9
    greedy = tile(graph, library, solver="greedy")
    assert (greedy.covered, -greedy.cost) <= (exact.covered, -exact.cost + 1e-9)
    for result in (exact, ilp, greedy):
        covered = [g for t in result.tiles for g in t.nodes.values()]
        assert len(covered) == len(set(covered)) == result.covered  # each node once
        assert is_schedulable(graph, result)
        for t in result.tiles:  # every tile is a valid placement of its pattern
            pattern = next(p for p in library if p.name == t.pattern)
            assert t.nodes in match(graph, pattern)


@FAST
@given(crossed_dags(), libraries())
def test_schedulability_cuts_keep_exact_and_ilp_equal(graph, library):
    names = {p.name for p in library}
    library = [*library, *(p for p in LIBRARY[:5] if p.name not in names)]
    exact = tile(graph, library, solver="exact")
    ilp = tile(graph, library, solver="ilp")
    assert (exact.covered, exact.cost) == (ilp.covered, ilp.cost)
    assert is_schedulable(graph, exact) and is_schedulable(graph, ilp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.one_of(dags(max_nodes=7), crossed_dags()), libraries())
def test_exact_solver_equals_brute_force_on_small_graphs(graph, library):
    placements = sum(len(find_placements(graph, p)) for p in library)
    assume(placements <= 16)  # 2^16 subsets at most
    exact = tile(graph, library, solver="exact")
    covered, cost = brute_force(graph, library)
    assert exact.covered == covered
    assert abs(exact.cost - cost) < 1e-9


def test_same_answer_under_any_hash_seed(tmp_path):
    """Ids are strings, so set iteration order changes with PYTHONHASHSEED; the tiling
    must not."""
    nodes = []
    for block in range(6):  # identical blocks with symmetric branches: many ties
        base = f"blk{block - 1}_out" if block else "x"
        nodes += [
            {"id": f"blk{block}_l", "op": "relu", "inputs": [base]},
            {"id": f"blk{block}_r", "op": "relu", "inputs": [base]},
            {"id": f"blk{block}_ls", "op": "sigmoid", "inputs": [f"blk{block}_l"]},
            {"id": f"blk{block}_rs", "op": "sigmoid", "inputs": [f"blk{block}_r"]},
            {"id": f"blk{block}_out", "op": "add", "inputs": [f"blk{block}_ls", f"blk{block}_rs"]},
        ]
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps({"nodes": nodes, "outputs": ["blk5_out"]}))
    library = tmp_path / "lib.json"
    library.write_text(json.dumps({"patterns": [p.to_json() for p in LIBRARY]}))
    script = textwrap.dedent(
        f"""
        import json
        from fxopt.tiling import tile
        out = {{s: tile({str(graph)!r}, {str(library)!r}, solver=s).to_json()
                for s in ("exact", "auto", "greedy")}}
        for r in out.values():
            r.pop("time_ms"), r.pop("match_ms"), r.pop("solve_ms")
        print(json.dumps(out, sort_keys=True))
        """
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("0", "1", "12345")
    ]
    outputs = [run.communicate(timeout=120)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs[0] == outputs[1] == outputs[2]
    assert json.loads(outputs[0])["exact"]["covered"] == len(nodes)
