"""Peak memory of a job, per phase: what decides whether a machine can run it.

A phase's peak is the process's resident high-water mark while it ran (Linux: ``VmHWM``
in ``/proc/self/status``, reset at each phase boundary by writing ``5`` to
``/proc/self/clear_refs``), and on an accelerator the allocator's peak
(``torch.accelerator``'s ``max_memory_allocated``, reset the same way). Resetting the
kernel's mark would hide an earlier, higher peak from whoever reads it later (a benchmark
around the job), so every reset first folds the mark into :func:`process_peak`, which
keeps the highest value seen since :func:`reset_process_peak`.

Where the mark cannot be read or reset (not Linux, a locked-down ``/proc``), phases
report ``None`` and the report says the method was ``"unavailable"``.

    >>> from fxopt.memory import MemoryPhases
    >>> phases = MemoryPhases()
    >>> with phases("capture"):
    ...     block = bytearray(8 << 20)
    >>> report = phases.report(weight_bytes=1 << 20)
    >>> sorted(report)[:3]
    ['baseline_bytes', 'method', 'peak_beyond_baseline_bytes']
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from fxopt.errors import NotEnoughMemoryError

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
#: The highest resident mark seen before the kernel's was last reset (bytes).
_folded_peak = 0


def resident_bytes() -> int | None:
    """The process's resident set now (``VmRSS``), or None where it cannot be read."""
    return _status_field("VmRSS:")


def _hwm() -> int | None:
    return _status_field("VmHWM:")


def _status_field(key: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    """Set the kernel's high-water mark to the current resident set, after folding it
    into the process peak; False where this process cannot."""
    global _folded_peak
    mark = _hwm()
    if mark is None:
        return False
    _folded_peak = max(_folded_peak, mark)
    try:
        with open(_CLEAR_REFS, "w") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def process_peak() -> int | None:
    """The highest resident set of this process since :func:`reset_process_peak` (or its
    start), including marks fxopt's phases reset; None where it cannot be read."""
    mark = _hwm()
    return None if mark is None else max(mark, _folded_peak)


def reset_process_peak() -> None:
    """Start :func:`process_peak` again from the current resident set (as a benchmark does
    once the model and its inputs are built)."""
    global _folded_peak
    _reset_hwm()
    _folded_peak = resident_bytes() or 0


def release_free_memory() -> None:
    """Give the memory the C allocator holds in freed blocks back to the system (glibc's
    ``malloc_trim``; nothing elsewhere). After a large transient working set (a profile
    run of a training graph), glibc keeps much of it resident, and the next phase's peak
    stacks on top of it."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _find_malloc_trim()
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: object = None


def _find_malloc_trim():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers, each storage counted once (tied
    weights share one)."""
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _accelerator() -> object | None:
    """``torch.accelerator`` when this process has one with memory statistics."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return None
    if not hasattr(accelerator, "max_memory_allocated"):
        return None
    return accelerator


class MemoryPhases:
    """``with phases("name"): ...`` records the peak resident bytes (and the accelerator's
    peak allocation, when there is one) while the block ran. Phases may nest: an inner
    phase's peak also counts for the phases around it. A phase entered twice keeps the
    higher peak."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and _hwm() is not None
        self.baseline = resident_bytes() if self.enabled else None
        self.peaks: dict[str, int] = {}
        #: The resident set when each phase ended: what it left behind for the next.
        self.after: dict[str, int] = {}
        self.device_peaks: dict[str, int] = {}
        self._open: list[str] = []
        self._device = _accelerator() if enabled else None
        self._device_baseline = self._device.memory_allocated() if self._device else None

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self._boundary()
        self._open.append(name)
        try:
            yield
        finally:
            self._boundary()
            self._open.pop()
            now = resident_bytes()
            if now is not None:
                self.after[name] = now

    def _boundary(self) -> None:
        """Credit the mark since the last boundary to every open phase, then reset it."""
        mark = _hwm()
        device_mark = self._device.max_memory_allocated() if self._device else None
        for name in self._open:
            if mark is not None:
                self.peaks[name] = max(self.peaks.get(name, 0), mark)
            if device_mark is not None:
                self.device_peaks[name] = max(self.device_peaks.get(name, 0), device_mark)
        _reset_hwm()
        if self._device is not None:
            self._device.reset_peak_memory_stats()

    def report(self, weight_bytes: int | None = None) -> dict:
        """The ``report["memory"]`` dict: bytes per phase, the job's peak, and the peak
        beyond the resident set when the job started (which holds the model) as bytes and
        as a multiple of ``weight_bytes``."""
        peak = max(self.peaks.values(), default=None)
        beyond = None if peak is None or self.baseline is None else max(0, peak - self.baseline)
        out: dict = {
            "method": "VmHWM" if self.enabled else "unavailable",
            "baseline_bytes": self.baseline,
            "phases_peak_bytes": dict(self.peaks),
            "phases_end_bytes": dict(self.after),
            "peak_bytes": peak,
            "peak_beyond_baseline_bytes": beyond,
            "weight_bytes": weight_bytes,
            "peak_beyond_baseline_x_weights": (
                round(beyond / weight_bytes, 3) if beyond is not None and weight_bytes else None
            ),
        }
        if self._device is not None:
            out["device_baseline_bytes"] = self._device_baseline
            out["device_phases_peak_bytes"] = dict(self.device_peaks)
        return out


def gib(count: int) -> str:
    """``count`` bytes for a person: 6.1 GiB, 340 MiB, 12 KiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}" if unit == "GiB" else f"{count / size:.0f} {unit}"
    return f"{count} bytes"


#: Peak memory beside the model a job needs: a multiple of its weight bytes plus a part that
#: does not grow with it (fxopt's and torch's own code and objects). From the peaks
#: benchmarks/memory.py measures on Llama-shaped models of 0.2-5.8 GiB, with a margin:
#: optimize +0.17 to +0.28 GiB whatever the size, beyond any candidate holding a copy of
#: weights (0.36 GiB on the 0.18 GiB model, whose packed copy is raced: the layout step
#: builds one only where it fits, and a large one only for a clear gain, so it adds
#: nothing here); convert with the weights inside the file (under
#: 2 GiB) 1.17x at 0.7 GiB (built in memory, the weights passes made moved into it, then
#: run), with the weights after it
#: (streamed to disk) 0.98-0.99x at 3.2 and 5.8 GiB validated (the runtime maps the file),
#: 0.28x not validated.
FIXED_BYTES = 3 * 2**30 // 10
OPTIMIZE_FACTOR = 0.1
CONVERT_FACTOR = 1.4
CONVERT_STREAMED_FACTOR = 1.1
CONVERT_STREAMED_UNVALIDATED_FACTOR = 0.4


def check_room(job: str, weights: int, factor: float, lower: str) -> None:
    """Refuse a job that needs more memory beside the model (``factor`` × ``weights`` +
    :data:`FIXED_BYTES`, a measured peak) than the machine has available, in one line
    naming the figures and ``lower``: what lowers the need (instead of the kernel killing
    the process midway).

        >>> check_room("optimize", 1024, 0.5, "")        # a kilobyte: always room
    """
    need = int(weights * factor) + FIXED_BYTES
    room = available_bytes()
    if room is None or need <= room:
        return
    raise NotEnoughMemoryError(
        f"{job} needs about {gib(need)} of memory beside the model ({factor:g}x its "
        f"{gib(weights)} of weights and {gib(FIXED_BYTES)}, measured on models of its kind) "
        f"and this machine has {gib(room)} available; {lower}"
    )


def available_bytes() -> int | None:
    """Memory the machine can still give this process (``MemAvailable``, Linux; or the
    cgroup limit minus usage when that is lower), or None where it cannot be read."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    limit = _cgroup_room()
    if limit is not None:
        available = limit if available is None else min(available, limit)
    return available


def _cgroup_room() -> int | None:
    """cgroup v2 ``memory.max - memory.current`` of this process's group, when limited."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/cgroup") as cgroup:
            path = cgroup.read().strip().split("::", 1)[-1]
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            text = f.read().strip()
        if text == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(text) - int(f.read().strip())
    return None
