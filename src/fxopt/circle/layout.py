"""Decide the memory layout of every value before lowering: NHWC propagation.

PyTorch is NCHW; Circle's CONV_2D, pools and resizes are NHWC. Wrapping each conv in a
TRANSPOSE pair and hoping a cleanup cancels them leaves transposes wherever the cleanup is
not clever enough. Instead the layout of each value is chosen here, once, forward through
the graph, as a permutation ``perm``: the Circle tensor holds ``torch_value.permute(perm)``.

* ops that need NHWC (conv, pool, resize) produce NHWC (``(0, 2, 3, 1)`` for 4-D values);
* layout-agnostic ops (elementwise, activations, residual adds, concat with its axis
  remapped, pad with its pads remapped, reductions with their axes remapped) take the
  layout of their inputs, so a CNN stays NHWC from its first conv to its classifier;
* ``permute`` is free: its result is the same Circle tensor under a composed ``perm``;
* everything else (reshape, matmul, softmax...) gets the torch layout.

Lowering then converts a value only where a consumer needs another layout: a TRANSPOSE, or a
RESHAPE when the permutation only moves size-1 dimensions. Constants never need a runtime
op: they are stored in whatever layout their consumer asks for.

    >>> x_held_nhwc = NHWC
    >>> compose(x_held_nhwc, (0, 2, 3, 1))   # x.permute(0, 2, 3, 1) is that tensor as is
    (0, 1, 2, 3)
    >>> conversion(NHWC, identity(4))        # the TRANSPOSE back to NCHW
    (0, 3, 1, 2)
"""

from __future__ import annotations

import operator
from collections.abc import Callable

from torch import fx

Perm = tuple[int, ...]
NHWC: Perm = (0, 2, 3, 1)

# Layout kinds a lowering declares (see fxopt.circle.lower.LOWERINGS).
NEEDS_NHWC = "nhwc"  # reads and writes NHWC (conv, pool, resize)
FOLLOWS = "follows"  # takes the layout of its same-rank, non-constant inputs
REDUCES = "reduces"  # takes its input's layout, axes removed when keepdim is False
PERMUTES = "permutes"  # relabels its input: free
TORCH = "torch"  # the torch layout (default)


def identity(rank: int) -> Perm:
    return tuple(range(rank))


def compose(stored: Perm, dims: Perm) -> Perm:
    """Layout of ``x.permute(dims)`` that reuses the tensor holding ``x`` in ``stored``.

    The tensor holds x.permute(stored); y = x.permute(dims), so y.permute(q) is that same
    tensor when dims[q[i]] == stored[i].
    """
    return tuple(dims.index(s) for s in stored)


def conversion(stored: Perm, wanted: Perm) -> Perm:
    """The TRANSPOSE perm that turns a tensor held in ``stored`` into one held in ``wanted``."""
    return tuple(stored.index(w) for w in wanted)


def rank_of(node: object) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    shape = getattr(val, "shape", None)
    return len(shape) if shape is not None else None


def plan(
    gm: fx.GraphModule,
    kind_of: Callable[[fx.Node], str],
    *,
    propagate: bool = True,
) -> dict[fx.Node, Perm | list]:
    """The layout of every value in ``gm`` (a list of layouts for multi-output nodes)."""
    layouts: dict[fx.Node, Perm | list] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            layouts[node] = [_default(v, None) for v in val]
            first = len(val[0].shape) if val and hasattr(val[0], "shape") else None
            kind = kind_of(node) if node.op == "call_function" else TORCH
            if kind == NEEDS_NHWC and first == 4:
                layouts[node][0] = NHWC
            elif kind == FOLLOWS and first is not None and propagate:
                # batch_norm's (out, mean, rstd): the result keeps its input's layout
                layouts[node][0] = _choose(node, kind, first, layouts)
            continue
        rank = rank_of(node)
        if rank is None:
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            held = layouts.get(source)
            layouts[node] = held[index] if isinstance(held, list) else identity(rank)
            continue
        kind = kind_of(node) if node.op == "call_function" else TORCH
        layouts[node] = _choose(node, kind, rank, layouts) if propagate else identity(rank)
        if not propagate and kind == NEEDS_NHWC and rank == 4:
            layouts[node] = identity(rank)  # the lowering transposes in and out itself
    return layouts


def _default(val: object, _: object) -> Perm | None:
    shape = getattr(val, "shape", None)
    return identity(len(shape)) if shape is not None else None


def _choose(node: fx.Node, kind: str, rank: int, layouts: dict) -> Perm:
    if kind == NEEDS_NHWC:
        return NHWC if rank == 4 else identity(rank)
    inputs = [a for a in _tensor_args(node) if a.op != "get_attr"]
    if kind == PERMUTES:
        source = inputs[0]
        return compose(layouts.get(source, identity(rank)), tuple(_dims(node.args[1], rank)))
    if kind == FOLLOWS:
        held = {layouts.get(a) for a in inputs}
        held = {h for h in held if isinstance(h, tuple) and len(h) == rank}
        if len(held) == 1:
            return held.pop()
        if rank == 4 and NHWC in held:  # a feature map meets another layout: stay NHWC
            return NHWC
        # Inputs disagree (a residual stream read back from a permuted value): the torch
        # layout, which the next matmul / norm / reshape wants anyway.
        return identity(rank)
    if kind == REDUCES and inputs:
        held = layouts.get(inputs[0])
        if not isinstance(held, tuple) or held == identity(len(held)):
            return identity(rank)
        if len(held) == rank:  # keepdim
            return held
        dims = reduced_dims(node, len(held))
        kept = [d for d in held if d not in dims]
        renumber = {d: i for i, d in enumerate(sorted(kept))}
        return tuple(renumber[d] for d in kept)
    return identity(rank)


def reduced_dims(node: fx.Node, rank: int) -> set[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return set(range(rank))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {d % rank for d in dims} if dims else set(range(rank))


def _dims(dims, rank: int) -> list[int]:
    return [d % rank for d in dims]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    for a in node.args:
        if isinstance(a, fx.Node):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(x for x in a if isinstance(x, fx.Node))
    return found
