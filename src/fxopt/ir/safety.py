"""May a node be removed, merged or replaced? One answer, with the reason, for every pass.

A rewrite that is right for the values can still be wrong for the program: deleting an
unused ``x.mul_(2)`` drops a write; merging two dropouts makes them share a mask; replacing
``y = x.clone()`` by ``x`` when ``y`` is later written in place lets the write reach
``x``; replacing a returned value by an input hands the caller a tensor it already holds.
:class:`Safety` asks the op table, the alias analysis and the caller's storage once per
analysis and says why not (None when the rewrite is safe):

    >>> import torch
    >>> from fxopt.ir.safety import Safety
    >>> def f(x):
    ...     y = x.clone()
    ...     y.add_(1)
    ...     return y
    >>> gm = torch.fx.symbolic_trace(f)
    >>> x, clone = list(gm.graph.nodes)[:2]
    >>> Safety(gm).why_not_replace(clone, x)
    'the value is written in place; removing the op would alias it'

A pass that plans several rewrites in one analysis records each one it plans
(:meth:`Safety.planned`), so later answers see the graph as it will be.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import fx

from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis, CallerStorage


def why_kept(op: ops.OpInfo) -> str | None:
    """Why a node with these traits is more than its value: it may not be removed, merged
    or recomputed (None when it may)."""
    if not op.known:  # first: an unknown op is also marked as writing all its inputs
        return f"unknown op '{op.name}' ({op.unknown_because or 'assumed to have side effects'})"
    if op.random:
        return f"'{op.name}' is random (each call draws new numbers)"
    if op.inplace:
        return f"'{op.name}' writes into its input"
    if op.stateful:  # a BatchNorm in training mode: it updates its running statistics
        return f"'{op.name}' updates module state (it is in training mode: call model.eval())"
    if not op.pure:
        return f"'{op.name}' has side effects"
    return None


class Safety:
    """The safety questions of one analysis of ``gm`` (build one per ``analyze``)."""

    def __init__(self, gm: fx.GraphModule):
        self._gm = gm
        self.table = ops.table(gm)
        self._alias: AliasAnalysis | None = None  # built on the first question needing it
        self._caller_storage: CallerStorage | None = None

    @property
    def alias(self) -> AliasAnalysis:
        if self._alias is None:
            self._alias = AliasAnalysis.of(self._gm)
        return self._alias

    @property
    def _caller(self) -> CallerStorage:
        if self._caller_storage is None:
            self._caller_storage = self.alias.caller_storage(self._gm)
        return self._caller_storage

    def why_not_remove(self, node: fx.Node, removed: Collection[fx.Node] = ()) -> str | None:
        """Why ``node`` must stay although nothing reads its result (or None). ``removed``:
        nodes already found removable; an in-place write into values nothing else reads
        (the graph's own fresh results, every other reader among ``removed``) may go."""
        if node.op == "get_attr":
            return None  # the attribute stays on the module; only the read goes
        if node.op in ("placeholder", "output"):
            return "the signature must not change"
        op = self.table[node]
        reason = why_kept(op)
        if reason is not None and op.known and op.inplace and not (op.random or op.stateful):
            written = list(ops.mutated_nodes(node, op))
            if written and all(self._private(v, node, removed) for v in written):
                return None  # (export's lift_fresh_copy + detach_ of a constant)
        return reason

    def _private(self, value: fx.Node, writer: fx.Node, removed: Collection[fx.Node]) -> bool:
        """True when ``value`` is a fresh tensor of the graph's own (a pure op's result,
        not a view) that nothing but ``writer`` and ``removed`` nodes reads: a write into
        it is seen by no one."""
        if value.op != "call_function":
            return False
        op = self.table[value]
        if why_kept(op) is not None or op.view:
            return False
        return all(
            user is writer or user in removed or self._unread_write_into(user, value, removed)
            for user in value.users
        )

    def _unread_write_into(self, node: fx.Node, value: fx.Node, removed: Collection) -> bool:
        """True when ``node`` is another in-place write into ``value`` alone whose result
        nothing outside ``removed`` reads (two writes into one unread value go together)."""
        op = self.table[node]
        return (
            op.known
            and op.inplace
            and not (op.random or op.stateful)
            and list(ops.mutated_nodes(node, op)) == [value]
            and node.users.keys() <= set(removed)
        )

    def why_not_merge(self, node: fx.Node, kept: fx.Node) -> str | None:
        """Why ``node`` may not be replaced by ``kept``, an identical earlier call."""
        reason = self.why_not_share(node) or self.why_not_share(kept)
        if reason is None and self._caller.would_share(node, kept):
            reason = "both are returned (or one is an input): one tensor twice to the caller"
        return reason

    def why_not_replace(self, node: fx.Node, value: fx.Node) -> str | None:
        """Why ``node``'s users may not read ``value`` instead (``value`` computes the
        same numbers: the question is storage, not arithmetic)."""
        alias = self.alias
        if alias.is_written(node) or alias.is_written(value):
            return "the value is written in place; removing the op would alias it"
        if not self.table[node].view and self._caller.would_share(node, value):
            # x * 1 or x.clone() returned: the caller would get back a tensor it already
            # holds (an input, a parameter, another output) and could write through it.
            return "the result is returned; it would share storage with an input or output"
        return None

    def why_not_rewrite(self, node: fx.Node) -> str | None:
        """Why ``node`` may not be computed another way: it is more than its value, or a
        view that a later in-place write reaches its input through."""
        op = self.table[node]
        reason = why_kept(op)
        if reason is None and op.view and self.alias.is_written(node):
            reason = f"'{op.name}' may be a view, and its storage is written in place"
        return reason

    def planned(self, node: fx.Node, value: fx.Node) -> None:
        """Record a planned rewrite that makes ``node``'s users read ``value``."""
        self._caller.join(node, value)

    def why_not_share(self, node: fx.Node) -> str | None:
        """Why ``node``'s result may not stand for another call's (or theirs for its)."""
        reason = self.why_not_rewrite(node)
        if reason is None and self.alias.is_written(node):
            reason = "its storage is written in place later"
        return reason
