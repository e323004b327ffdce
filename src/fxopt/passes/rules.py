"""Rules: a pattern over several nodes, a check, and a replacement. The engine decides the rest.

A :class:`Rule` says what it matches (:mod:`fxopt.ir.pattern`), why a match is not right
for it (``check``, a reason or None) and what replaces the match's root: an existing value
(``replace_with``, known while planning), operands rewired in place (:class:`Rewire`), or
nodes built at transform time (``build``, with :func:`fxopt.ir.ops.emit`). A
:class:`RulePass` runs a list of rules; it alone decides whether a match may be replaced,
with the same questions for every rule, and records each refusal with its reason:

* a matched node below the root that is read outside the match, or returned: replacing
  the match would compute it twice or drop it (a rule whose replacement leaves those nodes
  in place says ``keeps_inputs``);
* a matched node that is more than its value: random, in place, stateful, unknown, a view
  written in place (:class:`fxopt.ir.safety.Safety`);
* a value the replacement reads that is written in place between the match's first node
  and its root (the replacement reads it at the root);
* a root whose replacement would hand the caller a tensor it already holds;
* a node another planned rewrite already consumes.

Planned rewrites are visible to the matches after them: a root replaced by a value reads
as that value, a rewired node reads its new operands.

    >>> import torch
    >>> from fxopt.ir.pattern import Op, Var
    >>> from fxopt.passes.rules import Rule, RulePass
    >>> class DoubleNegation(Rule):
    ...     name = "-(-x) → x"
    ...     pattern = Op("neg", input=Op("neg", input=Var("x")))
    ...     def replace_with(self, match):
    ...         return match["x"]
    >>> class Negations(RulePass):
    ...     name, rules = "negations", (DoubleNegation(),)
    >>> gm = torch.fx.symbolic_trace(lambda x: -(-x) + 1)
    >>> Negations()(gm).stats
    {'-(-x) → x': 1}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from fxopt.ir.pattern import (
    GraphView,
    Match,
    NodePattern,
    Op,
    find,
    matcher,
    may_root,
    specialize,
)
from fxopt.passes.base import Pass, PassResult, Plan, Skip

__all__ = ["Rewire", "RewriteView", "Rule", "RulePass", "RuleSite"]


@dataclass(frozen=True)
class Rewire:
    """The root stays; its operands at these keys read other values."""

    operands: Mapping[Hashable, object]


class Rule:
    """One rewrite: set ``name`` and ``pattern``, write ``check`` and one of
    ``replace_with`` / ``build``."""

    #: Shown in stats, skips and reports.
    name: ClassVar[str] = ""
    pattern: ClassVar[NodePattern]
    #: The pass's counter this rule's rewrites add to (default: the rule's name).
    stat: ClassVar[str] = ""
    #: The replacement leaves the matched nodes below the root in place (they may be read
    #: outside the match); the engine then erases only those left unread.
    keeps_inputs: ClassVar[bool] = False
    #: Why the rewrite is exact for finite inputs only (None: exact for every input). Such
    #: a rule applies only in a pass built with ``fast_math=True``.
    inexact: ClassVar[str | None] = None
    #: What reports call the inexact rewrite (default: the rule's name).
    inexact_name: ClassVar[str] = ""

    def applies(self, match: Match) -> bool:
        """False when the match is not what the rule is about (no reason recorded: ``x.view(s)``
        to another shape is not a no-op, nothing was refused)."""
        return True

    #: A looser pattern for ``--explain``: when ``pattern`` does not match a node and this
    #: does, :meth:`near_miss` says why the rule does not apply there.
    near: ClassVar[NodePattern | None] = None

    def near_miss(self, match: Match) -> str | None:
        """Why a match of ``near`` is not a match of ``pattern`` (None: say nothing)."""
        return None

    def check(self, match: Match) -> str | None:
        """Why not to rewrite this match, which the rule is about (None: rewrite it);
        refusals are recorded for ``--explain``."""
        return None

    def counter(self, replacement: object) -> str:
        """The stat a rewrite counts under (default: ``stat``, else the rule's name)."""
        return self.stat or self.name

    def is_inexact(self, match: Match) -> bool:
        """True when ``inexact`` applies to this match (say, only on floating results)."""
        return self.inexact is not None

    def replace_with(self, match: Match) -> object | Rewire | None:
        """An existing value that replaces the root, or a :class:`Rewire`; None: ``build``."""
        return None

    def build(self, graph: object, match: Match) -> object:
        """New nodes that replace the root (built just before it); returns the root's
        replacement, the root itself when it changed the root in place, or None when it
        moved the root's result elsewhere (the root is then erased)."""
        raise NotImplementedError(f"{type(self).__name__}: replace_with or build")

    def relies_on(self, match: Match) -> tuple[object, ...]:
        """Values whose layout (strides, contiguity) the rewrite relies on."""
        return ()


class RewriteView(GraphView, Protocol):
    """What the engine asks of a graph beyond matching; fx and Circle answer alike."""

    def nodes(self, names: frozenset[str] | None = None) -> Iterable[object]: ...
    def readers(self, node: object) -> Iterable[object]: ...
    def is_output(self, node: object) -> bool: ...
    def label(self, node: object) -> str: ...
    def why_not_rewrite(self, node: object) -> str | None: ...
    def why_not_replace(self, node: object, value: object) -> str | None: ...
    def written_between(self, value: object, first: object, last: object) -> bool: ...
    def plan_replace(self, node: object, value: object) -> None: ...
    def plan_rewire(self, node: object, operands: Mapping) -> None: ...
    def first(self, nodes: Iterable[object]) -> object: ...
    # transform
    def resolve(self, value: object) -> object: ...
    def replace(self, node: object, value: object) -> None: ...
    def rewire(self, node: object, operands: Mapping) -> None: ...
    def build_before(self, node: object, rule: Rule, match: Match) -> object: ...
    def erase(self, node: object) -> None: ...
    def erase_unread(self, nodes: Iterable[object]) -> None: ...
    def rely_on_layout(self, values: Iterable[object]) -> None: ...
    def finish(self) -> None: ...


@dataclass(slots=True)  # not frozen: one per site, and a frozen __init__ is slow
class RuleSite:
    """A planned rewrite: the rule, its match, and the root's replacement if known."""

    rule: Rule
    match: Match
    replacement: object = None
    inexact: bool = False


@dataclass(frozen=True)
class RulePlan(Plan):
    sites: tuple[RuleSite, ...] = ()


class RulePass(Pass[RulePlan]):
    """A pass made of rules. Subclasses set ``name``, ``description`` and ``rules``; a pass
    on another graph kind sets ``graph_kind`` and overrides :meth:`view`."""

    rules: ClassVar[tuple[Rule, ...]] = ()
    #: Counters reported even when zero (a rule counts under its ``counter``).
    counters: ClassVar[tuple[str, ...]] = ()
    #: What ``verify`` calls the matches left after the pass.
    leftovers: ClassVar[str] = "matches"
    #: Plan again after each round of rewrites until nothing matches (for rules whose
    #: rewrites make new matches).
    repeat: ClassVar[bool] = False
    idempotent = True  # verify() re-plans and asserts nothing is left

    def __init__(self, fast_math: bool = False):
        self.fast_math = fast_math

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        inexact = {
            rule.inexact_name or rule.name: rule.inexact for rule in cls.rules if rule.inexact
        }
        if inexact:
            cls.inexact_rewrites = inexact

    def view(self, graph) -> RewriteView:
        from fxopt.ir.views import FxView

        return FxView(graph)

    def analyze(self, graph) -> RulePlan:
        view = self.view(graph)
        by_op: dict[str, list[tuple[Rule, NodePattern, NodePattern | None]]] = {}
        consumed: set[int] = set()
        sites, skipped = [], []
        for node in view.nodes(self._roots()):
            name = view.op_name(node)
            candidates = by_op.get(name)
            if candidates is None:
                candidates = by_op[name] = self._candidates(view, name)
            refusal = None
            for rule, matches, near, may_root_at in candidates:
                if may_root_at is not None and not may_root_at(node):
                    if near is None:
                        continue  # (cheap: most nodes are not a rule's root)
                    matches = None  # only the near pattern's "why not" is left
                found = self._first_valid(view, rule, matches, near, node, consumed)
                if isinstance(found, RuleSite):
                    sites.append(found)
                    self._plan(view, found, consumed)
                    break
                if found and not refusal:  # (a pass of one rule needs no rule name)
                    refusal = f"{rule.name}: {found}" if len(self.rules) > 1 else found
            else:
                if refusal:
                    skipped.append(Skip(view.label(node), refusal))
        return RulePlan(skipped=tuple(skipped), sites=tuple(sites))

    def _roots(self) -> frozenset[str] | None:
        """The op names a node must have for any rule to look at it (None: any node)."""
        names: set[str] = set()
        for rule in self.rules:
            for pattern in (rule.pattern, rule.near):
                if pattern is not None:
                    found = pattern.names()
                    if not found:
                        return None
                    names |= found
        return frozenset(names)

    def _candidates(self, view, name: str) -> list[tuple]:
        """(rule, its matcher and near pattern for roots of op ``name``, the cheap test a
        root must pass before matching or None when there is none) for every rule that
        may match such a root."""
        found = []
        for rule in self.rules:
            pattern = specialize(rule.pattern, name)
            near = None if rule.near is None else specialize(rule.near, name)
            if pattern is not None or near is not None:
                matches = None if pattern is None else matcher(view, pattern, root_checked=True)
                found.append((rule, matches, near, _root_test(view, pattern)))
        return found

    def _first_valid(
        self, view, rule: Rule, matches, near, node, consumed: set[int]
    ) -> RuleSite | str | None:
        """The first match of ``rule`` at ``node`` the engine and the rule accept; else the
        first refusal's reason; None when nothing matches."""
        first_reason = None
        for match in matches(node) if matches is not None else ():
            if not rule.applies(match):
                continue
            # (the rule's check first: it is cheaper than the engine's alias questions)
            reason = rule.check(match) or _why_not(view, rule, match, consumed)
            inexact = reason is None and rule.is_inexact(match)
            if inexact and not self.fast_math:
                reason = f"{rule.inexact}: exact for finite inputs only; fast_math applies it"
            replacement = None
            if reason is None:
                replacement = rule.replace_with(match)
                if replacement is not None and not isinstance(replacement, Rewire):
                    replacement = view.resolve(replacement)
                    reason = view.why_not_replace(match.root, replacement)
            if reason is None:
                return RuleSite(rule, match, replacement, inexact)
            first_reason = first_reason or reason
        if first_reason is None and near is not None:
            first_reason = next(filter(None, map(rule.near_miss, find(view, near, node))), None)
        return first_reason

    @staticmethod
    def _plan(view, site: RuleSite, consumed: set[int]) -> None:
        match, replacement = site.match, site.replacement
        if isinstance(replacement, Rewire):
            view.plan_rewire(match.root, replacement.operands)
        else:
            consumed.add(id(match.root))
            if replacement is not None:
                view.plan_replace(match.root, replacement)
        if not site.rule.keeps_inputs:
            for node in match.nodes[1:]:
                consumed.add(id(node))

    def transform(self, graph, plan: RulePlan) -> PassResult:
        stats: dict[str, int] = dict.fromkeys(self.counters, 0)
        inexact: dict[str, int] = {}
        while plan.sites:
            self._apply(graph, plan.sites, stats, inexact)
            # A rewrite may make a new match of another rule (an ADD folded into the weights
            # of the FC it feeds puts the MUL before it next to the FC).
            plan = self.analyze(graph) if self.repeat else RulePlan()
        changed = any(stats.values())
        return PassResult(changed, stats, plan.skipped, inexact=inexact)

    def _apply(self, graph, sites, stats: dict, inexact: dict) -> None:
        view = self.view(graph)
        view.rely_on_layout(v for site in sites for v in site.rule.relies_on(site.match))
        for site in sites:
            rule, match = site.rule, site.match.resolved(view.resolve)
            replacement = site.replacement
            if isinstance(replacement, Rewire):
                view.rewire(match.root, replacement.operands)
            else:
                if replacement is None:
                    replacement = view.build_before(match.root, rule, match)
                if replacement is not match.root:  # (the root itself: changed in place)
                    if replacement is not None:
                        view.replace(match.root, view.resolve(replacement))
                    view.erase(match.root)
            view.erase_unread(match.nodes[1:])
            key = rule.counter(site.replacement)
            stats[key] = stats.get(key, 0) + 1
            if site.inexact:
                key = rule.inexact_name or rule.name
                inexact[key] = inexact.get(key, 0) + 1
        view.finish()

    def verify(self, graph) -> None:
        left = [site.match.root for site in self.analyze(graph).sites]
        assert not left, f"{self.leftovers} left after {self.name}: {left[:8]}"


def _root_test(view, pattern) -> Callable[[object], bool] | None:
    """A cheap necessary condition for ``pattern``, specialized to one root op, to match
    at a root (None: there is none). A plain Op has the root's op already: only its given
    literals are left. Asked of every candidate root: most nodes fail here."""
    if pattern is None:
        return lambda node: False
    if not isinstance(pattern, Op) or pattern.optional is not None:
        return lambda node: may_root(view, pattern, node)
    tests = tuple(map(view.passes_test, pattern.given))
    if not tests:
        return None
    if len(tests) == 1:
        return tests[0]
    return lambda node: all(passes(node) for passes in tests)


def _why_not(view, rule: Rule, match: Match, consumed: set[int]) -> str | None:
    """The engine's refusal of a match, the same for every rule (None: it may be replaced)."""
    nodes = match.nodes
    why_not_rewrite = view.why_not_rewrite
    for node in nodes:
        if id(node) in consumed:
            return f"{view.label(node)} is already rewritten by another match"
        reason = why_not_rewrite(node)
        if reason is not None:
            return reason
    if len(nodes) == 1:
        return None
    inside = {id(node) for node in nodes}  # (by identity: Circle operators compare equal)
    if not rule.keeps_inputs:
        for node in nodes[1:]:
            if view.is_output(node):
                return f"{view.label(node)} inside the match is returned"
            for reader in view.readers(node):
                if id(reader) not in inside:
                    read = view.label(reader)
                    return f"{view.label(node)} inside the match is also read by {read}"
    is_value = view.is_value
    values = [v for v in match.bindings.values() if id(v) not in inside and is_value(v)]
    first = view.first(nodes) if values else None
    for value in values:
        if view.written_between(value, first, match.root):
            return f"{view.label(value)} is written in place between the match's nodes"
    return None
