"""``tile(graph, library)``: match every pattern, then choose the optimal set of tiles.

    >>> from fxopt.tiling import Graph, tile
    >>> g = Graph.from_json({"nodes": [
    ...     {"id": "m1", "op": "linear", "inputs": ["x"]},
    ...     {"id": "g1", "op": "gelu", "inputs": ["m1"]},
    ...     {"id": "m2", "op": "linear", "inputs": ["g1"]},
    ...     {"id": "s", "op": "sigmoid", "inputs": ["m2"]}], "outputs": ["s"]})
    >>> t = tile(g, "transformer")
    >>> t.covered, t.tile_count, [x.pattern for x in t.tiles], t.uncovered
    (3, 1, ['mlp_gelu'], [('s', 'sigmoid')])

The objective is lexicographic: cover as many nodes as possible, then use as few tiles
as possible (or the least total cost when the library gives costs). See
:mod:`fxopt.tiling.solve` for how optimality is proved.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fxopt.tiling.errors import TilingInputError
from fxopt.tiling.graph import Graph
from fxopt.tiling.pattern import Library, LibrarySpec, load_library
from fxopt.tiling.placements import Placement, find_placements
from fxopt.tiling.solve import AUTO_STATE_BUDGET, SOLVERS, solve

__all__ = ["Tile", "Tiling", "as_graph", "tile"]


@dataclass(frozen=True)
class Tile:
    """One chosen placement: the pattern's name and its nodes (pattern id → graph id)."""

    pattern: str
    nodes: dict[str, str]
    cost: float = 1.0


@dataclass
class Tiling:
    """The result of :func:`tile`. ``tiles`` are in a topological order of the tiles."""

    graph: Graph
    library: Library
    tiles: list[Tile]
    covered: int
    cost: float
    solver: str
    optimal: bool
    states: int = 0
    components: int = 0
    cuts: int = 0
    placements: int = 0
    match_ms: float = 0.0
    solve_ms: float = 0.0
    #: Patterns with no valid placement in the graph (with the reason, e.g. a missing op).
    unused_patterns: dict[str, str] = field(default_factory=dict)
    #: Placements the caller's ``accept`` refused, with its reason (never offered to the
    #: solver), and valid placements the solver did not choose, with the tile that won.
    refused: list[tuple[Tile, str]] = field(default_factory=list)
    not_chosen: list[tuple[Tile, str]] = field(default_factory=list)

    @property
    def nodes(self) -> int:
        """Number of graph nodes."""
        return len(self.graph)

    @property
    def tile_count(self) -> int:
        return len(self.tiles)

    @property
    def coverage(self) -> float:
        """Covered fraction of the graph's nodes (1.0 for an empty graph)."""
        return self.covered / len(self.graph) if len(self.graph) else 1.0

    @property
    def time_ms(self) -> float:
        """Matching plus solving, in milliseconds."""
        return self.match_ms + self.solve_ms

    @property
    def uncovered(self) -> list[tuple[str, str]]:
        """(id, op) of every node no tile covers, in topological order."""
        covered = {g for t in self.tiles for g in t.nodes.values()}
        return [(n.id, n.op) for n in self.graph.nodes if n.id not in covered]

    def uncovered_by_op(self) -> dict[str, list[str]]:
        """Uncovered node ids grouped by op, most frequent op first."""
        groups: dict[str, list[str]] = {}
        for node_id, op in self.uncovered:
            groups.setdefault(op, []).append(node_id)
        return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))

    def tiles_per_pattern(self) -> dict[str, int]:
        """How many tiles use each pattern, in library order (unused patterns left out)."""
        counts = {p.name: 0 for p in self.library}
        for t in self.tiles:
            counts[t.pattern] += 1
        return {name: c for name, c in counts.items() if c}

    def tile_index(self) -> dict[str, int]:
        """Graph node id → index in :attr:`tiles` of the tile covering it."""
        return {g: k for k, t in enumerate(self.tiles) for g in t.nodes.values()}

    def to_json(self) -> dict[str, Any]:
        """The ``fxopt tile --json`` object; its first five keys are the ones scripts rely
        on (nodes, covered, tile_count, tiles, time_ms)."""
        return {
            "nodes": self.nodes,
            "covered": self.covered,
            "tile_count": self.tile_count,
            "tiles": [{"pattern": t.pattern, "nodes": t.nodes} for t in self.tiles],
            "time_ms": round(self.time_ms, 3),
            "coverage": round(self.coverage, 6),
            "cost": self.cost,
            "library": self.library.name,
            "solver": self.solver,
            "optimal": self.optimal,
            "states": self.states,
            "components": self.components,
            "cuts": self.cuts,
            "placements": self.placements,
            "match_ms": round(self.match_ms, 3),
            "solve_ms": round(self.solve_ms, 3),
            "tiles_per_pattern": self.tiles_per_pattern(),
            "uncovered": [{"id": i, "op": op} for i, op in self.uncovered],
            "uncovered_by_op": {op: len(ids) for op, ids in self.uncovered_by_op().items()},
            "unused_patterns": self.unused_patterns,
            "refused": [_explained(t, why) for t, why in self.refused],
            "not_chosen": [_explained(t, why) for t, why in self.not_chosen],
            "elided": list(self.graph.elided),
        }


def _explained(t: Tile, reason: str) -> dict[str, Any]:
    return {"pattern": t.pattern, "nodes": t.nodes, "reason": reason}


def as_graph(graph: Any, *, elide_noops: bool = True) -> Graph:
    """A :class:`Graph` from a Graph, an fx GraphModule, a JSON dict or a JSON file path."""
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, (Mapping, str, Path)):
        return Graph.from_json(graph)
    if hasattr(graph, "graph") and hasattr(graph.graph, "nodes"):
        return Graph.from_fx(graph, elide_noops=elide_noops)
    raise TilingInputError(
        f"cannot tile a {type(graph).__name__}: give a Graph, a torch.fx GraphModule, "
        "a JSON dict or the path of a graph JSON file"
    )


def tile(
    graph: Any,
    library: LibrarySpec = "transformer",
    solver: str = "auto",
    *,
    elide_noops: bool = True,
    state_budget: int = AUTO_STATE_BUDGET,
    accept: Callable[[Tile], str | None] | None = None,
) -> Tiling:
    """Cover ``graph`` with ``library``'s patterns: most nodes covered, then fewest tiles
    (least cost). ``solver`` is ``"auto"`` (exact search, HiGHS ILP for a component whose
    search grows past ``state_budget`` states), ``"exact"``, ``"ilp"`` or ``"greedy"``
    (the non-optimal first-match baseline). ``accept(tile)`` returns None for a placement
    the caller can use, or the reason it cannot (a condition the pattern graph does not
    express: a constant weight, an operand's shape); refused placements are never chosen
    and are listed in :attr:`Tiling.refused`."""
    if solver not in SOLVERS:
        raise TilingInputError(f"unknown solver '{solver}'; use one of {', '.join(SOLVERS)}")
    g = as_graph(graph, elide_noops=elide_noops)
    lib = load_library(library)
    start = time.perf_counter()
    candidates, unused = _candidates(g, lib)
    refused: list[tuple[Tile, str]] = []
    if accept is not None:
        kept = []
        for c in candidates:
            reason = accept(_as_tile(c, g))
            if reason is None:
                kept.append(c)
            else:
                refused.append((_as_tile(c, g), reason))
        candidates = kept
    matched = time.perf_counter()
    costs = [c.pattern.cost or 1.0 for c in candidates] if lib.has_costs else None
    edges = [(p, v) for v in range(len(g)) for p in g.preds[v]]
    solution = solve(
        [c.mapping for c in candidates],
        costs,
        len(g),
        edges,
        method=solver,
        state_budget=state_budget,
    )
    solved = time.perf_counter()
    chosen = [candidates[k] for k in solution.chosen]
    tiles = [_as_tile(c, g) for c in _topological(chosen, g)]
    methods = "+".join(solution.methods) or ("exact" if solver == "auto" else solver)
    return Tiling(
        graph=g,
        library=lib,
        tiles=tiles,
        covered=solution.covered,
        cost=solution.cost,
        solver=methods,
        optimal=solution.optimal,
        states=solution.states,
        components=solution.components,
        cuts=solution.cuts,
        placements=len(candidates),
        match_ms=(matched - start) * 1e3,
        solve_ms=(solved - matched) * 1e3,
        unused_patterns=unused,
        refused=refused,
        not_chosen=_not_chosen(candidates, set(solution.chosen), g),
    )


def _as_tile(placement: Placement, graph: Graph) -> Tile:
    return Tile(placement.pattern.name, placement.as_dict(graph), placement.pattern.cost or 1.0)


def _not_chosen(
    candidates: list[Placement], chosen: set[int], graph: Graph
) -> list[tuple[Tile, str]]:
    """Each valid placement left out, with the chosen tiles it overlaps (the reason)."""
    owner: dict[int, int] = {v: k for k in chosen for v in candidates[k].mapping}
    out = []
    for k, c in enumerate(candidates):
        if k in chosen:
            continue
        shared: dict[int, list[str]] = {}
        for v in sorted(c.mapping):
            if v in owner:
                shared.setdefault(owner[v], []).append(graph.nodes[v].id)
        if shared:
            overlaps = " and ".join(
                f"{candidates[w].pattern.name} at {', '.join(ids)}" for w, ids in shared.items()
            )
            reason = f"overlaps the chosen {overlaps}"
        else:
            reason = "with the chosen tiles it would form a cycle (no order runs them all)"
        out.append((_as_tile(c, graph), reason))
    return out


def _candidates(graph: Graph, library: Library) -> tuple[list[Placement], dict[str, str]]:
    """Placements of every pattern, library order then graph order. Placements of
    different patterns on the same node set are interchangeable for the solver: the
    cheapest is kept (ties: the earlier pattern)."""
    best: dict[tuple[int, ...], Placement] = {}
    order: list[tuple[int, ...]] = []
    unused: dict[str, str] = {}
    for pattern in library:
        absent = [
            [op for op in dict.fromkeys(v.ops) if op not in graph.by_op] for v in pattern.variants()
        ]
        variants = [v for v, missing in zip(pattern.variants(), absent) if not missing]
        if not variants:  # the variant missing the fewest ops says what is missing
            unused[pattern.name] = f"no {', '.join(min(absent, key=len))} in the graph"
            continue
        found = [p for variant in variants for p in find_placements(graph, variant)]
        if not found:
            unused[pattern.name] = "no valid placement"
        for placement in found:
            key = placement.nodes
            kept = best.get(key)
            if kept is None:
                order.append(key)
                best[key] = placement
            elif (placement.pattern.cost or 1.0) < (kept.pattern.cost or 1.0):
                best[key] = placement
    return [best[key] for key in order], unused


def _topological(chosen: list[Placement], graph: Graph) -> list[Placement]:
    """Tiles in a topological order of the contracted graph, earliest first node first."""
    group = list(range(len(graph)))
    first = {}
    for k, c in enumerate(chosen):
        for v in c.mapping:
            group[v] = len(graph) + k
        first[len(graph) + k] = min(c.mapping)
    waiting: dict[int, int] = dict.fromkeys(group, 0)
    succ: dict[int, list[int]] = {}
    for v in range(len(graph)):
        for p in graph.preds[v]:
            if group[p] != group[v]:
                succ.setdefault(group[p], []).append(group[v])
                waiting[group[v]] += 1
    ready = [(first.get(g, g), g) for g, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, g = heapq.heappop(ready)
        if g >= len(graph):
            out.append(chosen[g - len(graph)])
        for h in succ.get(g, ()):
            waiting[h] -= 1
            if waiting[h] == 0:
                heapq.heappush(ready, (first.get(h, h), h))
    return out
