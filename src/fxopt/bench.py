"""Measure latency, peak memory and graph size, device-agnostically.

    >>> import torch
    >>> from fxopt.bench import measure_latency, peak_memory, graph_stats
    >>> m = torch.nn.Linear(8, 8)
    >>> stats = measure_latency({"eager": m}, (torch.randn(2, 8),), runs=5, warmup=1)
    >>> stats["eager"]["runs"], stats["eager"]["median_ms"] > 0
    (5, True)

Latency interleaves the variants round-robin (each call of A is followed by a call of B),
so drifting machine load hits both alike, and synchronizes the device around every call.
On a CPU running one intra-op thread it times process CPU time, which is steadier than
wall time under load on shared machines (see docs/measuring.md); otherwise wall time.
"""

from __future__ import annotations

import random
import statistics
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxopt import caches
from fxopt.ir import ops


def _devices(inputs: Sequence) -> set[torch.device]:
    return {x.device for x in tree_leaves(list(inputs)) if isinstance(x, torch.Tensor)}


def synchronize(devices: set[torch.device]) -> None:
    """Wait for queued work on every non-CPU device in ``devices``."""
    for device in devices:
        if device.type != "cpu":
            getattr(torch, device.type).synchronize(device)


def default_clock(inputs: Sequence) -> str:
    on_cpu = all(d.type == "cpu" for d in _devices(inputs))
    return "process" if on_cpu and torch.get_num_threads() == 1 else "wall"


#: Timed calls per variant that :func:`measure_latency` makes whatever its budget.
MIN_RUNS = 5


def measure_latency(
    variants: Mapping[str, Callable],
    inputs: Sequence,
    *,
    runs: int = 50,
    warmup: int = 5,
    clock: str | None = None,
    budget_s: float | None = None,
) -> dict[str, dict[str, float]]:
    """Latency statistics in milliseconds for each variant, measured interleaved.

    With ``budget_s``, a model whose calls take seconds is not timed for minutes: warm-up
    ends after a round that alone took a tenth of the budget, and timing after the round
    that passes the budget (wall time, warm-up included), once :data:`MIN_RUNS` rounds
    have run. ``runs`` in each variant's statistics says how many calls were timed.

        >>> import torch
        >>> stats = measure_latency({"relu": torch.relu}, (torch.randn(4),), runs=3, warmup=1)
        >>> stats["relu"]["runs"]
        3
    """
    clock = clock or default_clock(inputs)
    timer = time.process_time if clock == "process" else time.perf_counter
    devices = _devices(inputs)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    began = time.perf_counter()
    call_inputs = caches.per_call(tuple(inputs))
    with torch.inference_mode():
        for _ in range(warmup):
            round_began = time.perf_counter()
            for fn in variants.values():
                fn(*call_inputs())
            if budget_s is not None and time.perf_counter() - round_began > budget_s / 10:
                break
        synchronize(devices)
        for round_ in range(runs):
            for name, fn in variants.items():
                args = call_inputs()
                start = timer()
                fn(*args)
                synchronize(devices)
                samples[name].append((timer() - start) * 1e3)
            over = budget_s is not None and time.perf_counter() - began > budget_s
            if over and round_ + 1 >= MIN_RUNS:
                break
    return {
        name: summarize(values) | {"clock": clock, "samples_ms": values}
        for name, values in samples.items()
    }


def summarize(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "median_ms": statistics.median(ordered),
        "mean_ms": statistics.fmean(ordered),
        "std_ms": statistics.pstdev(ordered),
        "min_ms": ordered[0],
        "max_ms": ordered[-1],
        "p95_ms": p95,
        "runs": len(ordered),
    }


#: A speedup within this of 1 is not claimed: ratios measured here move by up to ~0.1
#: between runs of the same comparison (docs/measuring.md), half of that either way.
NOISE_BAND = 0.05


def speedup_of(baseline_ms: Sequence[float], candidate_ms: Sequence[float]) -> dict:
    """The speedup of ``candidate`` over ``baseline`` from interleaved samples: the median
    of per-round ratios with its 95 % interval, and whether it is within noise (the
    interval holds 1, or the median is within :data:`NOISE_BAND` of it).

    >>> s = speedup_of([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.1])
    >>> round(s["median"], 3), s["within_noise"]
    (1.95, False)
    """
    ratio = paired_ratio(baseline_ms, candidate_ms)
    low, high = ratio["ci95"]
    within = low <= 1.0 <= high or abs(ratio["median"] - 1.0) <= NOISE_BAND
    return {"median": ratio["median"], "ci95": [low, high], "within_noise": within}


def paired_ratio(
    ours: Sequence[float], theirs: Sequence[float], *, resamples: int = 2000, seed: int = 0
) -> dict:
    """Median of ``ours[i] / theirs[i]`` over rounds, with a 95 % bootstrap interval.

    Pair the samples that ran back to back (one round of an interleaved measurement): a
    drift of the machine's speed moves both samples of a round, not their ratio, so the
    median ratio is steadier than the ratio of the two medians.

    >>> r = paired_ratio([1.1, 2.2, 3.3, 1.1], [1.0, 2.0, 3.0, 1.0])
    >>> round(r["median"], 6), r["rounds"]
    (1.1, 4)
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired_ratio needs equal, non-empty samples: {len(ours)}, {len(theirs)}")
    ratios = [a / b for a, b in zip(ours, theirs)]
    pick = random.Random(seed)
    medians = sorted(
        statistics.median(pick.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    return {
        "median": statistics.median(ratios),
        "ci95": [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]],
        "rounds": len(ratios),
    }


class StorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages that op outputs create, sampled after every op.

    Each new storage is counted once (keyed by its C pointer), at its size when first seen,
    and released through a weakref callback when Python frees it; storages of the
    ``preexisting`` tensors (inputs, parameters) and empty storages are never counted.
    ``peak`` is the most live at once, ``after_op`` the live bytes right after each op.
    Works on any device; compiled code does not run under a dispatch mode, so use the
    profiler for that (benchmarks and :func:`fxopt.remat.measure.measure_step` do).

    >>> x = torch.randn(64)
    >>> with StorageTracker([x]) as tracker:
    ...     y = (x * 2).view(8, 8).t()  # a view shares its base's storage
    >>> tracker.peak, tracker.after_op
    (256, [256, 256, 256])
    """

    def __init__(self, preexisting: Iterable[object] = ()):
        super().__init__()
        self.preexisting = _storage_keys(preexisting)
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.after_op: list[int] = []
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._record(t)
        self.peak = max(self.peak, self.current)
        self.after_op.append(self.current)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self.preexisting or key in self.live or size == 0:
            return
        self.live[key] = size
        self.current += size
        self._refs.append(weakref.ref(storage, lambda _, key=key: self._release(key)))

    def _release(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)


def _storage_keys(tensors: Iterable[object]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def peak_memory(module: nn.Module, inputs: Sequence, *, grad: bool = False) -> dict[str, int]:
    """Peak bytes of tensor storage allocated during one call (excluding inputs and weights).

    On CUDA the allocator's ``max_memory_allocated`` is reported as well.
    """
    existing = [*tree_leaves(list(inputs)), *module.parameters(), *module.buffers()]
    devices = _devices(inputs)
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        torch.cuda.reset_peak_memory_stats(cuda[0])
        base = torch.cuda.memory_allocated(cuda[0])
    tracker = StorageTracker(existing)
    context = torch.enable_grad() if grad else torch.no_grad()
    with context, tracker:
        out = module(*inputs)
        synchronize(devices)
    del out
    result = {"peak_bytes": tracker.peak}
    if cuda:
        result["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(cuda[0]) - base
    return result


def graph_stats(gm: fx.GraphModule) -> dict:
    """Node count, compute-node count and counts by canonical op name."""
    counts: Counter[str] = Counter()
    compute = 0
    checks = 0  # the input guard of an optimized module: a check, not part of the model
    for node in gm.graph.nodes:
        if ops.is_compute(node):
            op = ops.info(node, gm)
            if not op.compute:
                checks += 1
                continue
            compute += 1
            counts[op.name] += 1
    return {
        "nodes": len(gm.graph.nodes) - checks,
        "compute_nodes": compute,
        "ops": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
    }
