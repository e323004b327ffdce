"""bmm-to-matmul: ATen's spelling of a batched 4-D matmul back to one matmul.

torch.export decomposes ``a @ b`` on 4-D tensors (batch, heads, m, k) · (batch, heads, k, n)
into a chain that hides what it computes::

    view(bmm(view(expand(a), [B·H, m, k]), view(expand(b), [B·H, k, n])), [B, H, m, n])
                                                  →    matmul(a, b)

(with a ``clone`` between an expand and its view when the view needs contiguous memory;
``reshape`` for ``view`` in a module-level graph).
The chain is rewritten when every expand keeps its input's shape (no broadcast), every
view merges the same (batch, heads) into one dim and the last view splits them back, for
every allowed input: then ``matmul(a, b)`` is the same value, exactly (the same bmm kernel
runs on the same numbers). The attention patterns of the ``cpu`` kernel library are
written on ``matmul``, so this runs before :mod:`fxopt.passes.fuse_kernels` in the layout
step, and the ATen-level attention block reaches ``scaled_dot_product_attention`` too.

Left alone, with the reason: an expand that broadcasts, views that reshape anything else,
an operand written in place between the chain's first node and its end (the matmul reads
it where the chain ends), and a bmm whose result is read other than through one view.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.passes import PassManager
    >>> class Scores(torch.nn.Module):
    ...     def forward(self, q, k):
    ...         return q @ k.transpose(-1, -2)
    >>> q = torch.randn(2, 3, 4, 8)
    >>> gm = trace(Scores(), (q, q), mode="export")
    >>> result = PassManager([BmmToMatmul()]).run(gm)
    >>> result.records[0].stats["folded"]
    1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fxopt.ir import facts, meta, ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.passes.base import Pass, PassResult, Plan, Skip

_MATMUL = torch.ops.aten.matmul.default


@dataclass(frozen=True)
class Chain:
    """One bmm chain: the 4-D operands, the bmm, the final view and the nodes between."""

    left: fx.Node
    right: fx.Node
    bmm: fx.Node
    result: fx.Node
    between: tuple[fx.Node, ...]  # expand / clone / view nodes of both operands


@dataclass(frozen=True)
class BmmPlan(Plan):
    chains: tuple[Chain, ...] = ()


class BmmToMatmul(Pass[BmmPlan]):
    name = "bmm-to-matmul"
    description = "ATen's expand → view → bmm → view spelling of a 4-D matmul back to matmul"
    idempotent = True

    def analyze(self, gm: fx.GraphModule) -> BmmPlan:
        alias = AliasAnalysis.of(gm)
        chains: list[Chain] = []
        skipped: list[Skip] = []
        for node in gm.graph.nodes:
            if not ops.is_call(node, "bmm", gm):
                continue
            found = _chain(node, gm, alias)
            if isinstance(found, str):
                skipped.append(Skip(node.name, found))
            else:
                chains.append(found)
        return BmmPlan(skipped=tuple(skipped), chains=tuple(chains))

    def transform(self, gm: fx.GraphModule, plan: BmmPlan) -> PassResult:
        graph = gm.graph
        for chain in plan.chains:
            with graph.inserting_before(chain.result):
                matmul = graph.call_function(_MATMUL, (chain.left, chain.right))
            matmul.meta.update(chain.result.meta)
            chain.result.replace_all_uses_with(matmul)
            for node in (chain.result, chain.bmm, *reversed(chain.between)):
                if not node.users:
                    graph.erase_node(node)
        return PassResult(bool(plan.chains), {"folded": len(plan.chains)}, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [c.bmm.name for c in self.analyze(gm).chains]
        assert not left, f"bmm chains left after bmm-to-matmul: {left[:8]}"


def _chain(bmm: fx.Node, gm: fx.GraphModule, alias: AliasAnalysis) -> Chain | str:
    if len(bmm.args) != 2 or bmm.kwargs or len(bmm.users) != 1:
        return "not a bmm read through exactly one view"
    (result,) = bmm.users
    if not _is_view(result, gm):
        return "not a bmm read through exactly one view"
    operands = [_four_d_operand(arg, gm) for arg in bmm.args]
    for found in operands:
        if isinstance(found, str):
            return found
    (left, left_nodes), (right, right_nodes) = operands
    batch_heads = (meta.sizes(left) or ())[:2]
    if len(batch_heads) != 2 or not _same_sizes((meta.sizes(right) or ())[:2], batch_heads):
        return "its operands differ in (batch, heads)"
    for view, source in ((left_nodes[-1], left), (right_nodes[-1], right)):
        if not _merges(meta.sizes(view), meta.sizes(source)):
            return f"{view.name} does not merge (batch, heads) into one dim"
    if not _merges(meta.sizes(bmm), meta.sizes(result), batch_heads):
        return f"{result.name} does not split (batch, heads) back"
    between = (*left_nodes, *right_nodes)
    for operand, first in ((left, left_nodes[0]), (right, right_nodes[0])):
        if alias.version(operand, at=first) != alias.version(operand, at=result):
            return f"{operand.name} is written in place before the bmm reads it"
    return Chain(left, right, bmm, result, between)


def _four_d_operand(view: object, gm: fx.GraphModule) -> tuple[fx.Node, list[fx.Node]] | str:
    """The 4-D tensor a bmm operand comes from through view(clone?(expand(x))), and the
    nodes between in graph order."""
    if not isinstance(view, fx.Node) or not _is_view(view, gm):
        return "an operand is not a view to 3-D"
    nodes = [view]
    source = view.all_input_nodes[0] if view.all_input_nodes else None
    if isinstance(source, fx.Node) and ops.is_call(source, "clone", gm):
        memory_format = (ops.args(source) or {}).get("memory_format")
        if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
            return f"{source.name} changes the memory format"
        nodes.append(source)
        source = source.all_input_nodes[0]
    if not isinstance(source, fx.Node) or not ops.is_call(source, "expand", gm):
        return "an operand is not a view of an expand"
    if not facts.same_shape(source, source.all_input_nodes[0]):
        return f"{source.name} broadcasts (its output's shape is not its input's)"
    nodes.append(source)
    tensor = source.all_input_nodes[0]
    if meta.rank(tensor) != 4:
        return "an operand is not 4-D"
    return tensor, nodes[::-1]


def _is_view(node: fx.Node, gm: fx.GraphModule) -> bool:
    # reshape may copy where view cannot: the values are the same either way.
    return ops.is_call(node, "view", gm) or ops.is_call(node, "reshape", gm)


def _merges(three: tuple | None, four: tuple | None, batch_heads: tuple | None = None) -> bool:
    """``three`` is (batch·heads, a, b) of ``four`` = (batch, heads, a, b), for every
    allowed input (and ``four`` starts with ``batch_heads`` when given)."""
    if three is None or four is None or len(three) != 3 or len(four) != 4:
        return False
    if batch_heads is not None and not _same_sizes(four[:2], batch_heads):
        return False
    return (
        facts.equal(three[0], four[0] * four[1])
        and facts.equal(three[1], four[2])
        and facts.equal(three[2], four[3])
    )


def _same_sizes(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(facts.equal(x, y) for x, y in zip(a, b))
