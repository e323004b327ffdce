"""The tiler: graph format, patterns, matching rules and the optimal solver."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fxopt.tiling import Graph, Pattern, TilingInputError, load_library, match, tile


def chain(*ops: str, output: bool = True) -> Graph:
    """x → n0 → n1 → ... with the given ops; the last node is the graph output."""
    nodes = [
        {"id": f"n{i}", "op": op, "inputs": ["x" if i == 0 else f"n{i - 1}"]}
        for i, op in enumerate(ops)
    ]
    return Graph.from_json({"nodes": nodes, "outputs": [f"n{len(ops) - 1}"] if output else []})


def chain_pattern(name: str, *ops: str) -> Pattern:
    nodes = [
        {"id": f"p{i}", "op": op, "inputs": ["*" if i == 0 else f"p{i - 1}"]}
        for i, op in enumerate(ops)
    ]
    return Pattern(name, nodes)


def single(op: str) -> Pattern:
    return Pattern(op, [{"id": "s", "op": op, "inputs": []}])


def is_schedulable(graph: Graph, tiling) -> bool:
    """The graph with each tile contracted to one node is acyclic, and `tiles` lists the
    tiles in a topological order of it."""
    where = tiling.tile_index()
    rank: dict[str, int] = {}
    for k in range(len(tiling.tiles)):
        rank[f"t{k}"] = k
    group = {n.id: f"t{where[n.id]}" if n.id in where else n.id for n in graph.nodes}
    succ: dict[str, set[str]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v in group and group[v] != group[n.id]:
                succ.setdefault(group[v], set()).add(group[n.id])
    # tiles listed in topological order: no tile edge goes to an earlier tile
    for a, targets in succ.items():
        for b in targets:
            if a in rank and b in rank and rank[a] >= rank[b]:
                return False
    # and the contracted graph is acyclic
    return is_acyclic(set(group.values()), succ)


def is_acyclic(vertices, succ: dict) -> bool:
    """Kahn's algorithm: every vertex can be removed once its predecessors are."""
    indegree = dict.fromkeys(vertices, 0)
    for targets in succ.values():
        for b in targets:
            indegree[b] += 1
    ready = [g for g, d in indegree.items() if d == 0]
    seen = 0
    while ready:
        g = ready.pop()
        seen += 1
        for b in succ.get(g, ()):
            indegree[b] -= 1
            if indegree[b] == 0:
                ready.append(b)
    return seen == len(indegree)


# --------------------------------------------------------------------------- graph


def test_graph_sorts_topologically_and_finds_external_inputs():
    g = Graph.from_json(
        {
            "nodes": [
                {"id": "b", "op": "relu", "inputs": ["a"]},
                {"id": "a", "op": "matmul", "inputs": ["x", "w"]},
            ],
            "outputs": ["b"],
        }
    )
    assert [n.id for n in g.nodes] == ["a", "b"]
    assert g.inputs == ("x", "w")
    assert Graph.from_json(g.to_json()).to_json() == g.to_json()


def test_from_fx_keeps_real_argument_positions_and_elides_eval_dropout():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x, y):
            return torch.cat([self.drop(1.0 - x), y], dim=1).clamp(min=y)

    gm = torch.fx.symbolic_trace(Model().eval())
    g = Graph.from_fx(gm)
    ops = {n.id: (n.op, n.inputs) for n in g.nodes}
    assert ops["sub"] == ("sub", (None, "x"))  # slot 1, not "the first compute input"
    assert ops["cat"] == ("cat", ("sub", "y"))  # dropout elided, list flattened
    assert ops["clamp"] == ("clamp", ("cat", "y"))  # node-valued keyword after the args
    assert g.elided == ("drop",)
    assert [n.id for n in Graph.from_fx(gm, elide_noops=False).nodes].count("drop") == 1


def test_from_fx_keeps_training_mode_dropout():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train())
    assert [n.op for n in Graph.from_fx(gm).nodes] == ["linear", "dropout"]


# --------------------------------------------------------------------------- patterns


def test_builtin_libraries_load_and_join():
    for name in ("transformer", "cnn", "singles", "transformer+cnn+singles"):
        assert len(load_library(name)) > 5
    singles = load_library("singles")
    assert {p.name for p in singles} >= {"relu", "add", "linear", "conv"}


def test_pattern_outputs_default_to_sinks():
    p = Pattern("p", [{"id": "a", "op": "relu"}, {"id": "b", "op": "exp", "inputs": ["a"]}])
    assert p.outputs == ("b",)


# --------------------------------------------------------------------------- worked example


def test_mm_relu_chain_gets_two_mm_relu_tiles():
    """mm → relu → mm → relu with [mm], [relu], [mm → relu]: two mm_relu tiles."""
    g = Graph.from_json(
        {
            "nodes": [
                {"id": "1", "op": "mm", "inputs": ["x", "w1"]},
                {"id": "2", "op": "relu", "inputs": ["1"]},
                {"id": "3", "op": "mm", "inputs": ["2", "w2"]},
                {"id": "4", "op": "relu", "inputs": ["3"]},
            ],
            "outputs": ["4"],
        }
    )
    mm_relu = Pattern(
        "mm_relu",
        [{"id": "a", "op": "mm", "inputs": ["*", "*"]}, {"id": "b", "op": "relu", "inputs": ["a"]}],
    )
    library = [single("mm"), single("relu"), mm_relu]
    assert match(g, mm_relu) == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
    assert len(match(g, single("mm"))) == 2
    for solver in ("exact", "ilp", "auto"):
        result = tile(g, library, solver=solver)
        assert (result.covered, result.tile_count) == (4, 2)
        assert [t.pattern for t in result.tiles] == ["mm_relu", "mm_relu"]
        assert [t.nodes for t in result.tiles] == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
        assert result.optimal and result.uncovered == []


# --------------------------------------------------------------------------- the solver


FIVE = ("relu", "sigmoid", "tanh", "exp", "neg")


def five_chain_library():
    a, b, c, d, e = FIVE
    return [
        chain_pattern("abc", a, b, c),
        chain_pattern("ab", a, b),
        chain_pattern("cde", c, d, e),
        chain_pattern("cd", c, d),
        *(single(op) for op in FIVE),
    ]


@pytest.mark.parametrize("solver", ["exact", "ilp", "auto"])
def test_five_chain_needs_two_tiles(solver):
    """Stopping at the first full coverage would pick abc + d + e (3 tiles)."""
    result = tile(chain(*FIVE), five_chain_library(), solver=solver)
    assert (result.covered, result.tile_count) == (5, 2)
    assert [t.pattern for t in result.tiles] == ["ab", "cde"]


def test_greedy_first_match_is_worse_on_the_five_chain():
    result = tile(chain(*FIVE), five_chain_library(), solver="greedy")
    assert (result.covered, result.tile_count) == (5, 3)
    assert not result.optimal


def test_costs_change_the_optimum():
    lib = five_chain_library()
    lib[1] = Pattern("ab", lib[1].nodes, cost=5.0)  # ab is now expensive
    result = tile(chain(*FIVE), lib)
    assert result.covered == 5
    assert result.cost == 3.0  # abc + d + e beats ab (5) + cde
    assert [t.pattern for t in result.tiles] == ["abc", "exp", "neg"]


def test_coverage_comes_before_tile_count():
    # Tile "ab" alone covers 2; "a" + "bc" covers 3 with more tiles: coverage wins.
    g = chain("relu", "sigmoid", "tanh")
    lib = [chain_pattern("ab", "relu", "sigmoid"), chain_pattern("bc", "sigmoid", "tanh")]
    lib.append(single("relu"))
    result = tile(g, lib)
    assert (result.covered, result.tile_count) == (3, 2)
    assert [t.pattern for t in result.tiles] == ["relu", "bc"]


def test_uncovered_nodes_are_reported_by_op_and_unused_patterns_are_not_errors():
    g = chain("relu", "sigmoid", "relu", "sigmoid")
    result = tile(g, [single("relu"), single("conv")])
    assert result.uncovered == [("n1", "sigmoid"), ("n3", "sigmoid")]
    assert result.uncovered_by_op() == {"sigmoid": ["n1", "n3"]}
    assert result.unused_patterns == {"conv": "no conv in the graph"}


# --------------------------------------------------------------------------- matching rules


def add_of(a: str, b: str, *, commutative: bool | None = None) -> dict:
    node = {"id": "s", "op": "add", "inputs": [a, b]}
    if commutative is not None:
        node["commutative"] = commutative
    return node


def relus(*names: str) -> list[dict]:
    return [{"id": n, "op": "relu", "inputs": [f"in_{n}"]} for n in names]


DOUBLE = Pattern(
    "double",
    [{"id": "A", "op": "relu", "inputs": ["*"]}, {"id": "s", "op": "add", "inputs": ["A", "A"]}],
)


def test_commutative_match_is_a_multiset_not_a_set():
    same = Graph.from_json({"nodes": [*relus("p"), add_of("p", "p")], "outputs": ["s"]})
    different = Graph.from_json({"nodes": [*relus("p", "q"), add_of("p", "q")], "outputs": ["s"]})
    assert match(same, DOUBLE) == [{"A": "p", "s": "s"}]
    assert match(different, DOUBLE) == []  # set membership alone would accept p and q


def test_named_wildcards_bind_one_value():
    pattern = Pattern("x_plus_x", [{"id": "s", "op": "add", "inputs": ["X", "X"]}])
    anything = Pattern("x_plus_y", [{"id": "s", "op": "add", "inputs": ["X", "Y"]}])
    same = Graph.from_json({"nodes": [add_of("u", "u")], "outputs": ["s"]})
    different = Graph.from_json({"nodes": [add_of("u", "v")], "outputs": ["s"]})
    assert len(match(same, pattern)) == 1 and match(different, pattern) == []
    assert len(match(same, anything)) == 1 and len(match(different, anything)) == 1


def test_commutative_slots_may_swap_but_not_for_other_ops():
    relu_add = Pattern(
        "relu_add",
        [
            {"id": "r", "op": "relu", "inputs": ["*"]},
            {"id": "s", "op": "add", "inputs": ["r", "*"]},
        ],
    )
    swapped = Graph.from_json({"nodes": [*relus("p"), add_of("y", "p")], "outputs": ["s"]})
    assert match(swapped, relu_add) == [{"r": "p", "s": "s"}]
    # sub is not commutative; neither is an add the graph marks as such (add with alpha)
    relu_sub = Pattern(
        "relu_sub",
        [
            {"id": "r", "op": "relu", "inputs": ["*"]},
            {"id": "s", "op": "sub", "inputs": ["r", "*"]},
        ],
    )
    sub = {"id": "s", "op": "sub", "inputs": ["y", "p"]}
    assert match(Graph.from_json({"nodes": [*relus("p"), sub]}), relu_sub) == []
    fixed = Graph.from_json({"nodes": [*relus("p"), add_of("y", "p", commutative=False)]})
    assert match(fixed, relu_add) == []


def test_wildcard_must_bind_outside_the_tile():
    # add(r, *) on add(r, r): the wildcard would bind to r, inside the tile.
    relu_add = Pattern(
        "relu_add",
        [
            {"id": "r", "op": "relu", "inputs": ["*"]},
            {"id": "s", "op": "add", "inputs": ["r", "*"]},
        ],
    )
    g = Graph.from_json({"nodes": [*relus("p"), add_of("p", "p")], "outputs": ["s"]})
    assert match(g, relu_add) == []


def test_induced_placement_rejects_an_edge_the_pattern_lacks():
    # Pattern relu, sigmoid → add(relu, sigmoid): sigmoid's input is left unconstrained.
    pattern = Pattern(
        "join",
        [
            {"id": "a", "op": "relu", "inputs": ["*"]},
            {"id": "b", "op": "sigmoid", "inputs": []},
            {"id": "c", "op": "add", "inputs": ["a", "b"]},
        ],
    )
    nodes = [
        {"id": "a", "op": "relu", "inputs": ["x"]},
        {"id": "b", "op": "sigmoid", "inputs": ["SRC"]},
        {"id": "c", "op": "add", "inputs": ["a", "b"]},
    ]
    separate = Graph.from_json({"nodes": nodes, "outputs": ["c"]})
    assert match(separate, pattern) == [{"a": "a", "b": "b", "c": "c"}]
    nodes[1]["inputs"] = ["a"]  # now a → b inside the tile: not in the pattern
    linked = Graph.from_json({"nodes": nodes, "outputs": ["c"]})
    assert match(linked, pattern) == []


def test_output_constraint_includes_graph_outputs():
    nodes = [
        {"id": "m", "op": "matmul", "inputs": ["x", "w"]},
        {"id": "r", "op": "relu", "inputs": ["m"]},
    ]
    relu_only = Pattern(
        "mm_relu",
        [
            {"id": "a", "op": "matmul", "inputs": ["*", "*"]},
            {"id": "b", "op": "relu", "inputs": ["a"]},
        ],
        outputs=["b"],
    )
    both = Pattern("mm_relu2", relu_only.nodes, outputs=["a", "b"])
    returns_r = Graph.from_json({"nodes": nodes, "outputs": ["r"]})
    returns_both = Graph.from_json({"nodes": nodes, "outputs": ["r", "m"]})
    assert len(match(returns_r, relu_only)) == 1
    assert match(returns_both, relu_only) == []  # m leaves the graph: must be an output
    assert len(match(returns_both, both)) == 1
    # mm's value escapes to a reader outside the tile: only a pattern that outputs it fits.
    escapes = Graph.from_json(
        {"nodes": [*nodes, {"id": "s", "op": "add", "inputs": ["r", "m"]}], "outputs": ["s"]}
    )
    assert match(escapes, relu_only) == []
    assert len(match(escapes, both)) == 1


def test_non_convex_placement_is_rejected():
    # r → s → t with r → t: the tile {r, t} would wait on s, which needs r.
    pattern = Pattern(
        "relu_add",
        [
            {"id": "r", "op": "relu", "inputs": ["*"]},
            {"id": "a", "op": "add", "inputs": ["r", "*"]},
        ],
        outputs=["r", "a"],
    )
    g = Graph.from_json(
        {
            "nodes": [
                {"id": "r", "op": "relu", "inputs": ["x"]},
                {"id": "s", "op": "sigmoid", "inputs": ["r"]},
                {"id": "t", "op": "add", "inputs": ["r", "s"]},
            ],
            "outputs": ["t"],
        }
    )
    assert match(g, pattern) == []


CROSSED = {
    "nodes": [
        {"id": "a1", "op": "relu", "inputs": ["x"]},
        {"id": "b1", "op": "sigmoid", "inputs": ["y"]},
        {"id": "a2", "op": "add", "inputs": ["a1", "b1"]},
        {"id": "b2", "op": "mul", "inputs": ["b1", "a1"]},
    ],
    "outputs": ["a2", "b2"],
}


def crossed_library():
    tile_a = Pattern(
        "relu_add",
        [
            {"id": "r", "op": "relu", "inputs": ["*"]},
            {"id": "s", "op": "add", "inputs": ["r", "*"]},
        ],
        outputs=["r", "s"],
    )
    tile_b = Pattern(
        "sigmoid_mul",
        [
            {"id": "t", "op": "sigmoid", "inputs": ["*"]},
            {"id": "u", "op": "mul", "inputs": ["t", "*"]},
        ],
        outputs=["t", "u"],
    )
    return [tile_a, tile_b, *(single(op) for op in ("relu", "sigmoid", "add", "mul"))]


@pytest.mark.parametrize("solver", ["exact", "ilp", "auto", "greedy"])
def test_crossed_convex_tiles_that_would_form_a_cycle(solver):
    """A = {a1, a2} and B = {b1, b2} are each convex, but a1 → b2 and b1 → a2: A needs B
    and B needs A. Only one of them may be chosen: 3 tiles, not 2."""
    g = Graph.from_json(CROSSED)
    lib = crossed_library()
    assert len(match(g, lib[0])) == 1 and len(match(g, lib[1])) == 1
    result = tile(g, lib, solver=solver)
    assert (result.covered, result.tile_count) == (4, 3)
    assert is_schedulable(g, result)
    if solver != "greedy":
        assert result.cuts == 1


def test_tiles_are_listed_in_topological_order():
    # Tile B = {b} feeds the second node of tile A = {a0, a2}, which starts earlier.
    g = Graph.from_json(
        {
            "nodes": [
                {"id": "a0", "op": "relu", "inputs": ["x"]},
                {"id": "b", "op": "sigmoid", "inputs": ["y"]},
                {"id": "a2", "op": "add", "inputs": ["a0", "b"]},
            ],
            "outputs": ["a2"],
        }
    )
    lib = [crossed_library()[0], single("sigmoid")]
    result = tile(g, lib)
    assert [t.pattern for t in result.tiles] == ["sigmoid", "relu_add"]
    assert is_schedulable(g, result)


# --------------------------------------------------------------------------- real models


def test_bert_block_tiles_with_the_transformer_library():
    from fxopt import models
    from fxopt.capture import trace

    loaded = models.load("zoo:bert?layers=2&seq=8")
    gm = trace(loaded.model, loaded.example_inputs, mode="fx")
    exact = tile(gm, "transformer")
    ilp = tile(exact.graph, "transformer", solver="ilp")
    assert (exact.covered, exact.cost) == (ilp.covered, ilp.cost)
    per_pattern = exact.tiles_per_pattern()
    assert per_pattern["attention_masked"] == 2
    assert per_pattern["linear_split_heads_sized"] == 6  # q, k, v per layer
    assert exact.coverage > 0.8
    assert is_schedulable(exact.graph, exact)
    # every covered node is covered once
    covered = [g for t in exact.tiles for g in t.nodes.values()]
    assert len(covered) == len(set(covered)) == exact.covered


def test_resnet_tiles_with_the_cnn_library():
    from fxopt import models
    from fxopt.capture import trace

    loaded = models.load("zoo:resnet18?image=32")
    gm = trace(loaded.model, loaded.example_inputs, mode="fx")
    result = tile(gm, "cnn")
    assert result.coverage == 1.0
    assert result.tiles_per_pattern()["conv_bn_add_relu"] == 8  # one per basic block


# --------------------------------------------------------------------------- bad input


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("g.json", '{"nodes": [', "g.json: malformed JSON at line 1"),
        ("g.yaml", "nodes: [a, b\n  c: 1", "g.yaml: malformed YAML at line"),
        (
            "g.json",
            json.dumps({"nodes": [{"id": "a", "op": "relu", "inputs": ["xx"]}], "inputs": ["x"]}),
            "g.json: nodes[0] ('a'): input 'xx' is not a node and not one of the declared",
        ),
        (
            "g.json",
            json.dumps(
                {
                    "nodes": [
                        {"id": "a", "op": "relu", "inputs": ["b"]},
                        {"id": "b", "op": "relu", "inputs": ["a"]},
                    ]
                }
            ),
            "g.json: the graph has a cycle: a → b → a",
        ),
        (
            "g.json",
            json.dumps({"nodes": [{"id": "a", "op": "relu"}, {"id": "a", "op": "exp"}]}),
            "g.json: nodes[1]: duplicate id 'a'",
        ),
        ("g.json", json.dumps({"nodes": [{"id": "a"}]}), "g.json: nodes[0] ('a'): 'op'"),
        ("g.json", json.dumps({"nodes": [], "outputs": ["z"]}), "output 'z' is not a node"),
    ],
)
def test_bad_graph_files_name_the_file_and_the_entry(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(TilingInputError) as error:
        Graph.from_json(path)
    assert message in str(error.value).replace(str(tmp_path) + "/", "")


@pytest.mark.parametrize(
    ("patterns", "message"),
    [
        ([{"name": "p", "nodes": []}], "lib.json: patterns[0] ('p'): a pattern needs at least"),
        (
            [{"name": "p", "nodes": [{"id": "a", "op": "relu"}], "outputs": ["b"]}],
            "lib.json: patterns[0] ('p'): output 'b' is not one of its nodes",
        ),
        (
            [{"name": "p", "nodes": [{"id": "a", "op": "relu"}]}] * 2,
            "lib.json: patterns[1] ('p'): duplicate pattern name 'p' (also patterns[0])",
        ),
        (
            [
                {
                    "name": "p",
                    "nodes": [
                        {"id": "a", "op": "relu", "inputs": ["b"]},
                        {"id": "b", "op": "relu", "inputs": ["a"]},
                    ],
                }
            ],
            "lib.json: patterns[0] ('p'): the graph has a cycle",
        ),
        (
            [{"name": "p", "nodes": [{"id": "a", "op": "relu"}], "cost": -1}],
            "'cost' must be a positive number",
        ),
        ([{"nodes": [{"id": "a", "op": "relu"}]}], "patterns[0]: 'name' must be"),
    ],
)
def test_bad_libraries_name_the_file_and_the_pattern(tmp_path, patterns, message):
    path = write(tmp_path, "lib.json", json.dumps({"patterns": patterns}))
    with pytest.raises(TilingInputError) as error:
        load_library(str(path))
    assert message in str(error.value).replace(str(tmp_path) + "/", "")


def test_unknown_library_and_solver():
    with pytest.raises(TilingInputError, match="unknown library 'transformr'"):
        load_library("transformr")
    with pytest.raises(TilingInputError, match="library file not found"):
        load_library("missing/lib.yaml")
    with pytest.raises(TilingInputError, match="unknown solver"):
        tile(chain("relu"), [single("relu")], solver="fast")


# --- alternatives and optional nodes -------------------------------------------------------

_SCALED = {
    "name": "scaled_relu",
    "nodes": [
        {"id": "t", "op": ["transpose", "permute"], "inputs": ["x"]},
        {"id": "c", "op": "clone", "inputs": ["t"], "optional": True},
        {"id": "r", "op": "relu", "inputs": ["c"]},
    ],
}


def test_a_pattern_stands_for_each_choice_of_op_and_each_optional_node():
    (pattern,) = load_library([_SCALED])
    shapes = sorted((tuple(v.ops), v.outputs) for v in pattern.variants())
    assert shapes == [
        (("permute", "clone", "relu"), ("r",)),
        (("permute", "relu"), ("r",)),
        (("transpose", "clone", "relu"), ("r",)),
        (("transpose", "relu"), ("r",)),
    ]
    without = next(v for v in pattern.variants() if v.ops == ["transpose", "relu"])
    assert without.nodes[1].inputs == ("t",)  # the relu reads what the clone read
    assert load_library([pattern.to_json()]).pattern("scaled_relu") == pattern


def test_each_variant_places_under_the_patterns_name():
    graph = Graph.from_json(
        {
            "nodes": [
                {"id": "a", "op": "transpose", "inputs": ["x"]},
                {"id": "b", "op": "relu", "inputs": ["a"]},
                {"id": "c", "op": "permute", "inputs": ["b"]},
                {"id": "d", "op": "clone", "inputs": ["c"]},
                {"id": "e", "op": "relu", "inputs": ["d"]},
            ],
            "outputs": ["e"],
        }
    )
    assert match(graph, load_library([_SCALED]).pattern("scaled_relu")) == [
        {"t": "a", "r": "b"},
        {"t": "c", "c": "d", "r": "e"},
    ]
    result = tile(graph, load_library([_SCALED]))
    assert [t.pattern for t in result.tiles] == ["scaled_relu", "scaled_relu"]


def test_an_optional_node_must_pass_a_pattern_node_through():
    bad = {"name": "b", "nodes": [{"id": "a", "op": "add", "inputs": ["x"], "optional": True}]}
    with pytest.raises(TilingInputError, match="optional node 'a' must read a node"):
        load_library([bad])
