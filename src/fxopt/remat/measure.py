"""Measure a training step's activation memory: the peak, and what is saved for backward.

Both figures exclude parameters (allocated before the step) and parameter gradients (on
CPU they dominate the raw peak and hide what remat does). They come from the torch
profiler's allocation events (``profile_memory=True``), which see eager code, fx graphs
and compiled code alike:

1. walk the event tree and collect every ``Allocation`` event as (time, size, pointer);
   frees have negative sizes;
2. drop the allocation of each parameter gradient still alive at the end (the last
   allocation at that pointer), having set gradients to None before the step;
3. sort by time; the running sum's maximum is the **peak**, its value when the
   ``fxopt::boundary`` marker fires (between forward and backward) is the **saved**
   activations (plus the loss and other forward outputs).

Under a distributed wrapper a step also allocates the wrapper's own buffers: FSDP2's
gathered parameters, its reduce-scatter inputs, the unsharded gradients it consumes.
They are parameter-sized, not activation-sized, and no remat plan (nor checkpointing)
changes them. :attr:`Memory.activation_peak_bytes` and :attr:`Memory.activation_saved_bytes`
are the two figures without them: the blocks allocated, or freed, inside the wrapper's
profiler scopes (:data:`WRAPPER_SCOPES`) are left out with their whole lifetime. (FSDP2
keeps the root module's gathered parameters from the forward to the backward: without
this they count as saved.) Without a wrapper they equal the peak and the saved bytes.

The ``"[memory]"`` rows of ``prof.events()`` are not summed: allocations inside an op are
folded into it there. :class:`fxopt.bench.StorageTracker` (a ``TorchDispatchMode`` that
counts op output storages) is the independent cross-check used in tests; compiled code does
not run under a dispatch mode, so it cannot measure that.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
    ...                             torch.nn.Linear(256, 1))
    >>> x = torch.randn(32, 64)
    >>> def step():
    ...     loss = model(x).mean()
    ...     boundary()
    ...     loss.backward()
    >>> m = measure_step(step, model)
    >>> m.peak_bytes > m.saved_bytes >= 32 * 256 * 4  # the ReLU output is saved
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxopt.remat.native_output import KINETO_LOG, without_lines
from fxopt.remat.tags import BACKWARD, phase

MARKER = "fxopt::boundary"

#: Profiler scopes of a distributed wrapper's own work: FSDP2 names every all-gather,
#: copy-out, reduce-scatter and reshard ``FSDP::...``, and a process group runs each
#: collective, with the output buffers it allocates, in a scope named for its backend
#: (``gloo:all_gather``; on its own worker thread, so not inside FSDP's scope). DDP's
#: buckets are made outside a measured step (at construction, and again in the second).
WRAPPER_SCOPES = ("FSDP::", "gloo:", "nccl:", "ucc:", "mpi:", "xccl:")


def boundary() -> None:
    """Mark the forward/backward boundary in a profiled step."""
    with torch.profiler.record_function(MARKER):
        pass


@dataclass(frozen=True)
class Memory:
    """Activation memory of one step, in bytes."""

    peak_bytes: int
    saved_bytes: int | None  # None when the step had no boundary marker
    #: The two figures without the blocks a distributed wrapper allocated or freed in its
    #: own scopes (its buffers, not activations).
    activation_peak_bytes: int | None = None
    activation_saved_bytes: int | None = None


def measure_step(run: Callable[[], object], model: nn.Module) -> Memory:
    """Profile one call of ``run`` (a whole training step) and replay its allocations."""
    for p in model.parameters():
        p.grad = None
    with memory_profiler() as prof:
        run()
    events, marks, wrapper = _allocations(prof)
    grads = {_local(p.grad).data_ptr() for p in model.parameters() if p.grad is not None}
    marker = marks[0] if marks else None
    memory = replay(events, excluded_pointers=grads, marker=marker)
    own = replay(events, excluded_pointers=grads, excluded_events=wrapper, marker=marker)
    return dataclasses.replace(
        memory, activation_peak_bytes=own.peak_bytes, activation_saved_bytes=own.saved_bytes
    )


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A sharded gradient's (FSDP2's DTensor) own shard; a plain tensor itself."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def measure_total(run: Callable[[], object]) -> int:
    """Peak bytes ``run`` allocates on top of what exists when it starts (parameters, and
    optimizer state from earlier steps): activations, gradients, optimizer temporaries and
    anything new that outlives the call, such as a first step's optimizer state."""
    with memory_profiler() as prof:
        run()
    events, _, _ = _allocations(prof)
    return replay(events).peak_bytes


@contextlib.contextmanager
def memory_profiler() -> Iterator[torch.profiler.profile]:
    """The torch profiler with allocation events, started and stopped without kineto's log
    lines on stderr (``USDT:... profiler_start``, one per start and stop).

    Only the start and stop print, so only they run with kineto's lines filtered out
    (:mod:`fxopt.remat.native_output` says why it takes that); the step itself runs with
    stderr untouched.
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with without_lines(2, KINETO_LOG):
        prof.start()
    try:
        yield prof
    finally:
        with without_lines(2, KINETO_LOG):
            prof.stop()


def replay(
    events: list[tuple[int, int, int]],
    *,
    excluded_pointers: set[int] = frozenset(),
    excluded_events: set[tuple[int, int, int]] = frozenset(),
    marker: int | None = None,
) -> Memory:
    """Peak (and level at ``marker`` time) of allocation events (time, size, pointer).

    The last allocation at each excluded pointer (a live parameter gradient) and its
    frees are left out, and so is every block whose allocation or free is one of
    ``excluded_events`` (a wrapper's buffer), allocation and free both.

    >>> replay([(0, 10, 1), (1, 5, 2), (2, -10, 1), (3, 7, 3)], marker=1)
    Memory(peak_bytes=15, saved_bytes=15, activation_peak_bytes=None, activation_saved_bytes=None)
    >>> replay([(0, 10, 1), (1, 5, 2), (2, -10, 1), (3, 7, 3)], excluded_events={(2, -10, 1)})
    Memory(peak_bytes=12, saved_bytes=None, activation_peak_bytes=None, activation_saved_bytes=None)
    """
    events = sorted(events)
    skip = _lifetimes_of(events, excluded_events)
    last_alloc: dict[int, int] = {}
    for i, (_, size, ptr) in enumerate(events):
        if size > 0 and ptr in excluded_pointers:
            last_alloc[ptr] = i
    for ptr, i in last_alloc.items():
        skip.add(i)
        skip.update(j for j in range(i + 1, len(events)) if events[j][2] == ptr)
    live = peak = 0
    at_marker = None
    for i, (t, size, _) in enumerate(events):
        if marker is not None and at_marker is None and t > marker:
            at_marker = live
        if i in skip:
            continue
        live += size
        peak = max(peak, live)
    if marker is not None and at_marker is None:
        at_marker = live
    return Memory(peak, at_marker)


def _lifetimes_of(events: list[tuple[int, int, int]], chosen: set) -> set[int]:
    """Indices (into time-sorted ``events``) of each chosen event's block: its allocation
    and its free, the pair found by pointer in time order."""
    if not chosen:
        return set()
    skip: set[int] = set()
    allocated_at: dict[int, int] = {}
    for i, event in enumerate(events):
        ptr = event[2]
        if event[1] > 0:
            allocated_at[ptr] = i
            if event in chosen:
                skip.add(i)
            continue
        start = allocated_at.pop(ptr, None)
        if start in skip or event in chosen:
            skip.add(i)
            if start is not None:
                skip.add(start)
    return skip


def _allocations(prof) -> tuple[list[tuple[int, int, int]], list[int], set]:
    """Allocation events (time, size, pointer), the marker times, and the events inside a
    wrapper's scope."""
    allocation = torch._C._profiler._EventType.Allocation
    events: list[tuple[int, int, int]] = []
    marks: list[int] = []
    wrapper: set[tuple[int, int, int]] = set()
    stack = [(event, False) for event in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, in_wrapper = stack.pop()
        if event.typed[0] == allocation:
            found = (event.start_time_ns, event.typed[1].alloc_size, event.typed[1].ptr)
            events.append(found)
            if in_wrapper:
                wrapper.add(found)
            continue
        if event.name == MARKER:
            marks.append(event.start_time_ns)
        inside = in_wrapper or event.name.startswith(WRAPPER_SCOPES)
        stack.extend((child, inside) for child in event.children)
    return events, sorted(marks), wrapper


def with_boundary_marker(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a phase-tagged joint graph that calls :func:`boundary` before the first
    backward node, so :func:`measure_step` can read the saved activations."""
    from fxopt.ir.copying import shared_copy

    marked = shared_copy(gm)
    first = next((n for n in marked.graph.nodes if phase(n) == BACKWARD), None)
    if first is not None:
        with marked.graph.inserting_before(first):
            marked.graph.call_function(boundary)
        marked.recompile()
    return marked
