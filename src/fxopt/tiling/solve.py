"""Choose placements: maximize covered nodes, then minimize total cost (tile count).

The problem is weighted set packing (NP-hard), plus one global constraint: the chosen
tiles must be **schedulable**, i.e. the graph with every tile contracted to one node stays
acyclic. Two tiles that are each convex can still need each other's results
(``a1 → b2`` and ``b1 → a2`` with ``A = {a1, a2}``, ``B = {b1, b2}``).

Pipeline:

1. **Components.** Tiles that share a node are linked; linked tiles form a component, and
   components are solved independently (a 96-block model is ~96 small problems, not one
   large one). Nodes no tile covers are uncovered and take no part.
2. **Exact solver** (``"exact"``), per component: dynamic programming over the set of
   decided nodes, always branching on the lowest undecided node ``n`` in topological
   order: either a tile whose first node is ``n`` (largest first) or "leave ``n``
   uncovered". Every state's value is exact and memoized; a child is skipped only when an
   optimistic bound (every free node covered, at the cheapest cost share ``cost/size`` of
   any tile containing it) proves it cannot beat the best option found. Stopping at the
   first full coverage instead would lose the tile-count optimum: a chain
   ``a→b→c→d→e`` with tiles ``abc, ab, cde, cd`` and singles is covered by ``abc + d + e``
   first (3 tiles), while ``ab + cde`` needs 2. Explicit stack, no recursion.
3. **ILP** (``"ilp"``) on HiGHS: binary ``x_t`` per tile, ``Σ_{t∋v} x_t ≤ 1`` per node;
   first ``max Σ |t| x_t``, then with coverage fixed at its optimum, ``min Σ cost_t x_t``.
   ``"auto"`` (the default) runs the exact solver with a state budget per component and
   hands a component that exceeds it to the ILP.
4. **Schedulability, lazily.** The solution's contracted graph is checked (Kahn's
   algorithm). A cycle through tiles ``T1..Tk`` makes every solution that contains all of
   them cyclic (the graph paths between them do not depend on other choices), so
   "not all of ``T1..Tk``" is a valid cut; the affected components are merged and re-solved
   with the cut, until the contracted graph is acyclic. The result is optimal among
   schedulable tilings: each round's optimum is an upper bound for schedulable ones.

Ties (same coverage and cost) go to the first solution found in a fixed order: lower
topological positions are decided first, larger tiles and earlier library patterns tried
first. Nothing depends on hash or set order.

    >>> solve([{0, 1, 2}, {0, 1}, {2, 3, 4}, {2, 3}] + [{i} for i in range(5)],
    ...       costs=None, num_nodes=5, edges=[(0, 1), (1, 2), (2, 3), (3, 4)]).chosen
    [1, 2]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SOLVERS", "Solution", "greedy", "solve"]

SOLVERS = ("auto", "exact", "ilp", "greedy")
#: States the exact solver may explore per component under ``"auto"`` before the component
#: goes to the ILP. A transformer block with the built-in library needs a few hundred.
AUTO_STATE_BUDGET = 200_000


@dataclass
class Solution:
    """Chosen tile indices (into the candidate list), ascending, and how they were found."""

    chosen: list[int]
    covered: int
    cost: float
    states: int = 0
    components: int = 0
    #: Components solved by each method, e.g. {"exact": 95, "ilp": 1}.
    methods: dict[str, int] = field(default_factory=dict)
    #: Cycle cuts added to make the tiles schedulable.
    cuts: int = 0
    #: True when optimality is proved (exact search or ILP optimum); False for greedy.
    optimal: bool = True


#: A component's result: the tiles chosen, the method that chose them, states explored.
_Result = tuple[list[int], str, int]


def solve(
    tiles: Sequence[set[int] | Sequence[int]],
    costs: Sequence[float] | None,
    num_nodes: int,
    edges: Sequence[tuple[int, int]],
    *,
    method: str = "auto",
    state_budget: int = AUTO_STATE_BUDGET,
) -> Solution:
    """Optimal schedulable packing of ``tiles`` (node sets) in a DAG of ``num_nodes`` nodes.

    ``costs`` default to 1 per tile (then cost is the tile count); ``edges`` are the
    graph's (source, target) pairs, used for the schedulability check.
    """
    if method not in SOLVERS:
        raise ValueError(f"unknown solver '{method}'; use one of {', '.join(SOLVERS)}")
    sets = [tuple(sorted(set(t))) for t in tiles]
    unit = costs is None
    cost = [1] * len(sets) if unit else [float(c) for c in costs]
    if method == "greedy":
        return greedy(sets, cost, num_nodes, edges)
    members = _components(sets, num_nodes)
    cuts: list[tuple[int, ...]] = []
    results: dict[int, _Result] = {}
    todo = list(range(len(members)))
    while True:
        results.update(
            _solve_components(todo, members, sets, cost, cuts, method, state_budget, unit)
        )
        chosen = sorted(t for c in results for t in results[c][0])
        cycles = _cycles(chosen, sets, num_nodes, edges)
        if not cycles:
            return _solution(chosen, sets, cost, results, len(cuts))
        todo = _cut_cycles(cycles, cuts, members, results)


def _solve_components(
    todo: list[int],
    members: list[list[int]],
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    cuts: list[tuple[int, ...]],
    method: str,
    budget: int,
    unit: bool,
) -> dict[int, _Result]:
    """The result of each component in ``todo``, under the cuts among its tiles."""
    if method == "ilp":
        # One HiGHS model for every component to (re)solve: a model per component costs
        # more in setup than in solving (96 transformer blocks: 7.7 s as 674 models).
        union = sorted(t for c in todo for t in members[c])
        inside = set(union)
        picked = set(_ilp(union, sets, cost, [cut for cut in cuts if cut[0] in inside]))
        return {c: ([t for t in members[c] if t in picked], "ilp", 0) for c in todo}
    results = {}
    for c in todo:
        inside = set(members[c])
        local_cuts = [cut for cut in cuts if cut[0] in inside]
        results[c] = _solve_component(members[c], sets, cost, local_cuts, method, budget, unit)
    return results


def _cut_cycles(
    cycles: list[list[int]],
    cuts: list[tuple[int, ...]],
    members: list[list[int]],
    results: dict[int, _Result],
) -> list[int]:
    """Add a cut per cycle; each cut couples its tiles' components, so merge them (into
    ``members``, dropping the merged-away ``results``). Returns the components to re-solve."""
    owner = {t: c for c in results for t in members[c]}
    touched: set[int] = set()
    for cycle in cycles:
        cuts.append(tuple(sorted(cycle)))
        involved = sorted({owner[t] for t in cycle})
        keep = involved[0]
        for c in involved[1:]:
            for t in members[c]:
                owner[t] = keep
            members[keep].extend(members[c])
            members[c] = []
            results.pop(c)
            touched.discard(c)
        members[keep].sort()
        touched.add(keep)
    return sorted(touched)


def _solution(
    chosen: list[int],
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    results: dict[int, _Result],
    cuts: int,
) -> Solution:
    solution = Solution(
        chosen,
        sum(len(sets[t]) for t in chosen),
        sum(cost[t] for t in chosen),
        components=len(results),
        cuts=cuts,
    )
    for _, used, states in results.values():
        solution.methods[used] = solution.methods.get(used, 0) + 1
        solution.states += states
    return solution


def _components(sets: Sequence[tuple[int, ...]], num_nodes: int) -> list[list[int]]:
    """Tiles grouped by shared nodes (union-find), each group ascending, groups ordered by
    their first tile."""
    parent = list(range(len(sets)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_tile = [-1] * num_nodes
    for t, nodes in enumerate(sets):
        for v in nodes:
            if first_tile[v] < 0:
                first_tile[v] = t
            else:
                a, b = find(first_tile[v]), find(t)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for t in range(len(sets)):
        groups.setdefault(find(t), []).append(t)
    return list(groups.values())


def _solve_component(
    tiles: list[int],
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    cuts: list[tuple[int, ...]],
    method: str,
    budget: int,
    unit: bool,
) -> _Result:
    if method in ("exact", "auto"):
        found = _exact(tiles, sets, cost, cuts, budget if method == "auto" else None, unit)
        if found is not None:
            return found[0], "exact", found[1]
    return _ilp(tiles, sets, cost, cuts), "ilp", 0


# --------------------------------------------------------------------------- exact


def _exact(
    tiles: list[int],
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    cuts: list[tuple[int, ...]],
    budget: int | None,
    unit: bool,
) -> tuple[list[int], int] | None:
    """Memoized DP over decided-node masks (see the module docstring); None past budget."""
    search = _ExactSearch(tiles, sets, cost, cuts, unit)
    memo = search.explore(budget)
    if memo is None:
        return None
    return search.follow(memo), len(memo)


#: A search state: (mask of the decided nodes, mask of the chosen cut tiles).
_State = tuple[int, int]
#: A state's value: (covered, cost, option taken there): the option is a tile index into
#: ``tiles``, -1 for "leave the node uncovered", None at the end.
_Value = tuple[int, float, int | None]
#: An option at a state: (tile index or -1, the state it leads to, (coverage, cost) it adds).
_Option = tuple[int, _State, tuple[int, float]]
_ROOT: _State = (0, 0)
_DONE: _Value = (0, 0, None)  # the value of any state with every node decided


class _ExactSearch:
    """The exact solver on one component. Its nodes are numbered in topological order and
    each tile (``k``, an index into ``tiles``) is a bit mask over them."""

    def __init__(
        self,
        tiles: list[int],
        sets: Sequence[tuple[int, ...]],
        cost: Sequence[float],
        cuts: list[tuple[int, ...]],
        unit: bool,
    ):
        nodes = sorted({v for t in tiles for v in sets[t]})
        local = {v: i for i, v in enumerate(nodes)}
        self.tiles = tiles
        self.unit = unit
        self.size = len(nodes)
        self.full = (1 << self.size) - 1
        self.masks = [sum(1 << local[v] for v in sets[t]) for t in tiles]
        self.lengths = [len(sets[t]) for t in tiles]
        self.costs = [cost[t] for t in tiles]
        self.starts = self._options_by_first_node(sets, local)
        self.share, self.suffix = self._cover_shares(sets, local)
        self.cut_bit, self.cuts_of = self._cut_bits(cuts)

    def _options_by_first_node(
        self, sets: Sequence[tuple[int, ...]], local: dict[int, int]
    ) -> list[list[int]]:
        """Branching options at node i: tiles whose first node is i, largest and cheapest
        first, then by position in ``tiles`` (library order, then graph order)."""
        starts: list[list[int]] = [[] for _ in range(self.size)]
        for k, t in enumerate(self.tiles):
            starts[local[sets[t][0]]].append(k)
        for options in starts:
            options.sort(key=lambda k: (-self.lengths[k], self.costs[k], k))
        return starts

    def _cover_shares(
        self, sets: Sequence[tuple[int, ...]], local: dict[int, int]
    ) -> tuple[list[float], list[float]]:
        """Per node, the cheapest cost share of covering it (cost/size of the best tile
        containing it); and ``suffix[i]``, the sum of the shares from node i on."""
        share = [math.inf] * self.size
        for k, t in enumerate(self.tiles):
            for v in sets[t]:
                share[local[v]] = min(share[local[v]], self.costs[k] / self.lengths[k])
        suffix = [0.0] * (self.size + 1)
        for i in range(self.size - 1, -1, -1):
            suffix[i] = suffix[i + 1] + share[i]
        return share, suffix

    def _cut_bits(self, cuts: list[tuple[int, ...]]) -> tuple[dict[int, int], dict[int, list[int]]]:
        """Cycle cuts: a tile in a cut gets a bit, and the cut masks it belongs to. Choosing
        the last missing tile of a cut is forbidden, so the chosen cut tiles are part of
        the state."""
        position = {t: k for k, t in enumerate(self.tiles)}
        cut_tiles = sorted({position[t] for cut in cuts for t in cut})
        cut_bit = {k: 1 << i for i, k in enumerate(cut_tiles)}
        cut_masks = [sum(cut_bit[position[t]] for t in cut) for cut in cuts]
        cuts_of = {k: [m for m in cut_masks if m & cut_bit[k]] for k in cut_tiles}
        return cut_bit, cuts_of

    def allowed(self, k: int, chosen: int) -> bool:
        """Whether adding tile ``k`` to the ``chosen`` cut tiles completes no cut."""
        if k not in self.cut_bit:
            return True
        after = chosen | self.cut_bit[k]
        return all(after & m != m for m in self.cuts_of[k])

    def bound(self, mask: int, first_free: int) -> tuple[int, float]:
        """Optimistic (coverage, cost) of the free nodes: all covered, each at its share."""
        free_cov = self.size - mask.bit_count()
        lower = self.suffix[first_free]
        beyond = mask >> first_free << first_free
        while beyond:
            low = beyond & -beyond
            lower -= self.share[low.bit_length() - 1]
            beyond ^= low
        # Integer costs: the total is an integer. Float costs: leave room for rounding in
        # the sums, so that the bound stays below every achievable cost.
        lower = math.ceil(lower - 1e-9) if self.unit else lower - 1e-9 * max(1.0, lower)
        return free_cov, lower

    def options(self, state: _State) -> tuple[int, list[_Option]]:
        """The lowest undecided node of ``state`` and the options that decide it: the tiles
        that may cover it (fitting the free nodes, cutting no cycle), then -1 (leave it
        uncovered)."""
        mask, chosen = state
        first = (~mask & (mask + 1)).bit_length() - 1  # the lowest zero bit
        masks, cut_bit, lengths, costs = self.masks, self.cut_bit, self.lengths, self.costs
        options = [
            (k, (mask | masks[k], chosen | cut_bit.get(k, 0)), (lengths[k], costs[k]))
            for k in self.starts[first]
            if not masks[k] & mask and self.allowed(k, chosen)
        ]
        options.append((-1, (mask | (1 << first), chosen), (0, 0)))
        return first, options

    def explore(self, budget: int | None) -> dict[_State, _Value] | None:
        """The value of every state explored from the root, depth first on an explicit
        stack (no recursion); None once more than ``budget`` states are memoized."""
        memo: dict[_State, _Value] = {}
        # frame: state, first free node, options, next option, best value, pending option
        # (a list, not an object: one is made per state, and this loop is the hot spot)
        stack: list[list] = [[_ROOT, *self.options(_ROOT), 0, None, None]] if self.size else []
        full, bound = self.full, self.bound
        while stack:
            frame = stack[-1]
            state, first, options, i, best, pending = frame
            if pending is not None:  # the child explored last has its value now
                option, child, gain = pending
                value = memo[child]
                candidate = (value[0] + gain[0], value[1] + gain[1])
                if _better(candidate, best):
                    best = (candidate[0], candidate[1], option)
                pending = None
            # Take the options in order until one leads to a state with no value yet.
            while i < len(options):
                option, child, gain = options[i]
                i += 1
                if best is not None:
                    cov, low_cost = bound(child[0], first + 1)
                    if not _better((cov + gain[0], low_cost + gain[1]), best[:2]):
                        continue  # cannot beat the best option: skip without exploring
                value = _DONE if child[0] == full else memo.get(child)
                if value is None:
                    pending = options[i - 1]
                    break
                candidate = (value[0] + gain[0], value[1] + gain[1])
                if _better(candidate, best):
                    best = (candidate[0], candidate[1], option)
            frame[3], frame[4], frame[5] = i, best, pending
            if pending is None:  # every option taken: the value is final
                memo[state] = best
                stack.pop()
            elif budget is not None and len(memo) > budget:
                return None
            else:
                stack.append([pending[1], *self.options(pending[1]), 0, None, None])
        return memo

    def follow(self, memo: dict[_State, _Value]) -> list[int]:
        """The tiles chosen along the recorded best options from the root, ascending."""
        chosen_tiles: list[int] = []
        state = _ROOT
        while state[0] != self.full:
            option = memo[state][2]
            if option is None:
                break
            if option >= 0:
                chosen_tiles.append(self.tiles[option])
            state = next(child for k, child, _ in self.options(state)[1] if k == option)
        return sorted(chosen_tiles)


def _better(a: tuple[int, float], b: tuple[int, float] | None) -> bool:
    """More coverage, or as much at a lower cost."""
    return b is None or a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])


# --------------------------------------------------------------------------- ILP


def _ilp(
    tiles: list[int],
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    cuts: list[tuple[int, ...]],
) -> list[int]:
    """Two-phase 0-1 ILP on HiGHS: max coverage, then min cost at that coverage."""
    import highspy
    import numpy as np

    if not tiles:
        return []
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # HiGHS stops at a 0.01% relative gap by default: demand the optimum.
    h.setOptionValue("mip_rel_gap", 0.0)
    h.setOptionValue("mip_abs_gap", 0.0)
    # No "threads" option: HiGHS has one thread pool per process, and a solver asking for
    # another size than it was made with (e.g. by remat's MILP) fails without solving.
    count = len(tiles)
    inf = highspy.kHighsInf
    sizes = np.array([len(sets[t]) for t in tiles], dtype=np.float64)
    h.addCols(
        count,
        sizes,
        np.zeros(count),
        np.ones(count),
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0),
    )
    h.changeColsIntegrality(
        count,
        np.arange(count, dtype=np.int32),
        np.array([highspy.HighsVarType.kInteger] * count),
    )
    by_node: dict[int, list[int]] = {}
    for k, t in enumerate(tiles):
        for v in sets[t]:
            by_node.setdefault(v, []).append(k)
    rows = [cols for _, cols in sorted(by_node.items()) if len(cols) > 1]
    uppers = [1.0] * len(rows)
    position = {t: k for k, t in enumerate(tiles)}
    for cut in cuts:
        rows.append([position[t] for t in cut])
        uppers.append(len(cut) - 1.0)
    if rows:
        starts = np.cumsum([0] + [len(r) for r in rows[:-1]]).astype(np.int32)
        index = np.array([c for r in rows for c in r], dtype=np.int32)
        h.addRows(
            len(rows),
            np.full(len(rows), -inf),
            np.array(uppers),
            len(index),
            starts,
            index,
            np.ones(len(index)),
        )
    h.changeObjectiveSense(highspy.ObjSense.kMaximize)
    coverage = _run(h, count)
    best = round(float(sizes @ coverage))
    # Phase 2: keep the optimal coverage, minimize cost.
    h.addRow(best - 0.5, inf, count, np.arange(count, dtype=np.int32), sizes)
    h.changeColsCost(count, np.arange(count, dtype=np.int32), np.array([cost[t] for t in tiles]))
    h.changeObjectiveSense(highspy.ObjSense.kMinimize)
    values = _run(h, count)
    return sorted(tiles[k] for k in range(count) if values[k] > 0.5)


def _run(h, count: int):
    import highspy
    import numpy as np

    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(f"HiGHS did not reach an optimum: {h.modelStatusToString(status)}")
    return np.array(h.getSolution().col_value[:count])


# --------------------------------------------------------------------------- schedulability


def _cycles(
    chosen: Sequence[int],
    sets: Sequence[tuple[int, ...]],
    num_nodes: int,
    edges: Sequence[tuple[int, int]],
) -> list[list[int]]:
    """Chosen tiles on cycles of the contracted graph (empty if it is acyclic): one cycle,
    then its groups removed and the rest searched again, so one round cuts many cycles."""
    group = list(range(num_nodes))  # singleton groups are numbered by node, tiles after
    tile_of_group: dict[int, int] = {}
    for k, t in enumerate(chosen):
        for v in sets[t]:
            group[v] = num_nodes + k
        tile_of_group[num_nodes + k] = t
    succ: dict[int, list[int]] = {}
    for a, b in edges:
        if group[a] != group[b]:
            succ.setdefault(group[a], []).append(group[b])
    alive = set(group)
    found: list[list[int]] = []
    while True:
        _drop_groups_on_no_cycle(alive, succ)
        if not alive:
            return found
        cycle = _one_cycle(alive, succ)
        found.append(sorted(tile_of_group[x] for x in cycle if x in tile_of_group))
        alive.difference_update(cycle)


def _drop_groups_on_no_cycle(alive: set[int], succ: dict[int, list[int]]) -> None:
    """Kahn's algorithm on the ``alive`` groups: removes every group that is on no cycle."""
    indegree = dict.fromkeys(sorted(alive), 0)
    for g in indegree:
        for h in succ.get(g, ()):
            if h in indegree:
                indegree[h] += 1
    ready = [g for g, d in indegree.items() if d == 0]
    while ready:
        g = ready.pop()
        alive.discard(g)
        for h in succ.get(g, ()):
            if h in alive:
                indegree[h] -= 1
                if indegree[h] == 0:
                    ready.append(h)


def _one_cycle(alive: set[int], succ: dict[int, list[int]]) -> list[int]:
    """Groups along one cycle, when every ``alive`` group has an alive predecessor: walk
    predecessors until one repeats."""
    pred: dict[int, int] = {}
    for a in sorted(alive):
        for b in succ.get(a, ()):
            if b in alive and b not in pred:
                pred[b] = a
    walk: dict[int, int] = {}
    g = min(alive)
    while g not in walk:
        walk[g] = len(walk)
        g = pred[g]
    return [x for x, k in walk.items() if k >= walk[g]]


# --------------------------------------------------------------------------- greedy


def greedy(
    sets: Sequence[tuple[int, ...]],
    cost: Sequence[float],
    num_nodes: int,
    edges: Sequence[tuple[int, int]],
) -> Solution:
    """The baseline: take tiles in the order given (library order, then graph order), each
    one that overlaps none taken before, as ``torch.fx`` ``replace_pattern`` does when
    called once per pattern; if the tiles form a cycle, ban the latest tile on it and
    start over. Not optimal."""
    banned: set[int] = set()
    while True:
        taken = [False] * num_nodes
        chosen: list[int] = []
        for t, nodes in enumerate(sets):
            if t not in banned and not any(taken[v] for v in nodes):
                chosen.append(t)
                for v in nodes:
                    taken[v] = True
        cycles = _cycles(chosen, sets, num_nodes, edges)
        if not cycles:
            break
        banned.add(max(cycles[0]))  # a rewriter would meet it last; start over without it
    chosen.sort()
    return Solution(
        chosen,
        sum(len(sets[t]) for t in chosen),
        sum(cost[t] for t in chosen),
        components=0,
        methods={"greedy": 1},
        optimal=False,
    )
