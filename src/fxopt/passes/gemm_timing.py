"""Which packed GEMM runs a linear layer faster on this machine: MKL's or oneDNN's.

Neither wins everywhere, and which one does depends on the CPU, the shape and the thread
count. On an Intel Xeon, MKL's packed GEMM beat oneDNN's linear on BERT-base (1.19x eager
against 1.03x at 128 rows, 1 thread); on an AMD EPYC, oneDNN's took 0.4-0.8x MKL's time at
2-32 rows (a Llama's projections and its 32000-word head, 1 and 2 threads), 0.9x at 128
and 1024 rows, while MKL stayed faster at 1 row on 1 thread (0.56x for the head). So the
speed preset times both on the layer's own weight, for the rows the example has (at most
:data:`ROWS_TIMED`), once per shape and thread count in a process.

Both kernels compute ``x @ Wᵀ + b`` for every input, NaN, ±inf and -0.0 included (only the
summation order, hence rounding, differs from eager's, as between any two GEMMs).

    >>> import torch
    >>> from fxopt.passes.gemm_timing import faster_gemm
    >>> faster_gemm(torch.randn(64, 32), rows=4) in ("mkl", "onednn")
    True
"""

from __future__ import annotations

import statistics
import time

import torch

#: Rows a GEMM is timed at, at most: at 128 and 1024 rows the two kernels' ratio was the
#: same within 0.1 (measured), and a 32000-word head at 1024 rows takes 0.3 s a call.
ROWS_TIMED = 256
#: Timing per kernel and shape: calls at most, and seconds at most (at least 3 calls).
CALLS, SECONDS = 9, 0.15
#: oneDNN is chosen only when faster by this factor: MKL's packed GEMM is the kernel
#: torch.compile runs for float32 linears after freezing, and timing is noisy.
MARGIN = 0.95

#: ``"mkl"`` or ``"onednn"`` to skip the timing and use that GEMM wherever it applies (a
#: reproducible kernel choice: tests, comparisons); None: timed.
FORCED: str | None = None

_chosen: dict[tuple, tuple[str, float]] = {}


def faster_gemm(weight: torch.Tensor, rows: int) -> str:
    """``"mkl"`` or ``"onednn"``: the packed GEMM that runs ``x @ weight.T`` faster for
    ``rows`` rows of ``x`` here (``"onednn"`` in a build without MKL)."""
    return choice(weight, rows)[0]


def choice(weight: torch.Tensor, rows: int) -> tuple[str, float]:
    """(the faster GEMM, oneDNN's time over MKL's), timed once per weight shape, rows and
    thread count in this process."""
    if not torch._C.has_mkl:
        return "onednn", float("nan")
    if FORCED is not None:
        return FORCED, float("nan")
    rows = max(1, min(int(rows), ROWS_TIMED))
    key = (tuple(weight.shape), weight.dtype, rows, torch.get_num_threads())
    if key not in _chosen:
        mkl, onednn = _timed(weight.detach(), rows)
        ratio = onednn / mkl
        _chosen[key] = ("onednn" if ratio < MARGIN else "mkl", ratio)
    return _chosen[key]


def _timed(weight: torch.Tensor, rows: int) -> tuple[float, float]:
    """Median seconds of MKL's and oneDNN's packed GEMM on ``rows`` random rows, timed
    interleaved (a load change hits both)."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    with torch.inference_mode():
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        onednn_packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        calls = (
            lambda: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, rows),
            lambda: torch.ops.mkldnn._linear_pointwise(x, onednn_packed, None, "none", [], ""),
        )
        samples: tuple[list, list] = ([], [])
        for call in calls:  # warm-up: first calls allocate and load code
            call()
        began = time.perf_counter()
        while len(samples[0]) < CALLS and (
            len(samples[0]) < 3 or time.perf_counter() - began < SECONDS
        ):
            for call, times in zip(calls, samples):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
    return statistics.median(samples[0]), statistics.median(samples[1])
