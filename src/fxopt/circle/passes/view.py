"""A Circle graph as the pattern matcher and the rule engine see it.

Nodes are :class:`~fxopt.circle.graph.Operator` objects, values are tensor indices, and an
operand is read by slot (``Op("RESHAPE", Var("x"))`` reads slot 0). Circle operators write
no input and draw no random numbers, so the engine's questions reduce to the graph's
structure: who reads a tensor, and which tensors the graph returns. The rewrites planned so
far are overlaid as in :class:`fxopt.ir.views.FxView`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

from fxopt.circle.graph import CircleGraph, Operator
from fxopt.circle.passes.kind import CIRCLE
from fxopt.ir.pattern import MISSING
from fxopt.passes.rules import RulePass

__all__ = ["CircleRulePass", "CircleView"]


class CircleView:
    def __init__(self, graph: CircleGraph):
        self.graph = graph
        self._producers = {t: op for op in graph.operators for t in op.outputs}
        self._readers = graph.consumers()
        self._position = {id(op): i for i, op in enumerate(graph.operators)}
        self._replaced: dict[int, int] = {}  # tensor → the tensor read instead
        self._rewired: dict[int, dict] = {}  # id(op) → {slot: tensor}
        self._erased: set[int] = set()

    # ---------------------------------------------------------------- matching

    def nodes(self, names: frozenset[str] | None = None) -> Iterable[Operator]:
        operators = self.graph.operators
        return list(operators) if names is None else [op for op in operators if op.code in names]

    def producer(self, value: object) -> Operator | None:
        return self._producers.get(self.resolve(value)) if self.is_value(value) else None

    def op_name(self, node: Operator) -> str:
        return node.code

    def operand(self, node: Operator, key: Hashable) -> object:
        rewired = self._rewired.get(id(node), {})
        if key in rewired:
            return rewired[key]
        if not isinstance(key, int) or key >= len(node.inputs):
            return MISSING
        index = node.inputs[key]
        return None if index < 0 else self.resolve(index)

    def is_value(self, operand: object) -> bool:
        return isinstance(operand, int) and not isinstance(operand, bool) and operand >= 0

    def passes(self, node: Operator, literal) -> bool:
        return False  # Circle operands are tensors, never Python literals

    def passes_test(self, literal) -> Callable[[Operator], bool]:
        return lambda node: False

    # ---------------------------------------------------------------- the engine's checks

    def readers(self, node: Operator) -> list[Operator]:
        found = []
        for tensor in node.outputs:
            found += [r for r in self._readers.get(tensor, ()) if self._reads(r, tensor)]
        for old, new in self._replaced.items():  # readers handed over by a replacement
            if new in node.outputs:
                found += [r for r in self._readers.get(old, ()) if id(r) not in self._erased]
        return found

    def _reads(self, reader: Operator, tensor: int) -> bool:
        slots = [i for i, t in enumerate(reader.inputs) if t == tensor]
        rewired = self._rewired.get(id(reader), {})
        return any(slot not in rewired for slot in slots)

    def is_output(self, node: Operator) -> bool:
        return any(t in self.graph.outputs for t in node.outputs)

    def label(self, node: object) -> str:
        if isinstance(node, Operator):
            return f"{node.code} → {self.graph.tensors[node.outputs[0]].name}"
        return self.graph.tensors[node].name if self.is_value(node) else repr(node)

    def why_not_rewrite(self, node: Operator) -> str | None:
        return None  # no Circle operator writes an input or draws random numbers

    def why_not_replace(self, node: Operator, value: object) -> str | None:
        if self.is_output(node):
            return "its result is a graph output"
        return None

    def written_between(self, value: object, first: object, last: object) -> bool:
        return False

    def first(self, nodes: Iterable[Operator]) -> Operator:
        return min(nodes, key=lambda op: self._position[id(op)])

    def plan_replace(self, node: Operator, value: object) -> None:
        self._replaced[node.outputs[0]] = value

    def plan_rewire(self, node: Operator, operands: Mapping) -> None:
        self._rewired.setdefault(id(node), {}).update(operands)

    # ---------------------------------------------------------------- transform

    def resolve(self, value: object) -> object:
        while self.is_value(value) and value in self._replaced:
            value = self._replaced[value]
        return value

    def replace(self, node: Operator, value: int) -> None:
        old = node.outputs[0]
        readers = self._readers.pop(old, [])
        for op in readers:
            op.inputs = [value if i == old else i for i in op.inputs]
        self._readers.setdefault(value, []).extend(readers)
        self.graph.outputs = [value if i == old else i for i in self.graph.outputs]
        self._replaced[old] = value

    def rewire(self, node: Operator, operands: Mapping) -> None:
        for slot, value in operands.items():
            node.inputs[slot] = self.resolve(value)
            self._readers.setdefault(node.inputs[slot], []).append(node)

    def build_before(self, node: Operator, rule, match) -> object:
        return rule.build(self.graph, match)

    def erase(self, node: Operator) -> None:
        self._erased.add(id(node))

    def erase_unread(self, nodes: Iterable[Operator]) -> None:
        for node in nodes:
            if not any(self._still_read(t) for t in node.outputs):
                self._erased.add(id(node))

    def _still_read(self, tensor: int) -> bool:
        # A scan, not the readers map: a rule's build may have rewired anything.
        if tensor in self.graph.outputs:
            return True
        erased = self._erased
        return any(id(op) not in erased and tensor in op.inputs for op in self.graph.operators)

    def rely_on_layout(self, values: Iterable[object]) -> None:
        pass

    def finish(self) -> None:
        if self._erased:
            self.graph.operators = [op for op in self.graph.operators if id(op) not in self._erased]


class CircleRulePass(RulePass):
    """A :class:`~fxopt.passes.rules.RulePass` over a Circle graph."""

    graph_kind = CIRCLE

    def view(self, graph: CircleGraph) -> CircleView:
        return CircleView(graph)
