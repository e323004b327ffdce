"""Patterns over several nodes: what a rule matches, on any graph that answers four questions.

A pattern is read from its root up through the inputs. :class:`Op` matches a node by its
canonical op name (several names are alternatives) and its operands by key: a canonical
argument name on an fx graph (``input``, ``other``), a slot number on a Circle graph.
:class:`Var` binds any value (the same name twice must be the same value), a Python literal
matches an equal literal operand (``1`` matches ``1`` and ``1.0``, never ``True``),
``a | b`` tries ``a`` then ``b``, :data:`ABSENT` matches an operand that is not given, and
:class:`Given` a literal the call itself passes (cheap to reject)::

    >>> import torch
    >>> from fxopt.ir.pattern import Op, Var, find
    >>> from fxopt.ir.views import FxView
    >>> gm = torch.fx.symbolic_trace(lambda a, b: (a * 2 + b).relu())
    >>> scaled_sum = Op("add", input=Op("mul", input=Var("x"), other=2), other=Var("y"),
    ...                 commutative=True)
    >>> view = FxView(gm)
    >>> [m["x"].name for m in find(view, scaled_sum, list(gm.graph.nodes)[3])]
    ['a']

``Op("*")`` matches a node of any op. ``commutative=True`` lets the first two operands
swap; ``optional=key`` makes the node itself optional (the pattern at ``key`` then matches
the value the node would have read: ``Op("clone", input=x, optional="input")`` matches
``clone(v)`` and ``v``).

What the pattern does not say, the engine (:mod:`fxopt.passes.rules`) checks for every
rule: a matched node below the root that is read outside the match or returned, a node that
is more than its value (random, in place, stateful), an operand written in place between
the match's first node and its root.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "ABSENT",
    "MISSING",
    "AnyOf",
    "Given",
    "GraphView",
    "Literal",
    "Match",
    "NodePattern",
    "Op",
    "Var",
    "find",
    "matcher",
]


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: What :meth:`GraphView.operand` returns for an operand the node does not have.
MISSING = _Missing()


class GraphView(Protocol):
    """What the matcher asks of a graph (fx: :class:`fxopt.ir.views.FxView`; Circle:
    :class:`fxopt.circle.passes.view.CircleView`)."""

    def producer(self, value: object) -> object | None:
        """The node that computes ``value`` (None: an input, a constant, a literal)."""

    def op_name(self, node: object) -> str | None:
        """The node's canonical op name."""

    def operand(self, node: object, key: Hashable) -> object:
        """The node's operand at ``key`` (:data:`MISSING` when it has none)."""

    def is_value(self, operand: object) -> bool:
        """True when ``operand`` is a graph value (not a Python literal)."""

    def passes(self, node: object, literal: Given) -> bool:
        """True when ``node``'s own arguments hold a literal ``literal`` accepts."""

    def passes_test(self, literal: Given) -> Callable[[object], bool]:
        """``passes`` for one literal at many nodes (asked of every candidate root)."""


class NodePattern:
    """Base of the pattern language; ``a | b`` is :class:`AnyOf`."""

    def __or__(self, other: object) -> AnyOf:
        return AnyOf((self, _pattern(other)))

    def names(self) -> frozenset[str]:
        """The op names a root of this pattern may have (empty: any node)."""
        return frozenset()


@dataclass(frozen=True)
class Var(NodePattern):
    """Any value; a named one binds, and binds the same value wherever it appears."""

    name: str | None = None


@dataclass(frozen=True)
class Literal(NodePattern):
    """An operand equal to ``value``: a number matches a number of either type (``1`` and
    ``1.0``) but never a bool; anything else matches by equality and type."""

    value: object

    def accepts(self, operand: object) -> bool:
        want = self.value
        if isinstance(want, (int, float)) and not isinstance(want, bool):
            return type(operand) in (int, float) and operand == want
        return type(operand) is type(want) and operand == want


@dataclass(frozen=True)
class Given(Literal):
    """A literal the call passes itself (not a default it leaves out): a node whose own
    arguments hold no such literal is rejected before its arguments are bound, which makes
    a rule on common ops (``x * 1`` among all multiplications) cheap."""


@dataclass(frozen=True)
class _Absent(NodePattern):
    def __repr__(self) -> str:
        return "ABSENT"


#: An operand that is not given (or given as None).
ABSENT = _Absent()


@dataclass(frozen=True)
class AnyOf(NodePattern):
    """The first of ``choices`` that matches (each is tried, in order)."""

    choices: tuple[NodePattern, ...]

    def __or__(self, other: object) -> AnyOf:
        return AnyOf((*self.choices, _pattern(other)))

    def names(self) -> frozenset[str]:
        found = [choice.names() for choice in self.choices]
        return frozenset() if any(not names for names in found) else frozenset().union(*found)


@dataclass(frozen=True, init=False)
class Op(NodePattern):
    """A node whose op is one of ``names``, with operands matching ``operands``."""

    ops: frozenset[str]
    operands: tuple[tuple[Hashable, NodePattern], ...]
    bind: str | None = None
    commutative: bool = False
    optional: Hashable | None = None
    given: tuple[Given, ...] = ()
    orders: tuple = ()  # the operand lists to try (two when commutative)
    simple: bool = True  # one way to match at most: no alternatives, optional nodes, swaps

    def __init__(
        self,
        names: str | Iterable[str],
        *positional: object,
        bind: str | None = None,
        commutative: bool = False,
        optional: Hashable | None = None,
        **named: object,
    ):
        ops = frozenset((names,) if isinstance(names, str) else names)
        ops = ANY_OP if ops == ANY_OP else ops
        operands = [(i, _pattern(p)) for i, p in enumerate(positional)]
        operands += [(key, _pattern(p)) for key, p in named.items()]
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "operands", tuple(operands))
        object.__setattr__(self, "bind", bind)
        object.__setattr__(self, "commutative", commutative)
        object.__setattr__(self, "optional", optional)
        object.__setattr__(self, "given", tuple(p for _, p in operands if isinstance(p, Given)))
        object.__setattr__(self, "orders", _orders(self))
        simple = optional is None and not commutative
        simple = simple and all(_is_simple(p) for _, p in operands)
        object.__setattr__(self, "simple", simple)
        if optional is not None and optional not in dict(operands):
            raise ValueError(f"Op({sorted(ops)}): optional={optional!r} is not an operand")

    def names(self) -> frozenset[str]:
        if self.optional is not None or self.ops is ANY_OP:
            return frozenset()  # any node, or the root may be the node or what it reads
        return self.ops


#: ``Op("*")``: a node of any op.
ANY_OP: frozenset[str] = frozenset(("*",))


def _is_simple(pattern: NodePattern) -> bool:
    return not isinstance(pattern, AnyOf) and getattr(pattern, "simple", True)


def _pattern(value: object) -> NodePattern:
    return value if isinstance(value, NodePattern) else Literal(value)


@dataclass(slots=True)  # not frozen: one per match, and a frozen __init__ is slow
class Match:
    """One match: its root, every matched node (root first, then in pattern order), and
    the bound names (``match["x"]``)."""

    root: object
    nodes: tuple[object, ...]
    bindings: Mapping[str, object]
    #: What the match is in (the view's ``graph``: a GraphModule, a CircleGraph).
    graph: object = None
    #: What a rule's check found, for its replacement to read (say, modules it looked up).
    notes: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> object:
        return self.bindings[name]

    def get(self, name: str, default: object = None) -> object:
        return self.bindings.get(name, default)

    def resolved(self, resolve: Callable[[object], object]) -> Match:
        """This match with every bound value read through ``resolve`` (the values that
        earlier rewrites replaced)."""
        bindings = {k: resolve(v) for k, v in self.bindings.items()}
        return Match(self.root, self.nodes, bindings, self.graph, self.notes)

    def values(self) -> list[object]:
        """The values bound from outside the match (the operands its replacement reads)."""
        nodes = self.nodes
        return [v for v in self.bindings.values() if not _among(v, nodes)]


# A partial match while searching: bindings so far and the nodes matched so far.
_State = tuple[dict, tuple]


def find(
    view: GraphView, pattern: NodePattern, root: object, *, may_root_checked: bool = False
) -> Iterator[Match]:
    """Every match of ``pattern`` rooted at node ``root``, most specific choice first
    (``may_root_checked``: the caller has asked :func:`may_root` already)."""
    if isinstance(pattern, AnyOf):  # only the alternatives whose root this node may be
        choices = [c for c in pattern.choices if may_root(view, c, root)]
        pattern = choices[0] if len(choices) == 1 else AnyOf(tuple(choices))
    elif not may_root_checked and not may_root(view, pattern, root):
        return iter(())
    if isinstance(pattern, Op) and pattern.simple:
        return iter(matcher(view, pattern, root_checked=True)(root))
    graph = getattr(view, "graph", None)
    return (
        Match(nodes[0], nodes, bindings, graph)
        for bindings, nodes in _match(view, pattern, root, ({}, ()), root_node=True)
        if nodes
    )


def matcher(
    view: GraphView, pattern: NodePattern, *, root_checked: bool = False
) -> Callable[[object], Iterable[Match]]:
    """:func:`find` for one pattern at many roots: the pattern is prepared for ``view``
    once. A pattern with one way to match at most becomes a chain of closures (no
    generators, no pattern-type dispatch per node): a pass asks this at every candidate
    root of a 100k-node graph. ``root_checked``: every root it is given has the pattern's
    root op and given literals."""
    if not (isinstance(pattern, Op) and pattern.simple):
        return lambda root: find(view, pattern, root, may_root_checked=root_checked)
    graph = getattr(view, "graph", None)
    matches_root = _compiled(view, pattern, root="checked" if root_checked else "root")

    def match(root: object) -> tuple[Match, ...]:
        bindings: dict = {}
        nodes: list = []
        if matches_root(root, bindings, nodes):
            return (Match(nodes[0], tuple(nodes), bindings, graph),)
        return ()

    return match


def specialize(pattern: NodePattern, name: str) -> NodePattern | None:
    """``pattern`` for roots whose op is ``name``: the alternatives that may match there
    (None: none may). A pass asks once per op name, not once per node."""
    if isinstance(pattern, AnyOf):
        choices = [c for c in pattern.choices if specialize(c, name) is not None]
        if not choices:
            return None
        return choices[0] if len(choices) == 1 else AnyOf(tuple(choices))
    names = pattern.names()
    return pattern if not names or name in names else None


def may_root(view: GraphView, pattern: NodePattern | None, root: object) -> bool:
    """A cheap necessary condition: ``root`` has the op and the given literals of the
    pattern's root (an optional root, or a pattern that is not an Op, may match anything)."""
    if isinstance(pattern, AnyOf):
        return any(may_root(view, choice, root) for choice in pattern.choices)
    if not isinstance(pattern, Op) or pattern.optional is not None:
        return pattern is not None
    return _accepts(view, pattern, root)


def _match(
    view: GraphView, pattern: NodePattern, value: object, state: _State, root_node: bool = False
) -> Iterator[_State]:
    if isinstance(pattern, Var):
        yield from _match_var(pattern, value, state)
    elif isinstance(pattern, Literal):
        if not view.is_value(value) and pattern.accepts(value):
            yield state
    elif pattern is ABSENT:
        if value is MISSING or value is None:
            yield state
    elif isinstance(pattern, AnyOf):
        for choice in pattern.choices:
            yield from _match(view, choice, value, state, root_node)
    elif isinstance(pattern, Op):
        yield from _match_op(view, pattern, value, state, root_node)
    else:
        raise TypeError(f"not a pattern: {pattern!r}")


# A compiled pattern: (operand value, bindings so far, nodes so far) → matched; it fills
# bindings and nodes in place (what a failed match left in them is not read).
_Compiled = Callable[[object, dict, list], bool]


def _compiled(view: GraphView, pattern: NodePattern, root: str = "") -> _Compiled:
    """A simple pattern (one way to match at most) as a closure over ``view``. ``root``:
    "root" for the root node, "checked" for a root whose op and literals are known good."""
    if isinstance(pattern, Op):
        return _compiled_op(view, pattern, root)
    if isinstance(pattern, Var):
        name = pattern.name
        if name is None:
            return lambda value, bindings, nodes: value is not MISSING

        def var(value: object, bindings: dict, nodes: list) -> bool:
            if value is MISSING:
                return False
            if name in bindings:
                bound = bindings[name]
                return bound is value or _same_literal(bound, value)
            bindings[name] = value
            return True

        return var
    if isinstance(pattern, Literal):
        is_value, accepts = view.is_value, pattern.accepts
        return lambda value, bindings, nodes: not is_value(value) and accepts(value)
    return lambda value, bindings, nodes: value is MISSING or value is None  # ABSENT


def _compiled_op(view: GraphView, pattern: Op, root: str) -> _Compiled:
    operands = tuple((key, _compiled(view, p)) for key, p in pattern.operands)
    operand, producer, is_value = view.operand, view.producer, view.is_value
    op_name = view.op_name
    names = None if root == "checked" or pattern.ops is ANY_OP else pattern.ops
    givens = () if root == "checked" else tuple(map(view.passes_test, pattern.given))
    bind = pattern.bind

    def op(value: object, bindings: dict, nodes: list) -> bool:
        if root:
            node = value
        else:
            node = producer(value) if is_value(value) else None
            if node is None or _among(node, nodes):
                return False
        if names is not None and op_name(node) not in names:
            return False
        for passes in givens:
            if not passes(node):
                return False
        if bind:
            bindings[bind] = node
        nodes.append(node)
        for key, matches in operands:  # noqa: SIM110 (a loop: no generator in the hot path)
            if not matches(operand(node, key), bindings, nodes):
                return False
        return True

    return op


def _match_var(pattern: Var, value: object, state: _State) -> Iterator[_State]:
    bindings, nodes = state
    if value is MISSING:
        return
    if pattern.name is None:
        yield state
    elif pattern.name not in bindings:
        yield {**bindings, pattern.name: value}, nodes
    elif bindings[pattern.name] is value or _same_literal(bindings[pattern.name], value):
        yield state


def _match_op(
    view: GraphView, pattern: Op, value: object, state: _State, root_node: bool
) -> Iterator[_State]:
    bindings, nodes = state
    node = value if root_node else (view.producer(value) if view.is_value(value) else None)
    if node is not None and _accepts(view, pattern, node) and not _among(node, nodes):
        bound = (
            {**bindings, pattern.bind: node} if pattern.bind else bindings,
            (*nodes, node),
        )
        for operands in pattern.orders:
            yield from _match_operands(view, node, operands, bound)
    if pattern.optional is not None:
        inner = dict(pattern.operands)[pattern.optional]
        yield from _match(view, inner, value, state, root_node)


def _accepts(view: GraphView, pattern: Op, node: object) -> bool:
    if pattern.ops is not ANY_OP and view.op_name(node) not in pattern.ops:
        return False
    for given in pattern.given:  # noqa: SIM110 (a loop: no generator in the hot path)
        if not view.passes(node, given):
            return False
    return True


def _among(node: object, nodes: tuple) -> bool:
    for other in nodes:  # noqa: SIM110 (a loop: no generator in the hot path)
        if other is node:
            return True
    return False


def _orders(pattern: Op) -> tuple[tuple[tuple[Hashable, NodePattern], ...], ...]:
    """The operand lists to try: as written, then with the first two keys' patterns swapped."""
    if not pattern.commutative or len(pattern.operands) < 2:
        return (pattern.operands,)
    (k0, p0), (k1, p1), *rest = pattern.operands
    return (pattern.operands, ((k0, p1), (k1, p0), *rest))


def _match_operands(
    view: GraphView, node: object, operands: tuple, state: _State
) -> Iterator[_State]:
    if not operands:
        yield state
        return
    (key, pattern), rest = operands[0], operands[1:]
    for after in _match(view, pattern, view.operand(node, key), state):
        yield from _match_operands(view, node, rest, after)


def _same_literal(a: object, b: object) -> bool:
    return type(a) is type(b) and not hasattr(a, "__len__") and a == b
