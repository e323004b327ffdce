"""Choose which activations to recompute: table + budget → plan (pure: no torch.fx here).

The budget is a peak (bytes, or a fraction of the baseline's simulated peak). Each planner
(``every_n``, ``sqrt_n``, ``greedy``, ``optimal``; ``greedy`` may also offload) returns
the first plan of a budget-independent sequence whose simulated peak fits, so a smaller
budget never gives a higher peak. What each planner does, and why: docs/remat_design.md.

    >>> from fxopt.remat.table import Table
    >>> t = Table.build(
    ...     names=["x", "a", "b", "c", "gc", "gb", "ga", "out"],
    ...     phases=["input"] + ["forward"] * 3 + ["backward"] * 3 + ["output"],
    ...     args=[(), (0,), (1,), (2,), (3,), (2, 4), (1, 5), (6,)],
    ...     storages=[None, 10, 10, 10, 1, 1, 1, None],
    ... )
    >>> p = plan(t, 0.7, planner="greedy")
    >>> p.recompute, p.peak, p.baseline_peak, p.peak <= p.budget_bytes
    (('a',), 21, 31, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from fxopt.errors import UserInputError
from fxopt.remat.plans import (
    PCIE4_X16_BYTES_S,
    BudgetError,
    Offload,
    RematPlan,
    budget_bytes,
    budget_error,
    make_plan,
)
from fxopt.remat.simulate import Simulation, simulate
from fxopt.remat.table import BACKWARD, FORWARD, INPUT, Table

__all__ = [
    "NEAR_PEAK",
    "PCIE4_X16_BYTES_S",
    "PLANNERS",
    "BudgetError",
    "Offload",
    "RematPlan",
    "budget_bytes",
    "make_plan",
    "plan",
]

PLANNERS = ("every_n", "sqrt_n", "greedy", "optimal")


def plan(
    table: Table,
    budget: float | int,
    planner: str = "greedy",
    *,
    time_limit_s: float = 20.0,
    offload: Offload | None = None,
) -> RematPlan:
    """Choose what to recompute (and, given ``offload``, what to keep on the host) so the
    simulated peak fits ``budget``."""
    if planner not in PLANNERS:
        raise UserInputError(f"unknown planner '{planner}'; valid planners: {', '.join(PLANNERS)}")
    baseline = simulate(table)
    limit = budget_bytes(budget, baseline.peak)
    try:
        return _plan(table, limit, planner, time_limit_s, offload)
    except BudgetError as error:
        raise _cheapest_near_best(error, table, limit, planner, time_limit_s, offload) from None


#: Over a budget no plan meets, a peak lower by less than this fraction of it is not
#: worth any recompute time: the best plan is the cheapest within it of the lowest peak
#: (so is the chain's lowest combination, :mod:`fxopt.remat.chain`).
NEAR_PEAK = 1 / 1000


def near_peak_bytes(peak: int) -> int:
    """How far above a lowest ``peak`` the cheapest plan is preferred (:data:`NEAR_PEAK`)."""
    return int(peak * NEAR_PEAK)


def _cheapest_near_best(
    error: BudgetError,
    table: Table,
    limit: int,
    planner: str,
    time_limit_s: float,
    offload: Offload | None,
) -> BudgetError:
    """``error``, its best plan replaced by the cheapest whose peak is within
    :data:`NEAR_PEAK` of it. (The lowest peak a planner reaches can cost far more than
    one a hair above it: on a BatchNorm CNN, a third recomputed convolution for 512 bytes
    of a 2.6 MB peak, 1.6 times the recompute time.)"""
    best = error.reached
    if best is None or offload is not None:  # (offloads trade transfer time: not here)
        return error
    near = best.peak + near_peak_bytes(best.peak)
    try:
        found = _plan(table, near, planner, time_limit_s, offload)
    except BudgetError:
        return error
    if found.recompute_s >= best.recompute_s:
        return error
    recomputed = [table.index(name) for name in found.recompute]
    return budget_error(table, limit, planner, simulate(table, recomputed))


def _plan(
    table: Table, limit: int, planner: str, time_limit_s: float, offload: Offload | None
) -> RematPlan:
    if offload is not None:
        if planner != "greedy":
            raise UserInputError(
                f"offload is planned by the 'greedy' planner only, not '{planner}'"
            )
        found = _first_fit(table, limit, planner, greedy_sequence(table, offload), offload)
        found.details["bandwidth_bytes_s"] = offload.bandwidth_bytes_s
        return found
    if planner == "optimal":
        from fxopt.remat import milp

        reached = None
        try:
            warm = _first_fit(table, limit, "greedy", greedy_sequence(table))
        except BudgetError as error:
            warm = None  # the MILP may still find a plan greedy missed
            reached = error.reached  # and if not, the error reports greedy's best
        return milp.optimal(table, limit, warm=warm, reached=reached, time_limit_s=time_limit_s)
    sequence = {"every_n": every_n_sequence, "sqrt_n": sqrt_n_sequence}.get(
        planner, greedy_sequence
    )
    return _first_fit(table, limit, planner, sequence(table))


def _first_fit(
    table: Table,
    limit: int,
    planner: str,
    sequence: Iterator[tuple[frozenset[int], Simulation]],
    offload: Offload | None = None,
) -> RematPlan:
    best: tuple[frozenset[int], Simulation] | None = None
    for steps, (chosen, sim) in enumerate(sequence):
        if sim.peak <= limit:
            return make_plan(table, planner, limit, chosen, sim, offload, steps=steps)
        if best is None or sim.peak < best[1].peak:
            best = (chosen, sim)
    assert best is not None
    raise budget_error(table, limit, planner, best[1])


def _saved_candidates(table: Table) -> list[int]:
    """Recomputable forward nodes that own a storage the baseline keeps for the backward."""
    found = []
    for i, row in enumerate(table.rows):
        if not row.recomputable or not row.owns:
            continue
        for s in row.owns:
            if s in table.excluded:
                continue
            if any(table.first_backward_use(h) is not None for h in table.holders[s]):
                found.append(i)
                break
    return found


def _segments(table: Table, keep: set[int]) -> frozenset[int]:
    """Recompute every recomputable forward node except the kept checkpoints."""
    return frozenset(
        i
        for i, row in enumerate(table.rows)
        if row.phase == FORWARD and row.recomputable and i not in keep
    )


def every_n_sequence(table: Table) -> Iterator[tuple[frozenset[int], Simulation]]:
    """``every_n``'s plans, each a recompute set and its simulation: nothing, then every
    N-th saved activation kept for N = 2, 3, ..."""
    yield frozenset(), simulate(table)
    candidates = _saved_candidates(table)
    steps = [*range(2, 17), 24, 32, 48, 64, 96, 128, 256, 512]
    for n in (s for s in steps if s <= max(2, len(candidates))):
        chosen = _segments(table, set(candidates[::n]))
        yield chosen, simulate(table, chosen)


def sqrt_n_sequence(table: Table) -> Iterator[tuple[frozenset[int], Simulation]]:
    """``sqrt_n``'s plans: nothing recomputed, then the √n-segment plan."""
    yield frozenset(), simulate(table)
    candidates = _saved_candidates(table)
    if not candidates:
        return
    sizes = [sum(table.storage_bytes[s] for s in table.rows[i].owns) for i in candidates]
    segment = sum(sizes) / math.sqrt(len(candidates))
    keep, running = set(), 0.0
    for i, size in zip(candidates, sizes):
        running += size
        if running >= segment:
            keep.add(i)
            running = 0.0
    chosen = _segments(table, keep)
    yield chosen, simulate(table, chosen)


def greedy_sequence(
    table: Table, offload: Offload | None = None
) -> Iterator[tuple[frozenset[int], Simulation]]:
    """``greedy``'s plans: nothing recomputed, then each plan the previous one plus the
    recompute group (or, given ``offload``, the offload) that frees the most bytes per
    second of recompute (or transfer) at its peak. Each plan is its recompute set and its
    simulation, which lists the offloads too."""
    chosen: set[int] = set()
    offloaded: set[int] = set()
    sim = simulate(table)
    yield frozenset(), sim
    # (kind, row) choices that raised the peak, until the peak next drops
    rejected: set[tuple[str, int]] = set()
    while True:
        best = _best_choice(table, sim, chosen | offloaded, offload, rejected)
        if best is None:
            return
        kind, x, (recomputed, moved) = best
        trial = simulate(table, chosen | recomputed, offloaded | moved)
        if trial.peak > sim.peak:
            rejected.add((kind, x))
            continue
        if trial.peak < sim.peak:
            rejected.clear()
        chosen |= recomputed
        offloaded |= moved
        sim = trial
        yield frozenset(chosen), sim


def _best_choice(
    table: Table,
    sim: Simulation,
    kept: set[int],
    offload: Offload | None,
    rejected: set[tuple[str, int]],
) -> tuple[str, int, tuple[set[int], set[int]]] | None:
    """The choice that frees the most bytes per second at ``sim``'s peak, as (kind, row,
    (rows recomputed, rows offloaded)), or None; ``kept``: rows already recomputed or
    offloaded."""
    position = {item: p for p, item in enumerate(sim.schedule)}
    peak = sim.peak_step
    n_storages = len(table.storage_bytes)
    live = {s for s in sim.live_at(peak) if s < n_storages and s not in table.excluded}
    best: tuple[float, str, int, set[int]] | None = None
    for x in sorted({table.owner[s] for s in live}):
        if x in kept or table.rows[x].phase != FORWARD:
            continue
        if not _kept_for_later_backward(table, x, position, peak):
            continue
        for kind, score, group in _choices(table, x, kept, live, offload):
            if (kind, x) not in rejected and (best is None or score > best[0]):
                best = (score, kind, x, group)
    return None if best is None else best[1:]


def _kept_for_later_backward(table: Table, x: int, position: dict, peak: int) -> bool:
    """Whether row ``x`` is live at the peak only for a later backward use: no forward
    use at or after the peak (the forward still using it), and no backward use at or
    before it (else its copy would be live there too)."""
    rows = table.rows
    holders = {h for s in rows[x].owns for h in table.holders[s]}
    return not any(
        position[u] >= peak if rows[u].phase == FORWARD else position[u] <= peak
        for h in holders
        for u in table.users[h]
        if rows[u].phase in (FORWARD, BACKWARD)
    )


def _choices(
    table: Table, x: int, kept: set[int], live: set[int], offload: Offload | None
) -> Iterator[tuple[str, float, tuple[set[int], set[int]]]]:
    """What could free row ``x``'s storage at the peak: ("recompute" or "offload", bytes
    freed per second, (rows recomputed, rows offloaded)). ``kept``: rows already
    recomputed or offloaded."""
    rows = table.rows

    def is_live(i: int) -> bool:
        return all(s in live for s in rows[i].refs)

    if rows[x].recomputable:
        recompute = _closure(table, x, kept, is_live)
        if recompute is not None:
            group, extra = recompute
            freed = sum(
                table.storage_bytes[s]
                for y in group
                for s in rows[y].owns
                if s in live and y not in kept
            )
            cost = sum(rows[y].time_s for y in group if y not in kept)
            if freed - extra > 0:
                yield "recompute", (freed - extra) / max(cost, 1e-9), (group, set())
    views = offload_views(table, x) if offload is not None else None
    if views is not None:
        freed = sum(table.storage_bytes[s] for s in rows[x].owns if s in live)
        size = sum(table.storage_bytes[s] for s in rows[x].owns)
        cost = offload.cost_s(size) + sum(rows[v].time_s for v in views)
        if freed > 0:
            yield "offload", freed / max(cost, 1e-9), (views, {x})


def offload_views(table: Table, x: int) -> set[int] | None:
    """The views of row ``x`` to recompute from it if it is kept on the host (a detach
    of a saved activation, say), or None when it cannot be: it must be a forward value
    that owns its storages, holds no parameter gradient, and shares them only with
    recomputable forward views of itself (or of those) and backward ones: the one copy
    then moves all of it, and the forward views are made again from the copy back."""
    row = table.rows[x]
    if row.phase != FORWARD or not row.owns or row.refs != row.owns:
        return None
    if any(s in table.excluded for s in row.owns):
        return None
    holders = {h for s in row.owns for h in table.holders[s]}
    views: set[int] = set()
    for h in holders - {x}:
        view = table.rows[h]
        if view.phase == BACKWARD:
            continue  # reads the views made again, as every backward use does
        if view.phase != FORWARD or not view.recomputable or set(view.args) - holders:
            return None
        views.add(h)
    return views


def offloadable(table: Table, x: int) -> bool:
    """Whether row ``x`` can be kept on the host (see :func:`offload_views`)."""
    return offload_views(table, x) is not None


def _closure(
    table: Table, x: int, chosen: set[int], is_live: Callable[[int], bool]
) -> tuple[set[int], int] | None:
    """The nodes recomputed with ``x`` and the bytes of sources that must newly be kept.

    ``x``'s views and getitems go with it (else they keep its storage alive); the recompute
    grows back through forward values that are dead at the peak, and stops at inputs,
    values live at the peak anyway, and values already chosen.
    """
    rows = table.rows
    group = {x}
    for s in rows[x].owns:
        for h in table.holders[s]:
            if rows[h].phase == FORWARD:
                if not rows[h].recomputable:
                    return None
                group.add(h)
    extra = 0
    kept: set[int] = set()
    frontier = sorted(group)
    while frontier:
        y = frontier.pop()
        for a in rows[y].args:
            if a in group or a in chosen or a in kept or rows[a].phase == INPUT:
                continue
            if not rows[a].refs or is_live(a):
                continue  # views of parameters are free; live values are kept anyway
            if rows[a].recomputable:
                group.add(a)
                frontier.append(a)
            else:
                kept.add(a)
                extra += sum(table.storage_bytes[s] for s in rows[a].refs)
    return group, extra
