"""The ``optimal`` planner: a mixed-integer program on HiGHS over the simulator's cost model.

Checkmate (Jain et al. 2020) schedules every node at every step; that is O(n²) variables,
far too many for a 10k-node training graph. Here the schedule is fixed by the rewriter
(each copy right before its first backward consumer), so the only decisions are *which*
nodes to recompute, and memory is linear in them once lifetimes are bounded:

    minimize    Σ_y t_y·r_y                              (recompute time)
    subject to  M(τ) ≤ B   for each step τ               (peak fits)
                k_s ≥ 1 − r_h     a holder h of storage s is used in the backward and
                                  is not recomputed: s stays alive
                k_s ≥ r_y − r_a   y is recomputed from a (holding s), a is not: s stays
                                  alive until y's copy (e_s: past its baseline lifetime)
    M(τ) = F(τ) + Σ_s b_s·k_s·[τ in s's baseline tail] + Σ_s b_s·e_s·[τ in s's extension]
                + Σ_y bytes(y)·r_y·[τ in y's copy window]

with r_y ∈ {0, 1} per recomputable node, k_s, e_s ∈ [0, 1] per activation storage, F the
memory that no decision changes, a storage's *tail* the part of its baseline lifetime after
its last forward use, and a copy's window the span from its earliest to its latest
possible backward consumer. The windows over-approximate what the rewriter does, so the
model is conservative; the chosen set is then checked with the exact simulator, and the
budget tightened by the overshoot when the model was optimistic anyway.

Constraints on M(τ) are added lazily (row generation): solve with the worst steps so far,
evaluate M at every step in O(n) with difference arrays, add the violated ones, repeat.
The greedy plan is the warm start, and is returned when the MILP does not beat it within
the time limit, so ``optimal`` is never worse than ``greedy`` in simulation.
"""

from __future__ import annotations

import time

import numpy as np

from fxopt.remat.native_output import HIGHS_BANNER, without_lines
from fxopt.remat.plans import RematPlan, budget_error, make_plan
from fxopt.remat.simulate import Simulation, simulate
from fxopt.remat.table import BACKWARD, FORWARD, Table

_ROWS_PER_ROUND = 16  # violated steps added per round: fewer rounds, small LPs
_MAX_ROUNDS = 60
_TIGHTENINGS = 3


class _Model:
    """The MILP's data for one table: variables, fixed memory, intervals."""

    def __init__(self, table: Table):
        rows = table.rows
        self.table = table
        self.n = n = len(rows)
        base = simulate(table)
        self.base = base
        self.candidates = [i for i, r in enumerate(rows) if r.recomputable]
        self.col = {y: j for j, y in enumerate(self.candidates)}
        # A copy's window spans its own backward uses, or for a copy made only for its
        # dependents' recomputes, the span of their anchors. `anchor` bounds where the copy
        # is made from above: its first backward use, else the dependents' latest anchor.
        lo: dict[int, int] = {}
        hi: dict[int, int] = {}
        anchor: dict[int, int] = {}
        for y in reversed(self.candidates):
            own = [u for u in table.users[y] if rows[u].phase == BACKWARD]
            if own:
                lo[y], hi[y] = own[0], own[-1]
                anchor[y] = own[0]
            else:
                later = [anchor[u] for u in table.users[y] if u in anchor]
                if later:
                    anchor[y] = max(later)
                    lo[y], hi[y] = min(later), max(later)
        self.lo, self.hi = lo, hi
        n_storages = len(table.storage_bytes)
        self.tail: dict[int, tuple[int, int]] = {}  # storage -> (after, until]
        self.ext: dict[int, tuple[int, int]] = {}
        fixed = np.array(base.timeline[:n], dtype=np.float64)
        delta = np.zeros(n + 2)
        for s in range(n_storages):
            owner = table.owner[s]
            if s in table.excluded or rows[owner].phase != FORWARD or base.start[s] < 0:
                continue
            holders = table.holders[s]
            fw_end = max(
                max([u for u in table.users[h] if rows[u].phase == FORWARD] + [h])
                for h in holders
                if rows[h].phase == FORWARD
            )
            end = base.end[s]
            dependents_end = max(
                (anchor[y] for h in holders for y in table.users[h] if y in anchor),
                default=-1,
            )
            if end > fw_end:
                self.tail[s] = (fw_end, end)
                delta[fw_end + 1] -= table.storage_bytes[s]
                delta[min(end, n - 1) + 1] += table.storage_bytes[s]
            if dependents_end > max(end, fw_end):
                self.ext[s] = (max(end, fw_end), dependents_end)
        self.fixed = fixed + np.cumsum(delta)[:n]
        # Columns: r (candidates), then k (tails), then e (extensions).
        self.k_col = {s: len(self.candidates) + j for j, s in enumerate(self.tail)}
        self.e_col = {s: len(self.candidates) + len(self.tail) + j for j, s in enumerate(self.ext)}
        self.width = len(self.candidates) + len(self.tail) + len(self.ext)

    def memory(self, x: np.ndarray) -> np.ndarray:
        """M(τ) at every step for a (possibly fractional) solution."""
        n, sizes = self.n, self.table.storage_bytes
        delta = np.zeros(n + 2)
        for s, (after, until) in self.tail.items():
            w = sizes[s] * x[self.k_col[s]]
            delta[after + 1] += w
            delta[min(until, n - 1) + 1] -= w
        for s, (after, until) in self.ext.items():
            w = sizes[s] * x[self.e_col[s]]
            delta[after + 1] += w
            delta[min(until, n - 1) + 1] -= w
        for y, j in self.col.items():
            if y in self.lo:
                w = self._owned(y) * x[j]
                delta[self.lo[y]] += w
                delta[self.hi[y] + 1] -= w
        return self.fixed + np.cumsum(delta)[:n]

    def memory_row(self, tau: int) -> tuple[list[int], list[float]]:
        sizes = self.table.storage_bytes
        idx, val = [], []
        for s, (after, until) in self.tail.items():
            if after < tau <= until:
                idx.append(self.k_col[s])
                val.append(float(sizes[s]))
        for s, (after, until) in self.ext.items():
            if after < tau <= until:
                idx.append(self.e_col[s])
                val.append(float(sizes[s]))
        for y, j in self.col.items():
            if y in self.lo and self.lo[y] <= tau <= self.hi[y] and self._owned(y):
                idx.append(j)
                val.append(float(self._owned(y)))
        return idx, val

    def _owned(self, y: int) -> int:
        return sum(self.table.storage_bytes[s] for s in self.table.rows[y].owns)

    def link_rows(self):
        """The k/e constraints, as (lower bound, indices, values) with ``≥``."""
        table, rows = self.table, self.table.rows
        found = []
        for s in self.tail:
            for h in table.holders[s]:
                # Backward holders (AOTAutograd's detach) read whichever copy exists.
                if rows[h].phase != FORWARD:
                    continue
                if not any(rows[u].phase == BACKWARD for u in table.users[h]):
                    continue
                if h in self.col:
                    found.append((1.0, [self.k_col[s], self.col[h]], [1.0, 1.0]))
                else:
                    found.append((1.0, [self.k_col[s]], [1.0]))
        for y in self.candidates:
            for a in dict.fromkeys(rows[y].args):
                for s in rows[a].refs:
                    for cols in (self.k_col, self.e_col):
                        if s not in cols:
                            continue
                        idx, val = [cols[s], self.col[y]], [1.0, -1.0]
                        if a in self.col:
                            idx.append(self.col[a])
                            val.append(1.0)
                        found.append((0.0, idx, val))
        return found


def optimal(
    table: Table,
    limit: int,
    *,
    warm: RematPlan | None,
    time_limit_s: float,
    reached: Simulation | None = None,
) -> RematPlan:
    """The cheapest recompute set whose simulated peak fits ``limit`` (see module doc).
    ``reached``: the best simulation greedy found when it did not fit, reported in the
    BudgetError if the MILP does no better."""
    import highspy

    deadline = time.perf_counter() + time_limit_s
    model = _Model(table)
    best: RematPlan | None = warm if warm is not None and warm.peak <= limit else None
    target = limit
    last_sim = None
    for _ in range(_TIGHTENINGS + 1):
        if time.perf_counter() >= deadline:
            break
        chosen = _solve(highspy, model, target, warm, deadline)
        if chosen is None:
            break
        sim = simulate(table, chosen)
        last_sim = sim
        if sim.peak <= limit:
            if best is None or sim.recompute_s < best.recompute_s - 1e-12:
                best = make_plan(table, "optimal", limit, chosen, sim, source="milp")
            break
        target -= sim.peak - limit  # the model was optimistic here: ask for less
    if best is None:
        # The lowest peak seen, greedy's included: the baseline is only the last resort.
        tried = [s for s in (last_sim, reached) if s is not None] or [simulate(table)]
        raise budget_error(table, limit, "optimal", min(tried, key=lambda s: s.peak))
    if best.planner != "optimal":  # the greedy warm start was not beaten
        best = RematPlan(**{**best.__dict__, "planner": "optimal", "details": {"source": "greedy"}})
    return best


def _solve(highspy, model: _Model, target: float, warm: RematPlan | None, deadline: float):
    """Row generation until M(τ) ≤ target everywhere (in the model) or time runs out."""
    with without_lines(1, HIGHS_BANNER):  # the first solver prints it, options or not
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", 1e-4)
    inf = highspy.kHighsInf
    width, nr = model.width, len(model.candidates)
    total_time = sum(r.time_s for r in model.table.rows) or 1.0
    h.addVars(width, np.zeros(width), np.ones(width))
    costs = np.zeros(width)
    for y, j in model.col.items():
        # Relative time, plus a tie-break that prefers recomputing less.
        costs[j] = model.table.rows[y].time_s / total_time + 1e-7
    h.changeColsCost(width, np.arange(width, dtype=np.int32), costs)
    h.changeColsIntegrality(
        nr, np.arange(nr, dtype=np.int32), np.array([highspy.HighsVarType.kInteger] * nr)
    )
    for lower, idx, val in model.link_rows():
        h.addRow(lower, inf, len(idx), np.array(idx, dtype=np.int32), np.array(val))
    scale = 1.0 / max(target, 1.0)
    added: set[int] = set()
    taus = [int(np.argmax(model.fixed)), model.table.boundary]
    if warm is not None:
        _warm_start(highspy, h, model, warm)
    chosen = None
    for _ in range(_MAX_ROUNDS):
        for tau in taus:
            if tau in added or tau >= model.n:
                continue
            added.add(tau)
            idx, val = model.memory_row(tau)
            upper = (target - model.fixed[tau]) * scale
            h.addRow(-inf, upper, len(idx), np.array(idx, dtype=np.int32), np.array(val) * scale)
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        h.setOptionValue("time_limit", remaining)
        h.run()
        status = h.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return None
        x = np.array(h.getSolution().col_value)
        if x.size != width:
            return chosen
        chosen = frozenset(y for y, j in model.col.items() if x[j] > 0.5)
        rounded = x.copy()
        rounded[:nr] = np.round(rounded[:nr])
        over = model.memory(rounded) - target
        violated = [int(t) for t in np.argsort(-over)[:_ROWS_PER_ROUND] if over[t] > 1e-6 * target]
        taus = [t for t in violated if t not in added]
        if not taus:
            break
    return chosen


def _warm_start(highspy, h, model: _Model, warm: RematPlan) -> None:
    names = {model.table.rows[y].name: j for y, j in model.col.items()}
    x = np.zeros(model.width)
    for name in warm.recompute:
        if name in names:
            x[names[name]] = 1.0
    for lower, idx, val in model.link_rows():  # smallest k/e the chosen set needs
        need = lower - sum(x[i] * v for i, v in zip(idx[1:], val[1:]))
        x[idx[0]] = max(x[idx[0]], min(1.0, need))
    solution = highspy.HighsSolution()
    solution.col_value = list(x)
    solution.value_valid = True
    h.setSolution(solution)
