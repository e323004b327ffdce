"""Every valid placement of a pattern in a graph: subgraph isomorphism on op types.

A placement maps each pattern node to a distinct graph node of the same op such that:

1. **Edges, by slot.** A pattern edge ``q → p`` at input slot ``i`` is a graph edge at slot
   ``i``. For a commutative graph node (``add``, ``mul``...) slots 0 and 1 may be swapped,
   but as a *multiset*: ``add(A, A)`` needs both slots to be ``A``'s image, so it does not
   match ``add(p, q)`` with ``p ≠ q``.
2. **Wildcards** bind to values from outside the tile; a named wildcard binds the same
   value everywhere it appears.
3. **Induced.** An edge between two covered nodes that the pattern lacks rejects the
   placement (the kernel would read a value it never computes).
4. **Outputs.** A covered value read outside the tile, or returned by the graph, must be
   a declared pattern output (the kernel must write it to memory).
5. **Convex.** No path leaves the tile and re-enters it (the tile could not run as one
   kernel: it would wait on its own result).

Search: pattern nodes are visited in BFS order from the node whose op is rarest in the
graph, so each later node has a matched neighbour and its candidates are
that neighbour's inputs at the right slot or its users, not the whole graph. Edge slots are
checked while searching (necessary conditions); the exact rules 1–5 run once per complete
mapping. Placements covering the same node set are kept once.

    >>> from fxopt.tiling import Graph, Pattern, match
    >>> g = Graph.from_json({"nodes": [
    ...     {"id": "m1", "op": "matmul", "inputs": ["x", "w1"]},
    ...     {"id": "r1", "op": "relu", "inputs": ["m1"]},
    ...     {"id": "m2", "op": "matmul", "inputs": ["r1", "w2"]},
    ...     {"id": "r2", "op": "relu", "inputs": ["m2"]}], "outputs": ["r2"]})
    >>> p = Pattern("mm_relu", [{"id": "a", "op": "matmul", "inputs": ["*", "*"]},
    ...                         {"id": "b", "op": "relu", "inputs": ["a"]}])
    >>> match(g, p)
    [{'a': 'm1', 'b': 'r1'}, {'a': 'm2', 'b': 'r2'}]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from fxopt.tiling.graph import COMMUTATIVE_SLOTS, Graph
from fxopt.tiling.pattern import WILDCARD, Pattern

__all__ = ["Placement", "find_placements", "match"]

# A graph input slot's value: a node position (int), an external input id (str), a constant.
Value = int | str | None


@dataclass(frozen=True)
class Placement:
    """One placement: ``mapping[k]`` is the graph position of the pattern's ``k``-th node."""

    pattern: Pattern
    mapping: tuple[int, ...]

    @property
    def nodes(self) -> tuple[int, ...]:
        """The covered graph positions, ascending."""
        return tuple(sorted(self.mapping))

    def as_dict(self, graph: Graph) -> dict[str, str]:
        """Pattern node id → graph node id."""
        return {n.id: graph.nodes[g].id for n, g in zip(self.pattern.nodes, self.mapping)}


def match(graph: Graph, pattern: Pattern) -> list[dict[str, str]]:
    """Every valid placement of ``pattern`` in ``graph`` (pattern id → graph id), one per
    covered node set, ordered by the covered nodes' topological positions."""
    return [p.as_dict(graph) for p in find_placements(graph, pattern)]


def find_placements(graph: Graph, pattern: Pattern) -> list[Placement]:
    """Like :func:`match`, as :class:`Placement` objects of graph positions (of every
    variant of ``pattern``: :meth:`Pattern.variants`; each placement's ``pattern`` is the
    variant it matches, under the pattern's name)."""
    found = [p for variant in pattern.variants() for p in _Matcher(graph, variant).run()]
    return sorted(found, key=lambda p: p.nodes) if len(pattern.variants()) > 1 else found


@dataclass(frozen=True)
class _Step:
    """Pattern node ``node`` and its edges to nodes matched before it."""

    node: int
    # (earlier pattern node q, slots of q that read this node)
    input_of: tuple[tuple[int, tuple[int, ...]], ...]
    # (earlier pattern node r, slots of this node that read r)
    reads: tuple[tuple[int, tuple[int, ...]], ...]


class _Matcher:
    def __init__(self, graph: Graph, pattern: Pattern):
        self.graph = graph
        self.pattern = pattern
        # Pattern inputs as pattern-node indices (int), wildcard names (str) or None.
        self.pvalues: list[tuple[int | str | None, ...]] = [
            tuple(pattern.index.get(v, v) if v is not None else None for v in n.inputs)
            for n in pattern.nodes
        ]
        self.outputs = {pattern.index[o] for o in pattern.outputs}
        self.steps = self._plan()

    def _plan(self) -> list[_Step]:
        """BFS order from the rarest op; each step lists its edges to earlier steps."""
        order = self._bfs_order()
        rank = {p: k for k, p in enumerate(order)}
        return [self._step(p, rank) for p in order]

    def _bfs_order(self) -> list[int]:
        """Pattern nodes in BFS order over pattern edges (either direction), each BFS
        rooted at the unplaced node whose op is rarest in the graph."""
        pattern, counts = self.pattern, self.graph.by_op
        n = len(pattern.nodes)
        neighbours: list[list[int]] = [[] for _ in range(n)]
        for p, values in enumerate(self.pvalues):
            for v in values:
                if isinstance(v, int):
                    neighbours[p].append(v)
                    neighbours[v].append(p)
        order: list[int] = []
        placed = [False] * n
        while len(order) < n:
            # A new BFS root: the rarest op among unplaced nodes (ties: listing order).
            root = min(
                (p for p in range(n) if not placed[p]),
                key=lambda p: len(counts.get(pattern.nodes[p].op, ())),
            )
            placed[root] = True
            queue = [root]
            while queue:
                p = queue.pop(0)
                order.append(p)
                for q in sorted(set(neighbours[p])):
                    if not placed[q]:
                        placed[q] = True
                        queue.append(q)
        return order

    def _step(self, p: int, rank: dict[int, int]) -> _Step:
        """Pattern node ``p`` with its edges to the nodes ranked before it."""
        input_of = []
        for q in range(len(self.pattern.nodes)):
            slots = tuple(i for i, v in enumerate(self.pvalues[q]) if v == p)
            if slots and rank[q] < rank[p]:
                input_of.append((q, slots))
        reads = []
        for r in dict.fromkeys(v for v in self.pvalues[p] if isinstance(v, int)):
            if rank[r] < rank[p]:
                slots = tuple(i for i, v in enumerate(self.pvalues[p]) if v == r)
                reads.append((r, slots))
        return _Step(p, tuple(input_of), tuple(reads))

    # ------------------------------------------------------------------ search

    def run(self) -> list[Placement]:
        found: dict[tuple[int, ...], tuple[int, ...]] = {}
        if any(n.op not in self.graph.by_op for n in self.pattern.nodes):
            return []
        mapping = [-1] * len(self.pattern.nodes)
        used: set[int] = set()
        iterators: list[Iterator[int]] = [iter(self._candidates(0, mapping))]
        while iterators:
            depth = len(iterators) - 1
            step = self.steps[depth]
            if mapping[step.node] >= 0:  # backtrack out of the previous candidate
                used.discard(mapping[step.node])
                mapping[step.node] = -1
            candidate = next(iterators[-1], None)
            if candidate is None:
                iterators.pop()
                continue
            mapping[step.node] = candidate
            used.add(candidate)
            if depth + 1 < len(self.steps):
                iterators.append(iter(self._candidates(depth + 1, mapping, used)))
            else:
                key = tuple(sorted(mapping))
                if key not in found and self._valid(mapping):
                    found[key] = tuple(mapping)
        return [Placement(self.pattern, found[key]) for key in sorted(found)]

    def _candidates(self, depth: int, mapping: list[int], used: set[int] = frozenset()):
        """Graph nodes for step ``depth`` consistent with the edges to earlier steps."""
        step = self.steps[depth]
        op = self.pattern.nodes[step.node].op
        values, graph = self.graph.slots, self.graph
        if step.input_of:
            q, slots = step.input_of[0]
            g = mapping[q]
            pool = [values[g][s] for s in _slots_to_look(graph, g, slots, len(values[g]))]
            pool = sorted({v for v in pool if isinstance(v, int)})
        elif step.reads:
            pool = list(graph.users[mapping[step.reads[0][0]]])
        else:
            pool = self.graph.by_op.get(op, [])
        out = []
        for c in pool:
            if c in used or graph.nodes[c].op != op:
                continue
            if all(self._feeds(c, mapping[q], slots) for q, slots in step.input_of) and all(
                self._feeds(mapping[r], c, slots) for r, slots in step.reads
            ):
                out.append(c)
        return out

    def _feeds(self, source: int, reader: int, slots: tuple[int, ...]) -> bool:
        """Can ``source`` be at every one of ``slots`` of ``reader`` (slots may swap)?"""
        row = self.graph.slots[reader]
        looked = _slots_to_look(self.graph, reader, slots, len(row))
        return all(s < len(row) for s in slots) and any(row[s] == source for s in looked)

    # ------------------------------------------------------------------ exact checks

    def _valid(self, mapping: list[int]) -> bool:
        tile = set(mapping)
        return (
            self._slots_match(mapping, tile)
            and self._induced(mapping, tile)
            and self._outputs_declared(mapping, tile)
            and self._convex(tile)
        )

    def _slots_match(self, mapping: list[int], tile: set[int]) -> bool:
        """Rules 1–2: every pattern slot matches under one choice of swaps, with named
        wildcards bound consistently across the whole pattern."""
        bound_nodes, free_nodes = [], []
        for p, pv in enumerate(self.pvalues):
            named = any(isinstance(v, str) and v != WILDCARD for v in pv)
            (bound_nodes if named else free_nodes).append(p)
        for p in free_nodes:
            if not any(
                self._node_matches(p, mapping, tile, perm, {}) for perm in self._perms(p, mapping)
            ):
                return False
        # Named wildcards couple nodes: try each combination of swaps (2 per commutative
        # node; patterns have a handful).
        choices = [self._perms(p, mapping) for p in bound_nodes]
        for combo in itertools.product(*choices):
            binding: dict[str, Value] = {}
            if all(
                self._node_matches(p, mapping, tile, perm, binding)
                for p, perm in zip(bound_nodes, combo)
            ):
                return True
        return False

    def _perms(self, p: int, mapping: list[int]) -> list[bool]:
        """False: slots as listed; True: slots 0 and 1 swapped (commutative graph node)."""
        g = mapping[p]
        if self.graph.nodes[g].commutative and len(self.graph.slots[g]) >= 2:
            return [False, True]
        return [False]

    def _node_matches(
        self, p: int, mapping: list[int], tile: set[int], swap: bool, binding: dict
    ) -> bool:
        row = self.graph.slots[mapping[p]]
        for i, want in enumerate(self.pvalues[p]):
            if want is None:
                continue
            j = (1 - i) if swap and i in COMMUTATIVE_SLOTS else i
            if j >= len(row):
                return False
            have = row[j]
            if isinstance(want, int):
                if have != mapping[want]:
                    return False
            elif have is None or have in tile:
                return False  # a wildcard binds to a value from outside the tile
            elif want != WILDCARD and binding.setdefault(want, have) != have:
                return False  # a named wildcard already bound to another value
        return True

    def _induced(self, mapping: list[int], tile: set[int]) -> bool:
        """Rule 3: a covered node reads covered values exactly as often as its pattern
        node reads pattern nodes (slot matching already paired each pattern edge with one
        graph slot, so any surplus is an edge the pattern lacks)."""
        for p, g in enumerate(mapping):
            internal = sum(1 for v in self.graph.slots[g] if isinstance(v, int) and v in tile)
            if internal != sum(1 for v in self.pvalues[p] if isinstance(v, int)):
                return False
        return True

    def _outputs_declared(self, mapping: list[int], tile: set[int]) -> bool:
        """Rule 4: a value that leaves the tile (or the graph) is a pattern output."""
        graph = self.graph
        for p, g in enumerate(mapping):
            if p in self.outputs:
                continue
            if g in graph.output_positions or any(u not in tile for u in graph.users[g]):
                return False
        return True

    def _convex(self, tile: set[int]) -> bool:
        """Rule 5: walk forward from the tile's outside readers; reaching the tile again
        means a path leaves and re-enters it. Nodes after the tile's last node cannot lead
        back (edges go forward in topological order), so the walk stays local."""
        users, last = self.graph.users, max(tile)
        frontier = [u for g in sorted(tile) for u in users[g] if u not in tile and u < last]
        seen = set(frontier)
        while frontier:
            v = frontier.pop()
            for u in users[v]:
                if u in tile:
                    return False
                if u < last and u not in seen:
                    seen.add(u)
                    frontier.append(u)
        return True


def _slots_to_look(graph: Graph, reader: int, slots: tuple[int, ...], width: int) -> list[int]:
    """The reader's slots where a value at pattern ``slots`` may sit (swaps included)."""
    looked = [s for s in slots if s < width]
    if graph.nodes[reader].commutative:
        for s in slots:
            if s in COMMUTATIVE_SLOTS and (1 - s) < width and (1 - s) not in looked:
                looked.append(1 - s)
    return looked
