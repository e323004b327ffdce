"""fxopt.remat.chain: one plan per graph of a chain (DDP's pieces, compile_blocks' blocks),
chosen together against the process peak."""

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.remat.chain import Option, choose, options, process_peak
from fxopt.remat.planners import greedy_sequence
from fxopt.remat.simulate import simulate
from fxopt.remat.table import Table

_option = st.builds(
    lambda saved, extra, cost: Option(saved, saved + extra, cost, frozenset()),
    st.integers(0, 300),
    st.integers(0, 300),
    st.integers(0, 50).map(float),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(_option, min_size=1, max_size=4), min_size=1, max_size=4), st.data())
def test_choose_is_the_cheapest_combination_that_fits_or_the_lowest_peak(per_graph, data):
    everything = list(itertools.product(*per_graph))
    budget = data.draw(st.integers(0, max(process_peak(c) for c in everything)))
    choice = choose(per_graph, budget)
    chosen = [per_graph[j][k] for j, k in enumerate(choice.picks)]
    assert choice.peak == process_peak(chosen)
    fitting = [c for c in everything if process_peak(c) <= budget]
    if fitting:
        assert choice.fits
        assert choice.cost_s == min(sum(o.cost_s for o in c) for c in fitting)
    else:
        assert not choice.fits
        assert choice.peak == min(process_peak(c) for c in everything)


def test_a_graph_with_a_high_floor_later_makes_the_earlier_graphs_save_less():
    """What a chain planned graph by graph cannot do: the last graph's own peak is a floor
    (a large backward workspace), so the first must give up what it saves."""
    cheap_saver = [Option(100, 120, 0.0, frozenset()), Option(20, 60, 1.0, frozenset({1}))]
    floored = [Option(10, 200, 0.0, frozenset())]
    # Alone, the first graph would keep its baseline (its own peak 120 fits half of the
    # process baseline 300); together, 100 saved + 200 is over 250.
    choice = choose([cheap_saver, floored], 250)
    assert choice.picks == (1, 0) and choice.fits and choice.peak == 220


def _chain_table(length: int, size: int, workspace: int = 0) -> Table:
    """x → a0 → ... → a{n-1}, then their gradients; the first gradient holds a workspace."""
    names = ["x", *(f"a{i}" for i in range(length)), *(f"g{i}" for i in range(length)), "out"]
    phases = ["input"] + ["forward"] * length + ["backward"] * length + ["output"]
    args = [()] + [(i,) for i in range(length)]
    for j in range(length):
        args.append((length - j, length + j) if j else (length,))
    args.append((2 * length,))
    table = Table.build(names, phases, args, [None] + [size] * length + [1] * length + [None])
    rows = list(table.rows)
    rows[length + 1] = dataclasses.replace(rows[length + 1], temp_bytes=workspace)
    return Table(tuple(rows), table.storage_bytes, table.excluded)


def test_options_start_with_the_baseline_and_reach_the_planners_floor():
    table = _chain_table(8, 100)
    found = options(table)
    baseline = simulate(table)
    assert (found[0].saved, found[0].peak, found[0].recompute) == (
        baseline.saved,
        baseline.peak,
        frozenset(),
    )
    for a, b in itertools.combinations(found[1:], 2):  # none dominates another
        assert not (a.saved <= b.saved and a.peak <= b.peak and a.cost_s <= b.cost_s)
        assert not (b.saved <= a.saved and b.peak <= a.peak and b.cost_s <= a.cost_s)
    assert min(o.peak for o in found) == min(sim.peak for _, sim in greedy_sequence(table))
    assert min(o.saved for o in found) < baseline.saved // 2


def test_two_graphs_planned_together_fit_where_each_planned_alone_does_not():
    """End to end on tables: a chain of a light graph and one whose backward holds a
    workspace as large as its activations."""
    first, second = _chain_table(6, 100), _chain_table(6, 100, workspace=600)
    per_graph = [options(first), options(second)]
    baseline = process_peak([graph[0] for graph in per_graph])
    budget = baseline // 2
    choice = choose(per_graph, budget)
    assert choice.fits and choice.peak <= budget
    # Each graph at half of what it saves (what planning one graph at a time does) is over.
    halves = [
        min((o for o in g if o.saved <= g[0].saved // 2), key=lambda o: o.cost_s) for g in per_graph
    ]
    assert process_peak(halves) > budget
