"""Wall time and peak memory per named phase of a long job (:mod:`fxopt.memory`), and a
hook called as each phase starts (the CLI prints a progress line there when stderr is not
a terminal).

    >>> from fxopt.phases import Phases
    >>> started = []
    >>> phases = Phases(on_start=started.append)
    >>> with phases("capture"):
    ...     pass
    >>> with phases("capture"):  # a phase entered twice adds up
    ...     pass
    >>> list(phases.seconds), started
    (['capture'], ['capture', 'capture'])
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from fxopt.memory import MemoryPhases


class Phases:
    """``with phases("name"): ...`` adds the block's wall time to ``seconds["name"]`` and
    records its peak memory in ``memory`` (``memory=False``: not measured)."""

    def __init__(self, on_start: Callable[[str], object] | None = None, *, memory: bool = True):
        self.seconds: dict[str, float] = {}
        self.memory = MemoryPhases(enabled=memory)
        self._on_start = on_start

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self._on_start is not None:
            self._on_start(name)
        start = time.perf_counter()
        try:
            with self.memory(name):
                yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def rounded(self, digits: int = 3) -> dict[str, float]:
        """``seconds`` rounded, for reports."""
        return {name: round(s, digits) for name, s in self.seconds.items()}
