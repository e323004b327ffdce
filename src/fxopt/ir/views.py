"""An fx GraphModule as the pattern matcher and the rule engine see it.

Operands are read by canonical argument name (:func:`fxopt.ir.ops.args`), safety questions
go to :class:`fxopt.ir.safety.Safety`, and the rewrites planned so far are overlaid: a node
planned to be replaced reads as its replacement, a node planned to be rewired reads its new
operands. (:mod:`fxopt.passes.rules` says what the engine asks.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

from torch import fx

from fxopt.ir import facts, ops
from fxopt.ir.binding import first_parameter, set_args
from fxopt.ir.pattern import MISSING
from fxopt.ir.safety import Safety

__all__ = ["FxView"]


class FxView:
    """One analysis (or one transform) of ``gm`` through the rule engine's questions."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = self.graph = gm
        self.table = ops.table(gm)  # the op table's answers, shared by a pipeline's passes
        self.safety = Safety(gm)  # (cheap: what it asks of the alias analysis is built lazily)
        self._args: dict[fx.Node, dict | None] = {}
        self._replaced: dict[fx.Node, object] = {}
        self._rewired: dict[fx.Node, dict] = {}

    # ---------------------------------------------------------------- matching

    def nodes(self, names: frozenset[str] | None = None) -> Iterable[fx.Node]:
        """The compute nodes in graph order (whose op is one of ``names``, when given)."""
        table = self.table
        if names is None:
            return [n for n in self.gm.graph.nodes if table[n].compute]
        return [n for n in self.gm.graph.nodes if (op := table[n]).name in names and op.compute]

    def producer(self, value: object) -> fx.Node | None:
        value = self.resolve(value)
        return value if isinstance(value, fx.Node) and ops.is_compute(value) else None

    def op_name(self, node: fx.Node) -> str:
        return self.table[node].name

    def operand(self, node: fx.Node, key: Hashable) -> object:
        rewired = self._rewired.get(node)
        if rewired is not None and key in rewired:
            return rewired[key]
        if node.args and first_parameter(node) == key:  # (no binding: every root is asked)
            return self.resolve(node.args[0])
        if key == "input" and node.op == "call_module" and len(node.args) == 1:
            # A module call's input is its one argument (binding.module_args's rule), read
            # without the module's attributes: a batch norm after every conv asks this.
            return self.resolve(node.args[0]) if not node.kwargs else MISSING
        if node not in self._args:
            self._args[node] = ops.args(node, self.gm)
        args = self._args[node]
        value = MISSING if args is None else args.get(key, MISSING)
        return self.resolve(value)

    def is_value(self, operand: object) -> bool:
        return isinstance(operand, fx.Node)

    def passes(self, node: fx.Node, literal) -> bool:
        return self.passes_test(literal)(node)

    def passes_test(self, literal) -> Callable[[fx.Node], bool]:
        value, accepts = literal.value, literal.accepts

        def test(node: fx.Node) -> bool:
            args = node.args
            try:  # (in C: most nodes have no such literal, and stop here)
                if value not in args:
                    kwargs = node.kwargs
                    if not kwargs or value not in kwargs.values():
                        return False
            except RuntimeError:  # a tensor among the arguments: it has no bool
                pass
            return any(map(accepts, args)) or any(map(accepts, node.kwargs.values()))

        return test

    # ---------------------------------------------------------------- the engine's checks

    def readers(self, node: fx.Node) -> Iterable[fx.Node]:
        return [user for user in self._users(node) if user.op != "output"]

    def is_output(self, node: fx.Node) -> bool:
        return any(user.op == "output" for user in self._users(node))

    def _users(self, node: fx.Node) -> Iterable[fx.Node]:
        """``node``'s users once the planned replacements are made: a user replaced by
        ``node`` hands its users over; one replaced by another value stops reading it."""
        if not self._replaced:  # nothing planned yet: the graph's own users
            return node.users  # type: ignore[return-value]
        found = []
        for user in node.users:
            if user not in self._replaced:
                found.append(user)
            elif self.resolve(user) is node:
                found.extend(self._users(user))
        return found

    def label(self, node: object) -> str:
        return node.name if isinstance(node, fx.Node) else repr(node)

    def why_not_rewrite(self, node: fx.Node) -> str | None:
        return self.safety.why_not_rewrite(node)

    def why_not_replace(self, node: fx.Node, value: object) -> str | None:
        if not isinstance(value, fx.Node):
            return None
        return self.safety.why_not_replace(node, value)

    def written_between(self, value: fx.Node, first: fx.Node, last: fx.Node) -> bool:
        if first is last:
            return False
        alias = self.safety.alias
        return alias.version(value, at=first) != alias.version(value, at=last)

    def first(self, nodes: Iterable[fx.Node]) -> fx.Node:
        position = self.safety.alias.position
        return min(nodes, key=position.__getitem__)

    def plan_replace(self, node: fx.Node, value: object) -> None:
        self._replaced[node] = value
        if isinstance(value, fx.Node):
            self.safety.planned(node, value)

    def plan_rewire(self, node: fx.Node, operands: Mapping) -> None:
        self._rewired.setdefault(node, {}).update(operands)

    # ---------------------------------------------------------------- transform

    def resolve(self, value: object) -> object:
        while isinstance(value, fx.Node) and value in self._replaced:
            value = self._replaced[value]
        return value

    def replace(self, node: fx.Node, value: object) -> None:
        node.replace_all_uses_with(value)
        self._replaced[node] = value

    def rewire(self, node: fx.Node, operands: Mapping) -> None:
        set_args(node, **{key: self.resolve(v) for key, v in operands.items()})

    def build_before(self, node: fx.Node, rule, match) -> object:
        with self.gm.graph.inserting_before(node):
            return rule.build(self.gm.graph, match)

    def erase(self, node: fx.Node) -> None:
        self.gm.graph.erase_node(node)

    def erase_unread(self, nodes: Iterable[fx.Node]) -> None:
        for node in nodes:  # root first: erasing it frees the nodes it read
            if not node.users and not node._erased:
                self.gm.graph.erase_node(node)

    def rely_on_layout(self, values: Iterable[object]) -> None:
        nodes = [v for v in values if isinstance(v, fx.Node)]
        if nodes:
            facts.rely_on_layout(self.gm, *nodes)

    def finish(self) -> None:
        pass
