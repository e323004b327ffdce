"""Facts about values that hold for *every* input a graph may be called with.

A pass decides from metadata: "this reshape keeps the shape", "this cast keeps the dtype",
"this value is already contiguous". Metadata comes from one example, so each answer here is
a proof for all inputs the graph's contract (:mod:`fxopt.ir.contract`) allows, or False:

* **shapes** are compared symbolically: ``[s0, 8]`` equals ``[s0, 8]`` for every ``s0``;
  ``[s0, 8]`` and ``[4, 8]`` are not provably equal, even when the example has ``s0 = 4``.
  Nothing here adds a guard to the shape environment.
* **dtypes** are fixed by the contract (an input's dtype is checked on every call), so the
  metadata's dtypes hold for every accepted input.
* **layouts** (contiguity, strides) follow the inputs' memory format, which the contract
  does not fix unless a rewrite relies on it: a pass that removes a copy because of a
  layout fact calls :func:`rely_on_layout`, and the contract then pins the memory format
  of the inputs that value's layout follows to the example's (the others stay free).
* **broadcast** results never equal their input: a copy that materializes an ``expand`` is
  kept (its strides differ from its input's).

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.ir import facts
    >>> gm = trace(torch.nn.Flatten(0), torch.randn(4, 8), dynamic="batch")
    >>> x, flat = list(gm.graph.nodes)[:2]
    >>> facts.same_shape(x, x), facts.same_shape(x, flat)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import fx

from fxopt.ir import meta, ops, shared

#: gm.meta key of the inputs whose memory format a rewrite relied on (see the contract and
#: :func:`pinned_inputs`): True for every input, else a frozenset of placeholder names.
LAYOUT_PINNED_KEY = "fxopt.layout_pinned"


def equal(a: object, b: object) -> bool:
    """True when two sizes (ints or SymInts) are equal for every allowed input."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a: object, b: object) -> bool:
    """True when ``a`` and ``b`` have the same shape for every allowed input."""
    left, right = meta.sizes(a), meta.sizes(b)
    if left is None or right is None or len(left) != len(right):
        return False
    return all(equal(x, y) for x, y in zip(left, right))


def same_dtype(a: object, b: object) -> bool:
    """True when both dtypes are known and equal (the contract fixes input dtypes)."""
    left, right = meta.dtype(a), meta.dtype(b)
    return left is not None and left == right


def strides(node: object) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if isinstance(val, torch.Tensor):
        try:
            return tuple(val.stride())
        except Exception:  # sparse or opaque layouts
            return None
    tensor_meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    found = getattr(tensor_meta, "stride", None)
    return tuple(found) if isinstance(found, tuple) else None


def same_strides(a: object, b: object) -> bool:
    """True when ``a`` and ``b`` have the same shape and strides for inputs laid out like
    the example (a layout fact: call :func:`rely_on_layout` before acting on it)."""
    if not same_shape(a, b):
        return False
    left, right = strides(a), strides(b)
    if left is None or right is None or len(left) != len(right):
        return False
    sizes = meta.sizes(a) or ()
    # A size-1 dim's stride never matters; a dim that may be 1 must match anyway.
    return all(
        (isinstance(size, int) and size == 1) or equal(x, y)
        for size, x, y in zip(sizes, left, right)
    )


def is_contiguous(node: object) -> bool:
    """True when ``node``'s value is contiguous for inputs laid out like the example (a
    layout fact: call :func:`rely_on_layout` before acting on it)."""
    sizes, found = meta.sizes(node), strides(node)
    if sizes is None or found is None or len(sizes) != len(found):
        return False
    expected: object = 1
    for size, stride in zip(reversed(sizes), reversed(found)):
        if not (isinstance(size, int) and size == 1) and not equal(stride, expected):
            return False
        expected = expected * size
    return True


def rely_on_layout(gm: fx.GraphModule, *nodes: fx.Node) -> None:
    """Record that a rewrite of ``gm`` relied on the layout of ``nodes``' values. The graph
    inputs whose layout they may take are pinned: the optimized module's contract fixes
    their memory format to the example's (those inputs laid out otherwise are refused)."""
    relied = [node for node in nodes if follows_input_layout(gm, node)]
    if not relied:
        return
    sources = _layout_sources(relied, shared.get(gm, "facts.follows-input-layout", _followers))
    pinned = gm.meta.get(LAYOUT_PINNED_KEY)
    if sources and pinned is not True:
        gm.meta[LAYOUT_PINNED_KEY] = frozenset(pinned or ()) | sources


def pin_every_input(gm: fx.GraphModule) -> None:
    """Pin the memory format of every input of ``gm`` (a graph traced for the example's
    strides, with no record of what relied on them)."""
    gm.meta[LAYOUT_PINNED_KEY] = True


def pinned_inputs(gm: fx.GraphModule) -> bool | frozenset[str]:
    """The inputs of ``gm`` whose memory format a rewrite relied on: True for every input,
    else their placeholder names (empty: none)."""
    pinned = gm.meta.get(LAYOUT_PINNED_KEY)
    return True if pinned is True else frozenset(pinned or ())


def _layout_sources(nodes: list[fx.Node], following: set[fx.Node]) -> frozenset[str]:
    """The placeholders whose layout some of ``nodes`` may follow (a walk up the graph
    through the nodes that follow an input's layout)."""
    reached = inputs_reached(nodes, through=lambda node: node in following)
    return frozenset(str(node.target) for node in reached)


def inputs_reached(nodes: Iterable[fx.Node], through: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The placeholders a walk up the graph from ``nodes`` reaches, going on from a node
    into its inputs only where ``through(node)``."""
    stack, seen, found = list(nodes), set(), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            found.add(node)
        elif through(node):
            stack.extend(ops.input_nodes(node))
    return found


def follows_input_layout(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True when ``node``'s strides may depend on how the caller lays out an input.

    Attributes have fixed layouts; ops that always return a fresh contiguous tensor
    (:data:`fxopt.ir.ops.CONTIGUOUS_RESULT`) cut the dependence; anything else follows the
    inputs it reads.
    """
    return node in shared.get(gm, "facts.follows-input-layout", _followers)


def _followers(gm: fx.GraphModule) -> set[fx.Node]:
    following: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or (
            ops.is_compute(node)
            and ops.info(node, gm).name not in ops.CONTIGUOUS_RESULT
            and any(arg in following for arg in ops.input_nodes(node))
        ):
            following.add(node)
    return following
