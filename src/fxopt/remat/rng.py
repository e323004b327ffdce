"""Replay RNG state so random forward ops (dropout) can be recomputed in the backward.

A recomputed ``native_dropout`` must draw the same mask as the forward did. Like
``torch.utils.checkpoint``, remat replays the generator state instead of keeping the mask:

* after capture, :func:`add_snapshots` puts a ``state_of(device)`` node right before each
  forward random op whose value the backward may need, and links the two in node meta;
* the cost table treats the snapshot as an extra input of its random op, so a plan that
  recomputes the op keeps the snapshot alive until the copy (one ~5 KB tensor on CPU, 16
  bytes of seed and offset on CUDA);
* the rewriter copies a recomputed random op as ``replay(device, state, op, *args)``,
  which sets ``state``, runs ``op`` and restores the generator, so the RNG stream after a
  step is exactly eager's; snapshots that no copy reads are erased.

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

import contextlib
from collections.abc import Callable, Mapping

import torch
from torch import fx
from torch.utils._pytree import tree_leaves

from fxopt.ir import ops
from fxopt.remat.capture import BACKWARD, FORWARD, PHASE, phase

RNG_STATE = "fxopt.rng_state"  # on a random node: the name of its snapshot node
SNAPSHOT_OF = "fxopt.rng_snapshot_of"  # on a snapshot node: the name of its random node


# ``x.mul(mask).mul_(scale)``: native_dropout's output from its mask, as one pure ATen op
# (a schema the op table reads: known, pure, not random), one buffer like the kernel's.
_LIB = torch.library.Library("fxopt", "FRAGMENT")
try:  # defined once per process, even if this file is imported under two names
    _DEFINED = torch.ops.fxopt.apply_dropout_mask is not None
except (AttributeError, RuntimeError):
    _LIB.define("apply_dropout_mask(Tensor x, Tensor mask, float scale) -> Tensor")
    _DEFINED = False


def _apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return x.mul(mask).mul_(scale)


def _apply_dropout_mask_meta(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


if not _DEFINED:
    _LIB.impl("apply_dropout_mask", _apply_dropout_mask, "CompositeExplicitAutograd")
    _LIB.impl("apply_dropout_mask", _apply_dropout_mask_meta, "Meta")


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
    """True for a snapshot node made by :func:`add_snapshots`."""
    return SNAPSHOT_OF in node.meta


def snapshot_of(node: fx.Node, by_name: Mapping[str, fx.Node] | None = None) -> fx.Node | None:
    """The snapshot node of random ``node``, or None when it has none in the graph."""
    name = node.meta.get(RNG_STATE)
    if name is None:
        return None
    prev = node.prev  # where add_snapshots put it
    if prev.name == name and prev.meta.get(SNAPSHOT_OF) == node.name:
        return prev
    if by_name is None:
        by_name = {n.name: n for n in node.graph.nodes}
    found = by_name.get(name)
    return found if found is not None and found.meta.get(SNAPSHOT_OF) == node.name else None


def why_not_replayable(node: fx.Node, op: str) -> str:
    """Why random ``node`` got no snapshot (the profile's reason it is not recomputable)."""
    generator = _generator(node)
    if generator is not None:
        return (
            f"random op '{op}' draws from an explicit generator= (only the device's default "
            "generator is replayed)"
        )
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return f"random op '{op}' is not an ATen call (its RNG state is not replayed)"
    if _device(node) is None:
        return f"random op '{op}' on an unknown device (its RNG state is not replayed)"
    return f"random op '{op}' has no RNG-state snapshot (recomputing would draw new numbers)"


def add_snapshots(gm: fx.GraphModule) -> int:
    """Snapshot the generator right before each forward random op the backward may need.

    "May need": the op's value reaches a backward node through forward nodes, so a plan
    could recompute it. The snapshot is a forward node nothing reads yet; the rewriter
    makes replays read it and erases it otherwise. Returns how many were added.

        >>> import torch
        >>> from torch import fx
        >>> from fxopt.remat.capture import tag_phases
        >>> aten = torch.ops.aten
        >>> def f(x):
        ...     d = aten.native_dropout.default(x, 0.5, True)
        ...     return aten.sum.default(d[0]), aten.mul.Tensor(d[1], x)
        >>> gm = fx.symbolic_trace(f)
        >>> for n in gm.graph.nodes:
        ...     n.meta["val"] = torch.empty(0)  # a device to snapshot (capture sets it)
        >>> out = list(gm.graph.nodes)[-1]
        >>> _ = tag_phases(gm, forward_outputs=[out.args[0][0]])
        >>> add_snapshots(gm), [n.name for n in gm.graph.nodes][:3]
        (1, ['x', 'native_dropout_default_rng_state', 'native_dropout_default'])
    """
    from fxopt.ir import ops

    needed: set[fx.Node] = set()  # forward nodes whose value reaches the backward
    for node in reversed(gm.graph.nodes):
        if phase(node) == FORWARD and any(phase(u) == BACKWARD or u in needed for u in node.users):
            needed.add(node)
    added = 0
    for node in list(gm.graph.nodes):
        if node not in needed or node.meta.get(RNG_STATE):
            continue
        if not ops.info(node, gm).random or _generator(node) is not None:
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        device = _device(node)
        if device is None:
            continue
        with gm.graph.inserting_before(node):
            snap = gm.graph.create_node(
                "call_function", state_of, (str(device),), name=f"{node.name}_rng_state"
            )
        snap.meta[PHASE] = FORWARD
        snap.meta[SNAPSHOT_OF] = node.name
        if "partitioner_tag" in node.meta:  # AOTAutograd's partitioner keeps it forward
            snap.meta["partitioner_tag"] = node.meta["partitioner_tag"]
        val = _fake_state(node, str(device))
        if val is not None:  # partitioners check that a saved value is a tensor
            snap.meta["val"] = val
        node.meta[RNG_STATE] = snap.name
        added += 1
    if added:
        gm.graph.lint()
        gm.recompile()
    return added


def split_dropouts(gm: fx.GraphModule) -> int:
    """Write each CPU ``native_dropout`` in training mode as the ops it runs, so a plan can
    recompute its output from the kept mask without drawing again.

    ``native_dropout(x, p, True)`` on CPU draws a bool mask and returns
    ``(x.mul(mask).mul_(1 / (1 - p)), mask)``. As one node, recomputing the output means
    replaying the draw (the Bernoulli draw is ~80 % of the op's time). Split, the graph reads

        mask = bernoulli(empty_like(x, dtype=bool), 1 - p)     (random: replayed if chosen)
        out  = apply_dropout_mask(x, mask, 1 / (1 - p))          (pure: cheap to recompute)

    with the same values bit for bit and the same draws from the generator, and the
    planners choose per value: recompute ``out`` from ``x`` and the mask (two
    multiplications, ``x.mul(mask).mul_(scale)`` as the kernel does, in one ATen op
    ``fxopt::apply_dropout_mask`` so no second buffer is live; the mask, a quarter of
    ``out``'s bytes for float32, stays saved as the dropout's backward needs it anyway),
    or replay the mask too. CUDA's fused kernel draws differently, so only CPU dropouts of
    contiguous inputs are split. Returns how many were split.

        >>> import torch
        >>> from torch import fx
        >>> from torch._subclasses import FakeTensorMode
        >>> aten = torch.ops.aten
        >>> def f(x):
        ...     d = aten.native_dropout.default(x, 0.5, True)
        ...     return aten.mul.Tensor(d[0], d[1])
        >>> gm = fx.symbolic_trace(f)
        >>> with FakeTensorMode() as mode:
        ...     x = torch.empty(4)
        >>> for n in gm.graph.nodes:
        ...     n.meta["val"] = (x, x.bool()) if n.name == "native_dropout_default" else x
        >>> split_dropouts(gm), [str(n.target) for n in gm.graph.nodes][1:4]
        (1, ['aten.empty_like.default', 'aten.bernoulli.p', 'fxopt.apply_dropout_mask.default'])
    """
    import operator

    aten = torch.ops.aten
    graph = gm.graph
    split = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.native_dropout.default:
            continue
        x, p = node.args[0], node.args[1]
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        val = node.meta.get("val")
        x_val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if (
            train is not True
            or not isinstance(p, (int, float))
            or not isinstance(x_val, torch.Tensor)
            or not isinstance(val, (tuple, list))
            or x_val.device.type != "cpu"
            # bernoulli.p draws into a contiguous mask; the kernel's has x's strides
            or not x_val.is_contiguous()
            or any(u.op != "call_function" or u.target is not operator.getitem for u in node.users)
        ):
            continue
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        fake_mode = getattr(val[0], "fake_mode", None)
        with graph.inserting_before(node):
            empty = _make(
                node,
                aten.empty_like.default,
                (x,),
                {"dtype": torch.bool, "memory_format": torch.contiguous_format},
                "empty",
            )
            mask = _make(node, aten.bernoulli.p, (empty, 1.0 - p), {}, "mask")
            out = _make(
                node, torch.ops.fxopt.apply_dropout_mask.default, (x, mask, scale), {}, "out"
            )
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            empty.meta["val"] = torch.empty_like(
                val[0], dtype=torch.bool, memory_format=torch.contiguous_format
            )
        mask.meta["val"], out.meta["val"] = val[1], val[0]
        for user in list(node.users):
            user.replace_all_uses_with(out if user.args[1] == 0 else mask)
            graph.erase_node(user)
        graph.erase_node(node)
        split += 1
    if split:
        graph.lint()
        gm.recompile()
    return split


def _make(like: fx.Node, target, args: tuple, kwargs: dict, suffix: str) -> fx.Node:
    """A call of ``target`` named and tagged like ``like`` (phase, partitioner tag)."""
    new = like.graph.create_node(
        "call_function", target, args, kwargs, name=f"{like.name}_{suffix}"
    )
    new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    return new


def replay_node(
    graph: fx.Graph, original: fx.Node, snapshot: fx.Node, arg_transform: Callable
) -> fx.Node:
    """Insert (at the graph's insert point) ``replay(device, snapshot, op, *args)`` for
    ``original``, its arguments mapped by ``arg_transform`` as ``Graph.node_copy`` does."""
    args = fx.node.map_arg(original.args, arg_transform)
    kwargs = fx.node.map_arg(original.kwargs, arg_transform)
    return graph.create_node(
        "call_function",
        replay,
        (snapshot.args[0], snapshot, original.target, *args),
        dict(kwargs),
        name=original.name,
    )


def erase_unused_snapshots(gm: fx.GraphModule) -> int:
    """Remove snapshots no replay reads (the plan recomputes no random op from them)."""
    unused = [n for n in gm.graph.nodes if is_snapshot(n) and not n.users]
    for node in unused:
        gm.graph.erase_node(node)
    return len(unused)


def _generator(node: fx.Node) -> object:
    args = ops.args(node)
    return args.get("generator") if args is not None else node.kwargs.get("generator")


def _device(node: fx.Node) -> torch.device | None:
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


def _fake_state(node: fx.Node, device: str) -> torch.Tensor | None:
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
