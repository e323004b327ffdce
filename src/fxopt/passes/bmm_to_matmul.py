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
and what the rule engine refuses for every rule (:mod:`fxopt.passes.rules`): a node of the
chain read outside it, an operand written in place between the chain's first node and its
end (the matmul reads it where the chain ends).

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

import torch
from torch import fx

from fxopt.ir import facts, meta, ops
from fxopt.ir.pattern import ABSENT, Match, Op, Var
from fxopt.passes.rules import Rule, RulePass

_VIEW = ("view", "reshape")  # reshape may copy where view cannot: the values are the same
_SAME_LAYOUT = ABSENT | torch.preserve_format | torch.contiguous_format


def _operand(name: str) -> Op:
    """view(clone?(expand(x))): a 4-D operand spelled as the 3-D one bmm takes."""
    expand = Op("expand", input=Var(name), bind=f"{name} expand")
    clone = Op("clone", input=expand, memory_format=_SAME_LAYOUT, optional="input")
    return Op(_VIEW, input=clone, bind=f"{name} view")


class BatchedMatmul(Rule):
    name, stat = "bmm chain → matmul", "folded"
    pattern = Op(_VIEW, input=Op("bmm", input=_operand("a"), mat2=_operand("b"), bind="bmm"))

    def check(self, match: Match) -> str | None:
        for side in ("a", "b"):
            expand, tensor = match[f"{side} expand"], match[side]
            if not facts.same_shape(expand, tensor):
                return f"{expand.name} broadcasts (its output's shape is not its input's)"
            if meta.rank(tensor) != 4:
                return "an operand is not 4-D"
        batch_heads = meta.sizes(match["a"])[:2]
        if not _same_sizes(meta.sizes(match["b"])[:2], batch_heads):
            return "its operands differ in (batch, heads)"
        for side in ("a", "b"):
            view = match[f"{side} view"]
            if not _merges(meta.sizes(view), meta.sizes(match[side])):
                return f"{view.name} does not merge (batch, heads) into one dim"
        if not _merges(meta.sizes(match["bmm"]), meta.sizes(match.root), batch_heads):
            return f"{match.root.name} does not split (batch, heads) back"
        return None

    def build(self, graph: fx.Graph, match: Match) -> fx.Node:
        return ops.emit(graph, "matmul", match["a"], match["b"], like=match.root)


class BmmToMatmul(RulePass):
    name = "bmm-to-matmul"
    description = "ATen's expand → view → bmm → view spelling of a 4-D matmul back to matmul"
    counters, leftovers = ("folded",), "bmm chains"
    rules = (BatchedMatmul(),)


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
