"""Which packed GEMM runs a linear layer faster on this machine: MKL's or oneDNN's.

Neither wins everywhere, and which one does depends on the CPU, the shape and the thread
count. On an Intel Xeon, MKL's packed GEMM beat oneDNN's linear on BERT-base (1.19x eager
against 1.03x at 128 rows, 1 thread); on an AMD EPYC, oneDNN's took 0.4-0.8x MKL's time at
2-32 rows (a Llama's projections and its 32000-word head, 1 and 2 threads), 0.9x at 128
and 1024 rows, while MKL stayed faster at 1 row on 1 thread (oneDNN took 1.5-1.8x its time
for the head). So the speed preset times both on the layer's own weight (its first rows,
for a large one), for the rows the example has (at most :data:`ROWS_TIMED`), once per
shape and thread count in a process; cold (the weight out of cache) for a model whose
weights do not fit in the cache, as each call then reads them from memory.

Both kernels compute ``x @ Wᵀ + b`` for every input, NaN, ±inf and -0.0 included (only the
summation order, hence rounding, differs from eager's, as between any two GEMMs).

    >>> import torch
    >>> from fxopt.passes.gemm_timing import faster_gemm
    >>> faster_gemm(torch.randn(64, 32), rows=4) in ("mkl", "onednn")
    True
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

#: Rows a GEMM is timed at, at most: at 128 and 1024 rows the two kernels' ratio was the
#: same within 0.1 (measured), and a 32000-word head at 1024 rows takes 0.3 s a call.
ROWS_TIMED = 256
#: Weight elements timed at most: a larger weight is timed on its first output rows (each
#: kernel packs its own copy; a 2 GiB LM head packed twice would cost 4 GiB for a timing).
ELEMENTS_TIMED = 4 * 2**20
#: Timing per kernel and shape: calls at most, and seconds at most (at least 3 calls).
CALLS, SECONDS = 9, 0.15
#: Timed cold: copies of a weight at most, and their bytes at most (memory held while
#: timing); the cache assumed where none is reported.
MAX_COPIES, MAX_ROTATION_BYTES, DEFAULT_CACHE_BYTES = 256, 128 * 2**20, 32 * 2**20
#: oneDNN is chosen only when faster by this factor: MKL's packed GEMM is the kernel
#: torch.compile runs for float32 linears after freezing, and timing is noisy.
MARGIN = 0.95
#: The factor at one row (a decode step at batch 1), where timing alone favours oneDNN: in
#: a Llama decode step (1 thread, AMD EPYC) each shape's oneDNN/MKL time ratio was
#: 1.1-1.4x the ratio timed alone (in rotation, or in a sequence of the step's GEMMs
#: without its other ops), and with the choice made at 0.95 the step ran 1-7% slower than
#: with MKL's everywhere (8.49 against 7.94 ms at 1024 tokens).
MARGIN_ONE_ROW = 0.6

#: ``"mkl"`` or ``"onednn"`` to skip the timing and use that GEMM wherever it applies (a
#: reproducible kernel choice: tests, comparisons); None: timed.
FORCED: str | None = None

#: True or False to skip the timing of :func:`stacked_is_faster` and answer that.
FORCED_STACKING: bool | None = None

_chosen: dict[tuple, tuple[str, float]] = {}
_stacked: dict[tuple, float] = {}


def faster_gemm(
    weight: torch.Tensor, rows: int, *, cold: bool = False, shared: bool = False
) -> str:
    """``"mkl"`` or ``"onednn"``: the packed GEMM that runs ``x @ weight.T`` faster for
    ``rows`` rows of ``x`` here (``"onednn"`` in a build without MKL). ``cold``: timed
    with the weight out of the CPU's caches, as in a model whose weights do not fit in them
    (:func:`weights_stream`). ``shared``: no packed copy of the weight, so ``"mkl"`` is
    torch's own linear (MKL on the dense weight) and ``"onednn"`` oneDNN's linear on the
    dense weight."""
    return choice(weight, rows, cold=cold, shared=shared)[0]


def choice(
    weight: torch.Tensor, rows: int, *, cold: bool = False, shared: bool = False
) -> tuple[str, float]:
    """(the faster GEMM, oneDNN's time over MKL's), timed once per weight shape, rows,
    cache state, sharing and thread count in this process."""
    if not torch._C.has_mkl:
        return "onednn", float("nan")
    if FORCED is not None:
        return FORCED, float("nan")
    rows = max(1, min(int(rows), ROWS_TIMED))
    key = (tuple(weight.shape), weight.dtype, rows, cold, shared, torch.get_num_threads())
    if key not in _chosen:
        outputs = max(1, min(weight.shape[0], ELEMENTS_TIMED // max(1, weight.shape[1])))
        mkl, onednn = _timed(weight.detach()[:outputs], rows, cold, shared)
        ratio = onednn / mkl
        margin = MARGIN_ONE_ROW if rows == 1 else MARGIN
        _chosen[key] = ("onednn" if ratio < margin else "mkl", ratio)
    return _chosen[key]


def stacked_is_faster(weights: Sequence[torch.Tensor], rows: int, *, cold: bool = False) -> bool:
    """Whether one MKL packed GEMM over ``weights`` stacked (linears reading the same
    input, their outputs side by side) runs faster than one packed GEMM per weight, for
    ``rows`` rows. Timed once per shapes, rows, cache state and thread count in this
    process, on random weights of those shapes (their first rows, in proportion, past
    :data:`ELEMENTS_TIMED` in all); stacked must take under :data:`MARGIN` of the time."""
    if not torch._C.has_mkl:
        return False
    if FORCED_STACKING is not None:
        return FORCED_STACKING
    rows = max(1, min(int(rows), ROWS_TIMED))
    shapes = tuple(tuple(w.shape) for w in weights)
    key = (shapes, weights[0].dtype, rows, cold, torch.get_num_threads())
    if key not in _stacked:
        scale = min(1.0, ELEMENTS_TIMED / sum(w.numel() for w in weights))
        sized = [torch.randn(max(1, int(n * scale)), k, dtype=weights[0].dtype) for n, k in shapes]
        separate, stacked = _timed_stacking(sized, rows, cold)
        _stacked[key] = stacked / separate
    return _stacked[key] < MARGIN


def _timed_stacking(weights: list[torch.Tensor], rows: int, cold: bool) -> tuple[float, float]:
    """Median seconds of one packed GEMM per weight, called in turn, and of one over the
    weights stacked (:func:`_time_kernels`)."""
    x = torch.randn(rows, weights[0].shape[1], dtype=weights[0].dtype)
    stacked = torch.cat(weights)

    def pack_each() -> list[torch.Tensor]:
        return [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]

    def each(packed: list[torch.Tensor]) -> None:
        for p, w in zip(packed, weights):
            torch.ops.mkl._mkl_linear(x, p, w, None, rows)

    kernels = [
        (pack_each, each),
        (
            lambda: torch.ops.mkl._mkl_reorder_linear_weight(stacked, rows),
            lambda packed: torch.ops.mkl._mkl_linear(x, packed, stacked, None, rows),
        ),
    ]
    separate, together = _time_kernels(kernels, stacked.nbytes, cold)
    return separate, together


def weights_stream(weight_bytes: int) -> bool:
    """Whether a model with ``weight_bytes`` of weights reads each one from memory on each
    call (they exceed the last-level cache): then its GEMMs are timed cold."""
    return weight_bytes > cache_bytes()


@functools.cache
def cache_bytes() -> int:
    """The CPU's last-level cache (Linux: sysfs), else :data:`DEFAULT_CACHE_BYTES`."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * _UNITS.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes, default=DEFAULT_CACHE_BYTES)


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}


def _timed(weight: torch.Tensor, rows: int, cold: bool, shared: bool) -> tuple[float, float]:
    """Median seconds of MKL's and oneDNN's packed GEMM on ``rows`` random rows
    (:func:`_time_kernels`)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    kernels = [
        (
            lambda: torch.ops.mkl._mkl_reorder_linear_weight(weight, rows),
            lambda packed: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows),
        ),
        (
            lambda: torch.ops.mkldnn._reorder_linear_weight(weight, None),
            lambda packed: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        ),
    ]
    if shared:  # each copy as it is, read by torch's linear and by oneDNN's
        kernels = [
            (weight.clone, lambda dense: torch.nn.functional.linear(x, dense)),
            (weight.clone, kernels[1][1]),
        ]
    mkl, onednn = _time_kernels(kernels, weight.nbytes, cold)
    return mkl, onednn


def _time_kernels(kernels: list, nbytes: int, cold: bool) -> list[float]:
    """Median seconds of each ``(make operand, call on it)`` kernel. Hot: all timed
    interleaved on one operand each (a load change hits all). Cold: each timed in turn over
    operands of ``nbytes`` each that together fill twice the cache, called in rotation, so
    each call finds its operand evicted (a 64 MiB write between calls costs 40-100 ms here;
    a rotation costs what the calls do)."""
    copies = 1
    if cold:
        rotation = min(2 * cache_bytes(), MAX_ROTATION_BYTES)
        copies = max(1, min(-(-rotation // max(1, nbytes)), MAX_COPIES))
    with torch.inference_mode():
        if copies == 1:
            calls = [partial(call, make()) for make, call in kernels]
            return [statistics.median(times) for times in interleaved(calls)]
        medians = []
        for make, call in kernels:  # in turn: every kernel's copies at once would cost more
            calls = [partial(call, make()) for _ in range(copies)]
            medians.append(statistics.median(t for times in interleaved(calls) for t in times))
            del calls
        return medians


def interleaved(calls: list, rounds: int = CALLS, seconds: float = SECONDS) -> list[list[float]]:
    """Seconds of each call, called in turn for ``rounds`` rounds (fewer when past
    ``seconds``, at least 3), after one untimed round (first calls load code)."""
    samples: list[list[float]] = [[] for _ in calls]
    for call in calls:
        call()
    began = time.perf_counter()
    while len(samples[0]) < rounds and (
        len(samples[0]) < 3 or time.perf_counter() - began < seconds
    ):
        for call, times in zip(calls, samples):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return samples
