"""Simulate a recompute plan: the schedule the rewriter will produce and its memory timeline.

This is the cost model every planner optimizes and every test checks against, so it
mirrors :mod:`fxopt.remat.rewrite` exactly:

* each recomputed node that something in the backward needs is copied **once**, right
  before its earliest backward consumer (a backward use, or the copy of a recomputed node
  that reads it); copies with the same anchor keep graph order;
* backward uses read the copy; forward uses keep the original, which dies after its last
  forward use;
* a value lives from the step that makes it to the last step that reads it (as the code
  fx generates frees a variable after its last use), and a *storage* lives while any value
  referencing it (its owner, views, getitems) lives;
* live bytes at a step count everything allocated up to and including that step and not
  yet freed before it, so an op's output and its inputs are counted together, plus the
  op's own temporaries (workspaces it frees before returning; measured by the profile),
  and for a copy that replays RNG state, the generator state it saves while it runs;
* an *offloaded* row (``offload``) is kept on the host instead: its original dies after
  its last forward use, as a recomputed one's does, and its restore (a copy back to the
  device, made where a recompute's copy would be) reads nothing on the device and holds
  no temporaries. Its time is the planner's business (:class:`fxopt.remat.planners.Offload`).

    >>> from fxopt.remat.table import Table
    >>> t = Table.build(
    ...     names=["x", "a", "b", "c", "gc", "gb", "ga", "out"],
    ...     phases=["input"] + ["forward"] * 3 + ["backward"] * 3 + ["output"],
    ...     args=[(), (0,), (1,), (2,), (3,), (2, 4), (1, 5), (6,)],
    ...     storages=[None, 10, 10, 10, 1, 1, 1, None],
    ... )
    >>> simulate(t).peak, simulate(t, {1}).peak, simulate(t, {1}).recomputed
    (31, 21, (1,))
    >>> floor(t)  # row 2 ('b'): a and b together, whatever is recomputed
    (20, 2)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fxopt.remat.table import BACKWARD, FORWARD, OUTPUT, Table


@dataclass(frozen=True)
class Simulation:
    """What a plan does to memory and time, step by step."""

    peak: int  # max live activation bytes
    peak_step: int  # schedule position of the peak
    saved: int  # bytes live across the forward/backward boundary
    recompute_s: float  # summed runtime of the recomputed copies
    recomputed: tuple[int, ...]  # rows that get a recomputed copy, in graph order
    anchors: dict[int, int]  # recomputed row -> row its copy is inserted before
    schedule: tuple[int, ...]  # row indices; a copy of row x appears as -(x + 1)
    timeline: tuple[int, ...]  # live bytes at each schedule position
    start: tuple[int, ...]  # per storage (originals, then copies): first live position
    end: tuple[int, ...]  # per storage: last live position (-1: never allocated)
    offloaded: tuple[int, ...] = ()  # rows restored from the host instead, graph order

    def live_at(self, step: int) -> list[int]:
        """Storage ids live at a schedule position (copies are ``n_storages + s``)."""
        return [s for s, (a, b) in enumerate(zip(self.start, self.end)) if a <= step <= b]


def anchors_of(
    table: Table, recompute: Iterable[int], offload: Iterable[int] = ()
) -> dict[int, int]:
    """For each recomputed (or offloaded) row that something in the backward needs, the
    row its copy (or restore) is inserted before: its earliest backward consumer, counting
    the copies of dependents."""
    chosen = set(recompute) | set(offload)
    rows = table.rows
    anchors: dict[int, int] = {}
    for x in sorted(chosen, reverse=True):  # dependents come later in graph order
        first = None
        for u in table.users[x]:
            if rows[u].phase == BACKWARD:
                at = u
            elif u in anchors:
                at = anchors[u]
            else:
                continue
            first = at if first is None else min(first, at)
        if first is not None:
            anchors[x] = first
    return anchors


def simulate(
    table: Table, recompute: Iterable[int] = (), offload: Iterable[int] = ()
) -> Simulation:
    """Schedule and live-memory timeline of ``table`` with ``recompute`` rows recomputed
    and ``offload`` rows kept on the host until the backward needs them."""
    rows = table.rows
    n, n_storages = len(rows), len(table.storage_bytes)
    offloaded = frozenset(offload)
    anchors = anchors_of(table, recompute, offloaded)
    schedule, position = _schedule(n, anchors)
    last, refs = _last_uses_and_refs(table, anchors, schedule, len(schedule), offloaded)
    start, end = _storage_lifetimes(table, refs, position, last)
    timeline = _timeline(table, schedule, start, end, offloaded)
    peak_step = max(range(len(timeline)), key=timeline.__getitem__) if timeline else 0
    last_forward = max((position[i] for i in range(n) if rows[i].phase == FORWARD), default=-1)
    saved = sum(
        table.storage_bytes[s]
        for s in range(n_storages)
        if s not in table.excluded and 0 <= start[s] <= last_forward < end[s]
    )
    return Simulation(
        peak=timeline[peak_step] if timeline else 0,
        peak_step=peak_step,
        saved=saved,
        recompute_s=sum(rows[x].time_s for x in anchors if x not in offloaded),
        recomputed=tuple(sorted(x for x in anchors if x not in offloaded)),
        anchors=anchors,
        schedule=tuple(schedule),
        timeline=tuple(timeline),
        start=tuple(start),
        end=tuple(end),
        offloaded=tuple(sorted(x for x in anchors if x in offloaded)),
    )


# Items: row i is item i, the copy of row x is item n + x (n rows). In the schedule a copy
# appears as -(x + 1); storages of copies are numbered n_storages + s.


def _schedule(n: int, anchors: dict[int, int]) -> tuple[list[int], dict[int, int]]:
    """The schedule, and each item's position in it: every row in graph order, the copies
    anchored at a row right before it (in graph order among themselves)."""
    before: dict[int, list[int]] = {}
    for x in sorted(anchors):
        before.setdefault(anchors[x], []).append(x)
    position: dict[int, int] = {}
    schedule: list[int] = []
    for i in range(n):
        for x in before.get(i, ()):
            position[n + x] = len(schedule)
            schedule.append(-(x + 1))
        position[i] = len(schedule)
        schedule.append(i)
    return schedule, position


def _last_uses_and_refs(
    table: Table,
    anchors: dict[int, int],
    schedule: list[int],
    end_step: int,
    offloaded: frozenset[int] = frozenset(),
) -> tuple[dict[int, int], dict[int, tuple[int, ...]]]:
    """Per item: the last position that reads it (``end_step`` for a graph output), and
    the storages its value references.

    A copy, or a backward row, reads the copies of recomputed args and the originals of
    the rest; a forward row reads the originals; an offloaded row's restore reads only
    the host. (Planners simulate hundreds of plans: this loop is kept flat.)
    """
    rows = table.rows
    n, n_storages = len(rows), len(table.storage_bytes)
    last: dict[int, int] = {}
    refs: dict[int, tuple[int, ...]] = {}
    redirected: set[int] = set()  # items whose value references a copy's storage
    for step, entry in enumerate(schedule):
        if entry >= 0:
            item, row = entry, rows[entry]
            if anchors and row.phase == BACKWARD:
                item_args = [n + a if a in anchors else a for a in row.args]
            else:
                item_args = row.args
            read_until = end_step if row.phase == OUTPUT else step  # steps only grow
        else:
            row = rows[-entry - 1]
            item = n - entry - 1
            if -entry - 1 in offloaded:
                item_args = []
            else:
                item_args = [n + a if a in anchors else a for a in row.args]
            read_until = step
        last[item] = step
        for a in item_args:
            last[a] = read_until
        if entry >= 0 and (not redirected or redirected.isdisjoint(item_args)):
            refs[item] = row.refs
            continue
        # A copy owns copies of its storages; a view of a copy (or a backward view
        # redirected to one) references the copy's storage instead of the original.
        x = item if item < n else item - n
        inherited = {s for a in item_args for s in refs.get(a, ())}
        item_refs = tuple(
            n_storages + s
            if (item >= n and table.owner[s] == x) or (n_storages + s) in inherited
            else s
            for s in row.refs
        )
        refs[item] = item_refs
        if any(s >= n_storages for s in item_refs):
            redirected.add(item)
    return last, refs


def _storage_lifetimes(
    table: Table,
    refs: dict[int, tuple[int, ...]],
    position: dict[int, int],
    last: dict[int, int],
) -> tuple[list[int], list[int]]:
    """Per storage (originals, then copies): the position that allocates it and the last
    position any value referencing it is used (-1, -1: never allocated)."""
    n, n_storages = len(table.rows), len(table.storage_bytes)
    start = [-1] * (2 * n_storages)
    end = [-1] * (2 * n_storages)
    for item, item_refs in refs.items():
        owner_step = position[item]
        for s in item_refs:
            base = s - n_storages if s >= n_storages else s
            if table.owner[base] == (item if item < n else item - n) and (
                (s >= n_storages) == (item >= n)
            ):
                start[s] = owner_step
            end[s] = max(end[s], last[item])
    return start, end


def _timeline(
    table: Table,
    schedule: list[int],
    start: list[int],
    end: list[int],
    offloaded: frozenset[int] = frozenset(),
) -> list[int]:
    """Live bytes at each position: the storages live there, plus the running op's
    temporaries (and a replaying copy's saved RNG state; a restore has neither)."""
    rows, n_storages, end_step = table.rows, len(table.storage_bytes), len(schedule)
    delta = [0] * (end_step + 2)
    for s in range(2 * n_storages):
        base = s - n_storages if s >= n_storages else s
        if start[s] < 0 or base in table.excluded:
            continue
        size = table.storage_bytes[base]
        delta[start[s]] += size
        delta[min(end[s], end_step) + 1] -= size
    timeline: list[int] = []
    live = 0
    for step in range(end_step):
        live += delta[step]
        item = schedule[step]
        if item < 0 and -item - 1 in offloaded:
            timeline.append(live)
            continue
        row = rows[item if item >= 0 else -item - 1]
        timeline.append(live + row.temp_bytes + (row.copy_temp_bytes if item < 0 else 0))
    return timeline


def floor(table: Table) -> tuple[int, int]:
    """The lowest peak any recompute plan can reach, and the row that sets it.

    Every row runs in every plan (recomputing adds copies, it removes nothing), and while
    it runs its inputs, its outputs and its temporaries are live together: the largest
    such sum is a bound no choice of recomputed nodes gets under. (On the default
    zoo:resnet18 it is 0.54 of the baseline peak: the stem's BatchNorm backward at full
    resolution.)
    """
    best, where = 0, 0
    for i, row in enumerate(table.rows):
        held = set(row.refs).union(*(table.rows[a].refs for a in row.args))
        size = sum(table.storage_bytes[s] for s in held if s not in table.excluded)
        size += row.temp_bytes
        if size > best:
            best, where = size, i
    return best, where
