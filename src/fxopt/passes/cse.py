"""Common-subexpression elimination ("redundant-op elimination").

Two calls of the same pure op on the same inputs compute the same value; keep the first:

    a = relu(x)            a = relu(x)
    b = relu(x)     →      c = a + a
    c = a + b

Each call is keyed by a *structural* tuple: the call kind and target, its inputs (graph
position of the node each input resolves to, plus that input's storage version) and its
other arguments normalized to hashable, type-tagged values (``1``, ``1.0`` and ``True``
differ; ``-0.0`` differs from ``0.0``). Commutative ops sort their first two inputs. The
key never uses ``hash()`` alone or ``id()`` of an argument, so a collision cannot merge
unrelated nodes.

Never merged: random ops (two dropouts draw different masks), in-place and ``out=`` calls,
stateful modules (training-mode BatchNorm), unknown ops, and any value whose storage is
written in place anywhere in the graph (merging would let one write be seen through both
names). A read of ``x`` after a write into ``x`` (also through a view) has a newer storage
version, so ``x + 1`` before and after ``x.view(-1).mul_(2)`` are different values.
Duplicate ``call_module`` calls of the same pure leaf module (``self.encoder(x)`` twice)
merge like any other call; chains merge in one pass because inputs resolve to the node
that replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fxopt.ir import ops, shared
from fxopt.ir.alias import AliasAnalysis
from fxopt.ir.safety import Safety
from fxopt.passes.base import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class CsePlan(Plan):
    #: (duplicate, kept) pairs in graph order; the kept node always comes first.
    merges: tuple[tuple[fx.Node, fx.Node], ...] = ()


class _NotComparable(Exception):
    """An argument that has no structural key (e.g. a tensor constant)."""


_CONSTANT_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class CommonSubexpressionElimination(Pass[CsePlan]):
    name = "cse"
    description = "merge repeated pure computations on the same inputs (alias-aware)"
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing
    # dce erases only unused pure nodes: no write goes, no surviving node's inputs change,
    # so no two remaining nodes get equal keys that had different ones.
    not_enabled_by = ("dce",)

    def analyze(self, gm: fx.GraphModule) -> CsePlan:
        safety = Safety(gm)
        alias, table = safety.alias, safety.table
        replacement: dict[fx.Node, fx.Node] = {}
        seen: dict[tuple, fx.Node] = {}
        # Two nodes with equal structural keys call the same target on the same input
        # nodes, so a node is keyed only once a second node shares its target and inputs
        # (its "bucket"): most nodes of a real graph never do, and keying is the slow part.
        first_in_bucket: dict[tuple, fx.Node | None] = {}
        merges: list[tuple[fx.Node, fx.Node]] = []
        skipped: list[tuple[int, Skip]] = []  # with graph positions: sorted at the end

        def key_of(node: fx.Node) -> tuple | None:
            try:
                return _structural_key(node, replacement, alias, table[node].commutative)
            except _NotComparable as error:
                reason = f"argument cannot be compared: {error}"
                skipped.append((table.position[node], Skip(node.name, reason)))
                return None

        for node in gm.graph.nodes:
            op = table[node]
            if not op.compute:
                continue
            bucket = _bucket(node, replacement, table.position, op.commutative)
            first = first_in_bucket.setdefault(bucket, node)
            if first is node:  # a new bucket (most nodes)
                continue
            if first is not None:  # the bucket's first node, keyed now that it has company
                first_in_bucket[bucket] = None
                first_key = key_of(first)
                if first_key is not None:
                    seen.setdefault(first_key, first)
            key = key_of(node)
            earlier = seen.get(key) if key is not None else node
            if earlier is None:
                seen[key] = node  # kept even when impure, to report why it is not merged
            elif earlier is not node:
                reason = safety.why_not_merge(node, earlier)
                if reason is None:
                    merges.append((node, earlier))
                    replacement[node] = earlier
                    safety.planned(node, earlier)
                    continue
                if safety.why_not_share(node) is None:
                    seen[key] = node  # a later duplicate may still merge with this one
                skip = Skip(node.name, f"not merged with {earlier.name}: {reason}")
                skipped.append((table.position[node], skip))
        skipped.sort(key=lambda entry: entry[0])
        return CsePlan(skipped=tuple(skip for _, skip in skipped), merges=tuple(merges))

    def transform(self, gm: fx.GraphModule, plan: CsePlan) -> PassResult:
        # The shared alias analysis follows the merges instead of being rebuilt: merged
        # values are never written (see _reason_not_to_merge), so their classes just join.
        # The op table stays sound: a user reading the kept node is the same op.
        alias = shared.peek(gm, "alias")
        for duplicate, kept in plan.merges:
            duplicate.replace_all_uses_with(kept)
            gm.graph.erase_node(duplicate)
            if alias is not None:
                alias.replace(duplicate, kept)
        return PassResult(
            changed=bool(plan.merges),
            stats={"merged": len(plan.merges)},
            skipped=plan.skipped,
            keeps=("ops", "alias") if alias is not None else ("ops",),
        )

    def verify(self, gm: fx.GraphModule) -> None:
        left = self.analyze(gm).merges
        assert not left, f"duplicates left after cse: {[(a.name, b.name) for a, b in left]}"


def _bucket(
    node: fx.Node, replacement: dict[fx.Node, fx.Node], position: dict, commutative: bool
) -> tuple:
    """What nodes with equal structural keys share: kind, target and input nodes.

    Inputs are resolved through ``replacement`` and deduplicated (``add(a, b)`` with ``b``
    merged into ``a`` must meet ``add(a, a)``), and sorted for commutative ops.
    """
    inputs = ops.input_nodes(node)
    target = node.target if node.op != "call_module" else str(node.target)
    count = len(inputs)
    if count == 1:  # most nodes: nothing to deduplicate or sort
        only = next(iter(inputs))
        return (node.op, target, replacement.get(only, only))
    if count == 2:  # binary ops, the rest of most graphs: without the general machinery
        a, b = inputs
        a, b = replacement.get(a, a), replacement.get(b, b)
        if a is b:
            return (node.op, target, a)
        if commutative and position[b] < position[a]:
            a, b = b, a
        return (node.op, target, a, b)
    resolved = dict.fromkeys(replacement.get(n, n) for n in inputs)
    ordered = sorted(resolved, key=position.__getitem__) if commutative else resolved
    return (node.op, target, *ordered)


# Runs per node, and norm per argument: one flat ladder of type checks, commonest first,
# is faster than helper calls and reads as the list of cases.
def _structural_key(  # noqa: C901
    node: fx.Node, replacement: dict[fx.Node, fx.Node], alias: AliasAnalysis, commutative: bool
) -> tuple:
    position, version = alias.position, alias.version

    def norm(value: object) -> tuple:  # noqa: C901 (hot: see above)
        kind = type(value)
        if kind is fx.Node:
            value = replacement.get(value, value)
            return ("node", position[value], version(value, at=node))
        tag = _SCALAR_TAGS.get(kind)
        if tag is not None:  # exact types: bool is not int, so True and 1 differ
            return (tag, value)
        if value is None:
            return ("none",)
        if kind is float:
            return ("float", value.hex())  # distinguishes -0.0 and keeps nan == nan
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(norm(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((str(k), norm(v)) for k, v in sorted(value.items())))
        if isinstance(value, slice):
            return ("slice", norm(value.start), norm(value.stop), norm(value.step))
        if isinstance(value, _CONSTANT_TYPES):
            return (type(value).__name__, str(value))
        if isinstance(value, fx.Node):  # a Node subclass
            value = replacement.get(value, value)
            return ("node", position[value], version(value, at=node))
        if isinstance(value, (bool, int, str)):  # subclasses, e.g. an IntEnum
            return (type(value).__name__, value)
        if isinstance(value, float):
            return ("float", value.hex())
        if isinstance(value, complex):
            return ("complex", value.real.hex(), value.imag.hex())
        if value is Ellipsis:
            return ("ellipsis",)
        raise _NotComparable(type(value).__name__)

    args = [norm(a) for a in node.args]
    if commutative and len(args) >= 2:
        # Keys of one tag hold values of one type, so they compare as tuples (no repr()).
        args[:2] = sorted(args[:2])
    target = node.target if node.op != "call_module" else str(node.target)
    kwargs = node.kwargs
    return (node.op, target, tuple(args), norm(dict(kwargs)) if kwargs else _NO_KWARGS)


_SCALAR_TAGS = {bool: "bool", int: "int", str: "str"}
_NO_KWARGS = ("dict", ())
