"""What a plan is: the recompute (and offload) choice for a training graph, its cost
model's figures, the budget it was made for, and the error of a budget no plan meets.
Below the planners and the MILP, which both make plans (pure: no torch.fx here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fxopt.errors import UserInputError
from fxopt.remat.simulate import Simulation, floor, simulate
from fxopt.remat.table import BACKWARD, Table

#: Host <-> device bandwidth of the default offload cost model, bytes per second each way:
#: PCIe 4.0 x16 carries 31.5 GB/s in theory (16 GT/s x 16 lanes, 128b/130b coding); pinned
#: copies reach about 80 % of that.
PCIE4_X16_BYTES_S = 25e9


@dataclass(frozen=True)
class Offload:
    """The cost of keeping a saved activation on the host: its bytes go out after its
    last forward use and come back before its first backward use, each way at
    ``bandwidth_bytes_s``. The rewrite issues both copies on the compute stream, so the
    model charges their whole time (nothing overlaps them).

    >>> Offload(bandwidth_bytes_s=1e9).cost_s(5e8)
    1.0
    """

    bandwidth_bytes_s: float = PCIE4_X16_BYTES_S

    def __post_init__(self):
        if not self.bandwidth_bytes_s > 0:
            raise UserInputError(
                f"offload bandwidth must be a positive number of bytes per second, "
                f"got {self.bandwidth_bytes_s!r}"
            )

    def cost_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` out and back."""
        return 2 * nbytes / self.bandwidth_bytes_s


class BudgetError(UserInputError):
    """No plan of this planner fits the memory budget.

    ``best_fraction``: the lowest simulated peak the planner reached, over the baseline
    peak; ``floor_fraction``: the lowest any plan can reach (:func:`simulate.floor`).
    ``reached`` is that best plan's simulation (None when no plan was simulated).
    """

    def __init__(
        self,
        message: str,
        *,
        best_fraction: float,
        floor_fraction: float,
        reached: Simulation | None = None,
    ):
        super().__init__(message)
        self.best_fraction = best_fraction
        self.floor_fraction = floor_fraction
        self.reached = reached


@dataclass(frozen=True)
class RematPlan:
    """What to recompute, and what the cost model says it does."""

    planner: str
    budget_bytes: int
    recompute: tuple[str, ...]  # names of the recomputed nodes, graph order
    peak: int
    saved: int
    recompute_s: float
    baseline_peak: int
    baseline_saved: int
    forward_s: float  # summed runtime of the graph, for relative cost
    notes: tuple[str, ...] = ()
    details: dict = field(default_factory=dict, compare=False)
    offload: tuple[str, ...] = ()  # names of the nodes kept on the host, graph order
    offloaded_bytes: int = 0
    transfer_s: float = 0.0  # modelled time of the offloads' copies, out and back

    @property
    def estimated_overhead(self) -> float:
        """Recompute (and transfer) time relative to one unmodified step."""
        extra = self.recompute_s + self.transfer_s
        return extra / self.forward_s if self.forward_s > 0 else 0.0


def budget_bytes(budget: float | int, baseline_peak: int) -> int:
    """A budget in bytes (int) or as a fraction of the baseline peak (float in (0, 1]).

    >>> budget_bytes(0.5, 1000), budget_bytes(300, 1000)
    (500, 300)
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise UserInputError(f"memory budget must be a number, got {budget!r}")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise UserInputError(
                f"memory budget {budget} is outside (0, 1]: give a fraction of the baseline "
                "peak activation memory (e.g. 0.5), or an int number of bytes"
            )
        return int(budget * baseline_peak)
    if budget < 0:
        raise UserInputError(f"memory budget must not be negative, got {budget} bytes")
    return int(budget)


def make_plan(
    table: Table,
    planner: str,
    limit: int,
    recompute: frozenset[int],
    sim: Simulation,
    offload: Offload | None = None,
    **details,
) -> RematPlan:
    """A RematPlan from a chosen recompute set and its simulation (with its offloads, costed
    by ``offload``)."""
    baseline = simulate(table)
    offloaded_bytes = sum(table.storage_bytes[s] for x in sim.offloaded for s in table.rows[x].owns)
    if sim.offloaded and offload is None:
        raise ValueError("a simulation with offloads needs the Offload model that costs them")
    return RematPlan(
        planner=planner,
        budget_bytes=limit,
        recompute=tuple(table.rows[i].name for i in sim.recomputed),
        peak=sim.peak,
        saved=sim.saved,
        recompute_s=sim.recompute_s,
        baseline_peak=baseline.peak,
        baseline_saved=baseline.saved,
        forward_s=sum(r.time_s for r in table.rows),
        details=details,
        offload=tuple(table.rows[i].name for i in sim.offloaded),
        offloaded_bytes=offloaded_bytes,
        transfer_s=offload.cost_s(offloaded_bytes) if sim.offloaded else 0.0,
    )


def budget_error(table: Table, limit: int, planner: str, sim: Simulation) -> BudgetError:
    """The one-line error for a budget ``planner`` cannot meet, ``sim`` being its best
    plan: below the floor (:func:`~fxopt.remat.simulate.floor`), the floor and the node
    that sets it; above it, the planner's lowest peak and the largest values live there.
    Both end with the budget that would work."""
    baseline = max(1, simulate(table).peak)
    floor_bytes, floor_row = floor(table)

    def share(n: int) -> str:
        return f"{_mib(n)} ({n / baseline:.2f} of the baseline)"

    needed = math.ceil(sim.peak / baseline * 100) / 100  # rounded up: it must fit
    if limit < floor_bytes:
        message = (
            f"memory budget {share(limit)} is below what any plan can reach: "
            f"{share(floor_bytes)}, what '{table.rows[floor_row].name}' holds while it runs "
            f"(inputs, outputs, workspace). Planner '{planner}' reaches {share(sim.peak)}; "
            f"give a budget of at least {needed:.2f}"
        )
    else:
        other = "" if planner in ("greedy", "optimal") else " or use planner 'greedy'"
        message = (
            f"memory budget {share(limit)} cannot be met by planner '{planner}': it reaches "
            f"{share(sim.peak)} at best, with {_pinned(table, sim)} live there (no plan can "
            f"go below {share(floor_bytes)}). Give a budget of at least {needed:.2f}{other}"
        )
    return BudgetError(
        message,
        best_fraction=sim.peak / baseline,
        floor_fraction=floor_bytes / baseline,
        reached=sim,
    )


def _pinned(table: Table, sim: Simulation) -> str:
    """The largest values live at the simulated peak, and why each is there."""
    n_storages = len(table.storage_bytes)
    live = sim.live_at(sim.peak_step)
    pinned = []
    for s in live:
        base = s % n_storages
        if base in table.excluded:
            continue
        owner = table.rows[table.owner[base]]
        why = owner.reason or ("in use at the peak" if s >= n_storages else "needed at the peak")
        if owner.phase == BACKWARD:
            why = "a backward value in use at the peak"
        pinned.append((table.storage_bytes[base], owner.name, why))
    pinned.sort(key=lambda p: (-p[0], p[1]))
    return "; ".join(f"{name} ({_mib(size)}: {why})" for size, name, why in pinned[:3])


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n} B"


# --------------------------------------------------------------------------- sequences
