"""accumulate-in-place: a backward ``add`` whose first operand's storage dies there writes
into it (``add_``) instead of allocating a third tensor.

The joint graph is functional, so a sum of gradients is built out of place: with a
chunked LM head (:mod:`fxopt.remat.chunked_head`) the head weight's gradient is summed
chunk by chunk, and each ``add`` holds the running sum, the chunk's product and the new
sum at once, three weight-sized tensors, the step's floor once the logits are chunked.
In place, two. The profile identifies storages by data pointer, so the cost table (and
every plan) sees the ``add_`` allocate nothing. Only backward values are written, and
only when nothing reads their storage afterwards: no recomputation or later reader can
see the change. Run on chunked traces only (``capture_joint``).

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> from fxopt.passes import PassManager
    >>> from fxopt.remat.capture import tag_phases
    >>> def joint(w, x):  # a loss, then two gradient terms summed
    ...     return (w * x).sum(), x * 2.0 + x * 3.0
    >>> gm = make_fx(joint, tracing_mode="fake")(torch.ones(4), torch.ones(4))
    >>> _ = tag_phases(gm, forward_outputs=[list(gm.graph.nodes)[-1].args[0][0]])
    >>> PassManager([AccumulateInPlace()], copy=False).run(gm).records[0].stats
    {'in_place': 1}
    >>> gm(torch.ones(4), torch.full((4,), 2.0))[1]
    tensor([10., 10., 10., 10.])
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxopt.ir import ops
from fxopt.passes.base import Pass, PassResult, Plan
from fxopt.remat.storage import storage_base, storage_readers
from fxopt.remat.tags import BACKWARD, phase


@dataclass(frozen=True)
class InPlacePlan(Plan):
    adds: tuple[fx.Node, ...] = ()  # in graph order


class AccumulateInPlace(Pass[InPlacePlan]):
    name = "accumulate-in-place"
    description = "a backward add whose first operand's storage dies there writes into it"

    def analyze(self, gm: fx.GraphModule) -> InPlacePlan:
        position = {node: i for i, node in enumerate(gm.graph.nodes)}
        adds = []
        for node in gm.graph.nodes:
            if phase(node) != BACKWARD or ops.info(node, gm).name != "add":
                continue
            args = ops.args(node, gm) or {}
            first, other = args.get("input"), args.get("other")
            if args.get("alpha", 1) != 1 or not isinstance(first, fx.Node):
                continue
            base = storage_base(gm, first)
            if (
                phase(base) != BACKWARD
                or base.op != "call_function"
                or not _same_value_shape(first, node)
                or (isinstance(other, fx.Node) and storage_base(gm, other) is base)
                or max(position[r] for r in storage_readers(gm, base)) != position[node]
            ):
                continue
            adds.append(node)
        return InPlacePlan(adds=tuple(adds))

    def transform(self, gm: fx.GraphModule, plan: InPlacePlan) -> PassResult:
        products = 0
        for node in plan.adds:
            args = ops.args(node, gm)
            total, term = args["input"], args["other"]
            product = _product(gm, term)
            if product is None:
                in_place = ops.emit(gm.graph, "add_", total, term, like=node)
            else:  # the chunk's product is computed into the sum: no weight-sized term
                a, b, chain = product
                in_place = ops.emit(gm.graph, "addmm_", total, a, b, like=node)
                products += 1
            node.replace_all_uses_with(in_place)
            gm.graph.erase_node(node)
            for dead in chain if product is not None else ():
                gm.graph.erase_node(dead)
        stats = {"in_place": len(plan.adds)}
        if products:
            stats["into_the_sum"] = products
        return PassResult(bool(plan.adds), stats)


def _product(gm: fx.GraphModule, term: object) -> tuple | None:
    """``(a, b, nodes)`` when ``term`` is the backward product ``a @ b`` itself, seen
    through transposes (an even number, or an odd one with ``a``, ``b`` swapped and
    transposed), read by nothing else; ``nodes`` are the product and its transposes, last
    first (to erase). Else None."""
    chain, node = [], term
    while isinstance(node, fx.Node) and ops.is_call(node, "t", gm) and len(node.users) == 1:
        chain.append(node)
        node = ops.args(node, gm)["input"]
    if not (isinstance(node, fx.Node) and ops.is_call(node, "mm", gm)) or len(node.users) != 1:
        return None
    if phase(node) != BACKWARD:
        return None
    args = ops.args(node, gm)
    a, b = args["input"], args["mat2"]
    chain.append(node)
    if len(chain) % 2 == 0:  # an odd number of transposes: (a @ b)ᵀ = bᵀ @ aᵀ
        with gm.graph.inserting_before(node):
            a, b = ops.emit(gm.graph, "t", b, like=node), ops.emit(gm.graph, "t", a, like=node)
    return a, b, chain


def _same_value_shape(first: fx.Node, node: fx.Node) -> bool:
    """The sum is the first operand's shape and dtype (it is not broadcast up)."""
    a, out = first.meta.get("val"), node.meta.get("val")
    return (
        a is not None
        and out is not None
        and tuple(a.shape) == tuple(out.shape)
        and a.dtype == out.dtype
    )
