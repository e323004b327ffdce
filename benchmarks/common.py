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
# `make bench-quick` points this elsewhere, so short runs never overwrite the full ones.
RESULTS = Path(os.environ.get("FXOPT_RESULTS") or ROOT / "results")


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


#: glibc malloc settings under which a steady-state model call takes no page faults: a
#: 32 MiB mmap threshold (the largest glibc accepts), no trimming of the heap top, 256 MiB
#: of top padding. With glibc's defaults what a call costs depends on the process's
#: allocation history: eager MobileNetV2 at batch 8 (224 px, 1 thread) measured 261 ms and
#: 75.6k minor page faults per call in a fresh process, 169 ms and 28k faults after a
#: ``torch.jit.trace`` of the same model, and 133 ms (9k faults) with these settings. Two
#: processes (the in-process variants and a torch.compile worker) then disagree about eager
#: by up to 2x, and every ratio inherits it.
STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(2**40),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}


def steady_allocator() -> dict[str, str]:
    """Restart this script under :data:`STEADY_MALLOC` unless it already runs under it
    (glibc reads these variables once, at start-up); returns the settings, for the JSON.
    Worker subprocesses inherit the environment."""
    if any(os.environ.get(k) != v for k, v in STEADY_MALLOC.items()):
        env = os.environ | STEADY_MALLOC
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return dict(STEADY_MALLOC)


def command_line() -> str:
    """The command that ran, as anyone could type it in a checkout: paths inside it relative
    to it, other absolute paths (a scratch file, a peer's checkout) as ``…/<name>``."""
    return " ".join(
        ["python", *map(portable_path, sys.argv[:1]), *map(portable_path, sys.argv[1:])]
    )


def portable_path(argument: str) -> str:
    """``argument`` without this machine's directories (see :func:`command_line`)."""
    if not os.path.isabs(argument):
        return argument
    path = Path(argument).resolve()
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    return f"…/{path.name}"
