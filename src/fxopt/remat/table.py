"""The cost table remat plans from: a training graph as plain data, no torch.fx inside.

One :class:`Row` per graph node, in graph order: its phase (input, forward, backward,
output), the rows it reads (``args``), its measured runtime, the storages its value
references (``refs``) and the ones it allocated (``owns``), and whether it may be
recomputed. Memory is counted per *storage*, not per node: a view or a ``getitem`` owns
nothing and keeps its base's storage alive, and a view of a parameter costs nothing.

    >>> t = Table.build(
    ...     names=["x", "a", "b", "ga", "out"],
    ...     phases=["input", "forward", "forward", "backward", "output"],
    ...     args=[(), (0,), (1,), (1, 2), (2, 3)],
    ...     storages=[None, 100, 100, 100, None],
    ... )
    >>> t.boundary, t.last_forward_use(1), t.first_backward_use(1), t.sources(2)
    (3, 2, 3, (1,))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

# A row's phase, and the phase capture tags each fx node with (fxopt.remat.capture.PHASE).
INPUT, FORWARD, BACKWARD, OUTPUT = "input", "forward", "backward", "output"


@dataclass(frozen=True)
class Row:
    """One node: what it reads, what it costs, what memory it holds."""

    name: str
    phase: str
    args: tuple[int, ...]
    time_s: float = 0.0
    refs: tuple[int, ...] = ()  # storage ids the node's value references
    owns: tuple[int, ...] = ()  # storage ids the node allocated (a subset of refs)
    recomputable: bool = False
    reason: str = ""  # why a forward node may not be recomputed ("" when it may)
    op: str = ""
    temp_bytes: int = 0  # held beyond the outputs while the op runs (workspaces)
    copy_temp_bytes: int = 0  # more of it while its copy runs (a replay's saved RNG state)


@dataclass(frozen=True)
class Table:
    """A training graph as data. ``excluded`` storages (parameter gradients) are not
    activation memory and are left out of every timeline."""

    rows: tuple[Row, ...]
    storage_bytes: tuple[int, ...]
    excluded: frozenset[int] = frozenset()
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def build(
        names: Sequence[str],
        phases: Sequence[str],
        args: Sequence[Sequence[int]],
        storages: Sequence[int | None],
        times: Sequence[float] | None = None,
        blocked: Sequence[str] = (),
    ) -> Table:
        """A table where node i owns one storage of ``storages[i]`` bytes (None: none).

        Every forward node is recomputable except those named in ``blocked``: a compact
        way to write hand-built graphs in tests and docs.
        """
        sizes: list[int] = []
        rows = []
        for i, name in enumerate(names):
            owns: tuple[int, ...] = ()
            if storages[i] is not None:
                owns = (len(sizes),)
                sizes.append(int(storages[i]))
            candidate = phases[i] == FORWARD and name not in blocked
            rows.append(
                Row(
                    name=name,
                    phase=phases[i],
                    args=tuple(args[i]),
                    time_s=float(times[i]) if times is not None else 1.0,
                    refs=owns,
                    owns=owns,
                    recomputable=candidate,
                    reason="" if candidate or phases[i] != FORWARD else "blocked",
                )
            )
        return Table(tuple(rows), tuple(sizes))

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """users[i]: the rows that read row i, in graph order."""
        found: list[list[int]] = [[] for _ in self.rows]
        for j, row in enumerate(self.rows):
            for a in dict.fromkeys(row.args):
                found[a].append(j)
        return tuple(tuple(u) for u in found)

    @cached_property
    def owner(self) -> tuple[int, ...]:
        """owner[s]: the row that allocated storage s."""
        owners = [-1] * len(self.storage_bytes)
        for i, row in enumerate(self.rows):
            for s in row.owns:
                owners[s] = i
        return tuple(owners)

    @cached_property
    def boundary(self) -> int:
        """Index of the first backward row (the forward/backward boundary)."""
        for i, row in enumerate(self.rows):
            if row.phase in (BACKWARD, OUTPUT):
                return i
        return len(self.rows)

    @cached_property
    def holders(self) -> tuple[tuple[int, ...], ...]:
        """holders[s]: the rows whose value references storage s (owner, views, getitems)."""
        found: list[list[int]] = [[] for _ in self.storage_bytes]
        for i, row in enumerate(self.rows):
            for s in row.refs:
                found[s].append(i)
        return tuple(tuple(h) for h in found)

    def last_forward_use(self, i: int) -> int:
        """The last forward row that reads row i (i itself when none does)."""
        uses = [u for u in self.users[i] if self.rows[u].phase == FORWARD]
        return max(uses, default=i)

    def first_backward_use(self, i: int) -> int | None:
        """The first backward row that reads row i, or None."""
        return next((u for u in self.users[i] if self.rows[u].phase == BACKWARD), None)

    def sources(self, i: int) -> tuple[int, ...]:
        """The rows row i is recomputed from when nothing else is recomputed: its args."""
        return tuple(dict.fromkeys(self.rows[i].args))

    def index(self, name: str) -> int:
        """The row of the node called ``name``."""
        names = self._cache.get("names")
        if names is None:
            names = self._cache["names"] = {r.name: i for i, r in enumerate(self.rows)}
        return names[name]
