"""Replay RNG state so random forward ops (dropout) can be recomputed in the backward.

A recomputed ``native_dropout`` must draw the same mask as the forward did. Like
``torch.utils.checkpoint``, remat replays the generator state instead of keeping the mask:

* after capture, the ``add-snapshots`` pass (:mod:`fxopt.remat.snapshots`) puts a
  ``state_of(device)`` node right before each forward random op whose value the backward
  may need, and links the two in node meta;
* the cost table treats the snapshot as an extra input of its random op, so a plan that
  recomputes the op keeps the snapshot alive until the copy (one ~5 KB tensor on CPU, 16
  bytes of seed and offset on CUDA);
* the ``recompute`` pass (:mod:`fxopt.remat.rewrite`) copies a recomputed random op as
  ``replay(device, state, op, *args)``, which sets ``state``, runs ``op`` and restores the
  generator, so the RNG stream after a step is exactly eager's; snapshots that no copy
  reads are erased.

Only the default generator of the op's device is replayed: an op given an explicit
``generator=`` stays not recomputable (see :func:`why_not_replayable`).

    >>> import torch
    >>> state = state_of("cpu")
    >>> a = torch.rand(3)
    >>> b = replay("cpu", state, torch.rand, 3)   # the same draw again
    >>> torch.equal(a, b), torch.equal(torch.rand(3), replay("cpu", state_of("cpu"), torch.rand, 3))
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from fxopt.ir import ops
from fxopt.ir.spec import runtime_helper

RNG_STATE = "fxopt.rng_state"  # on a random node: the name of its snapshot node
SNAPSHOT_OF = "fxopt.rng_snapshot_of"  # on a snapshot node: the name of its random node


@runtime_helper
def state_of(device: str) -> torch.Tensor:
    """The default generator's state on ``device`` (a copy: later draws don't change it).

    >>> state_of("cpu").dtype, state_of("cpu").numel()
    (torch.uint8, 5056)
    """
    d = torch.device(device)
    if d.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(d.type).get_rng_state(d)


def set_state(device: str, state: torch.Tensor) -> None:
    """Set the default generator of ``device`` to ``state`` (from :func:`state_of`)."""
    d = torch.device(device)
    if d.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(d.type).set_rng_state(state, d)


@runtime_helper
def replay(device: str, state: torch.Tensor, op: Callable, *args, **kwargs):
    """``op(*args, **kwargs)`` drawing from ``state``; the generator is left as it was.

    Restoring afterwards keeps the global RNG sequence exactly eager's: a replay in the
    backward draws nothing from the stream later ops see.
    """
    saved = state_of(device)
    set_state(device, state)
    try:
        return op(*args, **kwargs)
    finally:
        set_state(device, saved)


def is_snapshot(node: fx.Node) -> bool:
    """True for a snapshot node made by the ``add-snapshots`` pass."""
    return SNAPSHOT_OF in node.meta


def snapshot_of(node: fx.Node, by_name: Mapping[str, fx.Node] | None = None) -> fx.Node | None:
    """The snapshot node of random ``node``, or None when it has none in the graph."""
    name = node.meta.get(RNG_STATE)
    if name is None:
        return None
    prev = node.prev  # where add-snapshots put it
    if prev.name == name and prev.meta.get(SNAPSHOT_OF) == node.name:
        return prev
    if by_name is None:
        by_name = {n.name: n for n in node.graph.nodes}
    found = by_name.get(name)
    return found if found is not None and found.meta.get(SNAPSHOT_OF) == node.name else None


def why_not_replayable(node: fx.Node, op: str) -> str:
    """Why random ``node`` got no snapshot (the profile's reason it is not recomputable)."""
    generator = generator_of(node)
    if generator is not None:
        return (
            f"random op '{op}' draws from an explicit generator= (only the device's default "
            "generator is replayed)"
        )
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return f"random op '{op}' is not an ATen call (its RNG state is not replayed)"
    if device_of(node) is None:
        return f"random op '{op}' on an unknown device (its RNG state is not replayed)"
    return f"random op '{op}' has no RNG-state snapshot (recomputing would draw new numbers)"


def generator_of(node: fx.Node) -> object:
    args = ops.args(node)
    return args.get("generator") if args is not None else node.kwargs.get("generator")


def device_of(node: fx.Node) -> torch.device | None:
    """The device the op draws on: its value's, else its ``device=``, else an input's."""
    for value in tree_leaves(node.meta.get("val")):
        if isinstance(value, torch.Tensor):
            return value.device
    device = node.kwargs.get("device")
    if isinstance(device, (str, torch.device)):
        return torch.device(device)
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def fake_state(node: fx.Node, device: str) -> torch.Tensor | None:
    """A fake tensor like the snapshot's value, in the fake mode of the node's value."""
    fake = next(
        (v for v in tree_leaves(node.meta.get("val")) if hasattr(v, "fake_mode")),
        None,
    )
    if fake is None:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real = state_of(device)
    return fake.fake_mode.from_tensor(real)
