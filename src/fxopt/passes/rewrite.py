"""A pass that rewrites single nodes, written as a rule: which op, when not, and into what.

    >>> import torch
    >>> from fxopt.ir import ops
    >>> from fxopt.passes.rewrite import Rewrite
    >>> class SquareToMul(Rewrite):
    ...     name, op = "square-to-mul", "pow"
    ...     def check(self, node, args):
    ...         return None if args.get("exponent") == 2 else "exponent is not 2"
    ...     def rewrite(self, graph, node, args):
    ...         return ops.emit(graph, "mul", args["input"], args["input"], like=node)
    >>> gm = torch.fx.symbolic_trace(lambda x: x ** 2 + x ** 3)
    >>> SquareToMul()(gm).stats
    {'rewritten': 1}

The engine, not the rule, finds the nodes of ``op`` in every spelling (module, function,
method, ATen), binds their arguments by name (:func:`fxopt.ir.ops.args`), refuses nodes
that are more than their value (random, in place, stateful, unknown: :mod:`fxopt.ir.safety`)
with the reason, replaces each node by what ``rewrite`` returns and erases it. A rule
that builds its replacement with :func:`fxopt.ir.ops.emit` works on both capture levels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import fx

from fxopt.ir import ops
from fxopt.ir.safety import Safety
from fxopt.passes.base import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class RewritePlan(Plan):
    #: (node, its arguments by name) in graph order.
    sites: tuple[tuple[fx.Node, dict], ...] = ()


class Rewrite(Pass[RewritePlan]):
    """Base class of a one-node rewrite rule: set ``name`` and ``op``, write ``check`` and
    ``rewrite``. ``verify`` asserts that no node the rule accepts is left."""

    #: The canonical op name (fxopt.ir.ops) of the nodes to rewrite.
    op: ClassVar[str] = ""
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing

    def check(self, node: fx.Node, args: dict) -> str | None:
        """Why not to rewrite ``node`` (None: rewrite it). ``args`` are its arguments by
        canonical name."""
        return None

    def rewrite(self, graph: fx.Graph, node: fx.Node, args: dict) -> fx.Node:
        """The node that replaces ``node``; build it with ``ops.emit(graph, ..., like=node)``."""
        raise NotImplementedError(f"{type(self).__name__}.rewrite")

    def analyze(self, gm: fx.GraphModule) -> RewritePlan:
        safety = Safety(gm)
        sites, skipped = [], []
        for node in gm.graph.nodes:
            if safety.table[node].name != self.op or not safety.table[node].compute:
                continue
            args = ops.args(node, gm)
            reason = safety.why_not_rewrite(node) or (
                "cannot read its arguments" if args is None else self.check(node, args)
            )
            if reason is None:
                sites.append((node, args))
            else:
                skipped.append(Skip(node.name, reason))
        return RewritePlan(skipped=tuple(skipped), sites=tuple(sites))

    def transform(self, gm: fx.GraphModule, plan: RewritePlan) -> PassResult:
        for node, args in plan.sites:
            node.replace_all_uses_with(self.rewrite(gm.graph, node, args))
            gm.graph.erase_node(node)
        return PassResult(bool(plan.sites), {"rewritten": len(plan.sites)}, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [node.name for node, _ in self.analyze(gm).sites]
        assert not left, f"{self.name}: nodes left that the rule rewrites: {left[:8]}"
