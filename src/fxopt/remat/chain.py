"""Plan a chain of training graphs together: DDP's pieces, or the blocks of ``compile_blocks``.

Graphs that run one after another in each step (forward 1..n, then backward n..1) share
the process's memory: while graph *j* runs, forward or backward, what graphs 1..j-1
saved for their backward is alive too. The process therefore peaks at

    max over j of ( saved_1 + ... + saved_{j-1} + peak_j )

and a process budget is met by choosing one plan per graph (what it saves, its own peak,
its recompute seconds) so that this maximum fits, at the least summed recompute time. A
graph planned alone, as it is compiled, cannot know what the graphs after it will need:
ResNet-50's last stage holds a parameter-sized convolution-backward scratchpad larger
than its activations (AVX2 oneDNN), so the pieces before it must save less to leave room
for it, which only a plan that sees every graph can arrange.

1. :func:`options`: per graph, the plans its planner walks from nothing recomputed down
   to its floor, one walk lowering what the graph saves (a stand-in for the later graphs
   at its forward/backward boundary, :func:`stand_in`) and one lowering its own peak,
   Pareto-pruned in (saved, peak, seconds).
2. :func:`choose`: a dynamic programme over the graphs in forward order whose states are
   (bytes saved so far, seconds so far), dominated states dropped; when no combination
   fits, the combination with the lowest process peak (:class:`Choice` says which).

Pure: tables in, indices out, no torch.fx.

    >>> from fxopt.remat.table import Table
    >>> chain = Table.build(
    ...     names=["x", "a", "b", "c", "gc", "gb", "ga", "out"],
    ...     phases=["input"] + ["forward"] * 3 + ["backward"] * 3 + ["output"],
    ...     args=[(), (0,), (1,), (2,), (3,), (2, 4), (1, 5), (6,)],
    ...     storages=[None, 10, 10, 10, 1, 1, 1, None],
    ... )
    >>> per_graph = [options(chain), options(chain)]
    >>> choice = choose(per_graph, 45)
    >>> choice.fits, choice.peak <= 45 < process_peak([o[0] for o in per_graph])
    (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fxopt.remat.planners import (
    every_n_sequence,
    greedy_sequence,
    near_peak_bytes,
    sqrt_n_sequence,
)
from fxopt.remat.simulate import Simulation, simulate
from fxopt.remat.table import Table

#: The most (saved, seconds) states the programme keeps per graph: beyond it, states are
#: merged on a grid of budget / MAX_STATES bytes (the cheapest of each cell survives).
#: 2,000 keeps a 20-graph chain under a second in pure Python.
MAX_STATES = 2000


@dataclass(frozen=True)
class Option:
    """One plan for one graph, as the chain sees it."""

    saved: int
    peak: int
    cost_s: float
    recompute: frozenset[int]


@dataclass(frozen=True)
class Choice:
    """One option index per graph; the process peak they reach; whether it fits."""

    picks: tuple[int, ...]
    peak: int
    cost_s: float
    fits: bool


def stand_in(table: Table, baseline: Simulation) -> Table:
    """``table`` with a temporary as large as its whole baseline peak on its first backward
    row: the boundary becomes the peak of every plan, so a planner that lowers the peak
    lowers what the graph saves (the later graphs of a chain run while it is saved)."""
    rows = list(table.rows)
    at = table.boundary
    if at >= len(rows) or baseline.peak <= 0:
        return table
    rows[at] = dataclasses.replace(rows[at], temp_bytes=rows[at].temp_bytes + baseline.peak)
    return Table(tuple(rows), table.storage_bytes, table.excluded)


def options(table: Table, planner: str = "greedy") -> list[Option]:
    """The plans ``planner`` walks for ``table``, nothing recomputed first, then the rest
    sorted by what they save; none dominated by another in (saved, peak, seconds).

    ``optimal`` walks greedy's plans here: one MILP per point of the frontier would cost
    minutes, and the chain's choice among them is already exact.
    """
    baseline = simulate(table)
    walk = {"every_n": every_n_sequence, "sqrt_n": sqrt_n_sequence}.get(planner, greedy_sequence)
    found: dict[frozenset[int], Option] = {}
    for planned in (stand_in(table, baseline), table):
        for chosen, _ in walk(planned):
            if chosen not in found:
                sim = simulate(table, chosen)
                found[chosen] = Option(sim.saved, sim.peak, sim.recompute_s, chosen)
    first = found.pop(frozenset())
    rest = sorted(found.values(), key=lambda o: (o.saved, o.peak, o.cost_s))
    kept = [
        o
        for o in rest
        if not any(
            p is not o and p.saved <= o.saved and p.peak <= o.peak and p.cost_s <= o.cost_s
            for p in (first, *rest)
        )
    ]
    return [first, *kept]


def process_peak(chosen: Sequence[Option]) -> int:
    """The process peak of one option per graph, the graphs in forward order."""
    peak = before = 0
    for option in chosen:
        peak = max(peak, before + option.peak)
        before += option.saved
    return peak


def choose(per_graph: Sequence[Sequence[Option]], budget: int) -> Choice:
    """The cheapest option per graph whose process peak fits ``budget``; if none fits, the
    combination with the lowest process peak (``fits`` False)."""
    picks = _cheapest(per_graph, budget)
    if picks is None:
        picks = _lowest_peak(per_graph, budget)
    chosen = [per_graph[j][k] for j, k in enumerate(picks)]
    peak = process_peak(chosen)
    return Choice(tuple(picks), peak, sum(o.cost_s for o in chosen), peak <= budget)


def _cheapest(per_graph: Sequence[Sequence[Option]], budget: int) -> tuple[int, ...] | None:
    states: list[tuple[int, float, tuple[int, ...]]] = [(0, 0.0, ())]
    cell = max(1, budget // MAX_STATES)
    for graph in per_graph:
        grown = [
            (saved + option.saved, cost + option.cost_s, (*picks, k))
            for saved, cost, picks in states
            for k, option in enumerate(graph)
            if saved + option.peak <= budget
        ]
        if not grown:
            return None
        grown.sort(key=lambda state: (state[0], state[1]))
        states, best_cost, last_cell = [], float("inf"), None
        for state in grown:
            if state[1] >= best_cost:
                continue  # saves more and costs no less than a state kept before it
            if len(grown) > MAX_STATES and state[0] // cell == last_cell:
                continue  # the grid: one state per cell, the cheapest (sorted first)
            states.append(state)
            best_cost, last_cell = state[1], state[0] // cell
    return min(states, key=lambda state: (state[1], state[0]))[2]


def _lowest_peak(per_graph: Sequence[Sequence[Option]], budget: int) -> tuple[int, ...]:
    """The feasible picks at the smallest budget above ``budget`` that has any: feasibility
    grows with the budget, so a bisection over bytes finds it."""
    low = budget
    lowest = [min(graph, key=lambda o: (o.peak, o.saved)) for graph in per_graph]
    high = process_peak(lowest)  # that combination fits there, so the search has an end
    best = _cheapest(per_graph, high)
    while high - low > max(1, near_peak_bytes(high)):
        middle = (low + high) // 2
        found = _cheapest(per_graph, middle)
        if found is None:
            low = middle
        else:
            high, best = middle, found
    assert best is not None
    return best
