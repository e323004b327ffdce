"""Helpers shared by the benchmark scripts: machine description, timing, JSON output.

Scripts in this folder run as ``python benchmarks/<name>.py``, so this module is imported
as ``common`` (Python puts the script's folder on ``sys.path``).

Timing follows docs/measuring.md: one intra-op thread, CPU time
(``time.process_time``) rather than wall time, variants interleaved round-robin, medians.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gc
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# The profiler (memory measurements) otherwise prints a USDT line per profiling session
# into the benchmark logs (read when a profiler starts, so after importing torch is fine).
os.environ.setdefault("KINETO_LOG_LEVEL", "9")

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def machine_info() -> dict[str, Any]:
    """What ran the benchmark: enough to tell two runs' machines and versions apart."""
    try:
        from importlib.metadata import version

        fxopt_version = version("fxopt")
    except Exception:  # not installed: running from a checkout
        fxopt_version = "unknown"
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fxopt": fxopt_version,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


class Timeout(BaseException):
    """A timed call ran longer than its limit (wall clock). A BaseException, like
    KeyboardInterrupt, so that the ``except Exception`` of the code being timed (fxopt's
    PassManager turns errors into PassError) lets it through."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`Timeout` inside the block after ``seconds`` of wall time (main thread,
    POSIX only). Pure-Python code is interrupted between bytecodes; a long C call is not."""
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise Timeout(f"longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(fn: Callable[[], Any], *, limit: float | None = None) -> tuple[Any, float, float]:
    """Call ``fn()`` once; return (result, CPU seconds, wall seconds).

    The cyclic garbage collector is paused during the call (as ``timeit`` does), after a
    full collection, so a collection triggered by an earlier graph is not billed to ``fn``.
    """
    gc.collect()
    gc.disable()
    try:
        with time_limit(limit):
            wall, cpu = time.perf_counter(), time.process_time()
            result = fn()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        gc.enable()
    return result, cpu, wall


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def command_line() -> str:
    return " ".join(
        ["python", *(sys.argv[:1] and [os.path.relpath(sys.argv[0], ROOT)]), *sys.argv[1:]]
    )
