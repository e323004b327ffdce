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

The rule engine (:mod:`fxopt.passes.rules`, of which this is the one-node case) finds the
nodes of ``op`` in every spelling (module, function, method, ATen), binds their arguments
by name (:func:`fxopt.ir.ops.args`), refuses nodes that are more than their value (random,
in place, stateful, unknown: :mod:`fxopt.ir.safety`) with the reason, replaces each node by
what ``rewrite`` returns and erases it. A rule that builds its replacement with
:func:`fxopt.ir.ops.emit` works on both capture levels.
"""

from __future__ import annotations

from typing import ClassVar

from torch import fx

from fxopt.ir import ops
from fxopt.ir.pattern import Match, Op
from fxopt.passes.rules import Rule, RulePass


class Rewrite(RulePass):
    """Base class of a one-node rewrite rule: set ``name`` and ``op``, write ``check`` and
    ``rewrite``. ``verify`` asserts that no node the rule accepts is left."""

    #: The canonical op name (fxopt.ir.ops) of the nodes to rewrite.
    op: ClassVar[str] = ""
    counters, leftovers = ("rewritten",), "nodes the rule rewrites"

    def __init__(self) -> None:
        super().__init__()
        self.rules = (_OneNode(self),)

    def check(self, node: fx.Node, args: dict) -> str | None:
        """Why not to rewrite ``node`` (None: rewrite it). ``args`` are its arguments by
        canonical name."""
        return None

    def rewrite(self, graph: fx.Graph, node: fx.Node, args: dict) -> fx.Node:
        """The node that replaces ``node``; build it with ``ops.emit(graph, ..., like=node)``."""
        raise NotImplementedError(f"{type(self).__name__}.rewrite")


class _OneNode(Rule):
    """A :class:`Rewrite` as a rule of the engine."""

    stat = "rewritten"

    def __init__(self, owner: Rewrite):
        self.owner, self.name, self.pattern = owner, owner.name, Op(owner.op)

    def check(self, match: Match) -> str | None:
        args = ops.args(match.root, match.graph)
        return "cannot read its arguments" if args is None else self.owner.check(match.root, args)

    def build(self, graph: fx.Graph, match: Match) -> fx.Node:
        return self.owner.rewrite(graph, match.root, ops.args(match.root, match.graph))
