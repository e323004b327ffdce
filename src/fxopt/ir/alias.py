"""Alias analysis: which values may share storage, and when that storage is written.

Two reads of ``x`` are the same value only if nothing wrote into ``x``'s storage between
them. ``x.view(-1).mul_(2)`` writes into ``x`` through a view, so alias analysis groups
values into *storage classes* (a value, its views, and anything an unknown op may have
returned) and records, for every class, the positions of the nodes that write into it.

    >>> import torch
    >>> from fxopt.ir.alias import AliasAnalysis
    >>> def f(x):
    ...     a = x + 1
    ...     x.view(-1).mul_(2)
    ...     return a, x + 1
    >>> gm = torch.fx.symbolic_trace(f)
    >>> alias = AliasAnalysis(gm)
    >>> add, _, mul_, add_1 = [n for n in gm.graph.nodes if n.op != "placeholder"][:4]
    >>> x = next(iter(gm.graph.nodes))
    >>> alias.version(x, at=add), alias.version(x, at=add_1)
    (0, 1)

The classes are conservative: a ``view`` trait means "may alias", unknown ops alias and
write all their inputs, and if any graph input is written, all graph inputs and attributes
are treated as one class (the caller may pass the same tensor twice).
"""

from __future__ import annotations

from bisect import bisect_left

from torch import fx

from fxopt.ir import ops, shared

_INPUT_OPS = ("placeholder", "get_attr")
_UNKNOWN = object()


class AliasAnalysis:
    """Storage classes and write positions of one graph, computed once in O(n α(n))."""

    @classmethod
    def of(cls, gm: fx.GraphModule) -> AliasAnalysis:
        """The analysis of ``gm``, shared across a pipeline while the graph is unchanged."""
        return shared.get(gm, "alias", cls)

    def __init__(self, gm: fx.GraphModule):
        # Union-find over nodes; a node missing from `_parent` is its own root (most nodes
        # are: only views, in-place ops and unknown ops join classes).
        self._parent: dict[fx.Node, fx.Node] = {}
        table = ops.table(gm)
        #: The op table's answers and node positions (fxopt.ir.ops.table), kept here for
        #: the alias queries that need them.
        self.position: dict[fx.Node, int] = table.position
        self.info: dict[fx.Node, ops.OpInfo] = table.info
        writes: list[tuple[fx.Node, int]] = []  # (written node, position of the writer)
        inputs: list[fx.Node] = []
        for node, op in table.info.items():
            if node.op in _INPUT_OPS:
                inputs.append(node)
            if op.view:
                for arg in ops.aliased_nodes(node):
                    self._union(node, arg)
            if op.mutates:
                index = table.position[node]
                for target in ops.mutated_nodes(node, op):
                    writes.append((target, index))
        input_classes = {self._find(i) for i in inputs}  # once: writes × inputs was quadratic
        if any(self._find(t) in input_classes for t, _ in writes):
            for node in inputs[1:]:
                self._union(inputs[0], node)
        self._writes: dict[fx.Node, list[int]] = {}  # class root -> sorted positions
        for target, index in writes:
            self._writes.setdefault(self._find(target), []).append(index)
        # Per node, its class's write positions (None: never written), filled on demand:
        # passes ask for every argument of every node, and a dict lookup is cheaper than
        # finding the class each time.
        self._node_writes: dict[fx.Node, list[int] | None] = {}

    def _find(self, node: fx.Node) -> fx.Node:
        parent = self._parent
        root = node
        up = parent.get(root)
        while up is not None:
            root, up = up, parent.get(up)
        while node is not root:  # path compression
            parent[node], node = root, parent[node]
        return root

    def _union(self, a: fx.Node, b: fx.Node) -> None:
        ra, rb = self._find(a), self._find(b)
        if ra is not rb:
            self._link(ra, rb)

    def _link(self, ra: fx.Node, rb: fx.Node) -> fx.Node:
        """Join two distinct roots; returns the new root."""
        # The earlier node becomes the root: deterministic, independent of set order.
        if self.position[rb] < self.position[ra]:
            ra, rb = rb, ra
        self._parent[rb] = ra
        return ra

    def _writes_of(self, node: fx.Node) -> list[int] | None:
        positions = self._node_writes.get(node, _UNKNOWN)
        if positions is _UNKNOWN:
            positions = self._node_writes[node] = self._writes.get(self._find(node))
        return positions  # type: ignore[return-value]

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """Follow a rewrite that moved ``old``'s users to ``new`` and erased ``old``.

        For a pass that keeps this analysis across its change (``PassResult.keeps``)
        instead of letting the next pass rebuild it. Both must be call nodes, and ``new``
        must compute the value ``old`` did (cse merging a duplicate, fold-bn replacing a
        BatchNorm's output by the folded conv's). ``old``'s views now view ``new``, so the
        two classes become one, with the writes of both. Positions are not renumbered:
        erased nodes leave gaps, which keep the order.
        """
        if old.op in _INPUT_OPS or new.op in _INPUT_OPS:
            # Writes into graph inputs merge all input classes (see __init__): rebuild.
            raise ValueError(f"replace({old.name}, {new.name}) needs two call nodes")
        old_root, new_root = self._find(old), self._find(new)
        if old_root is new_root:
            return
        old_writes = self._writes.pop(old_root, None)
        new_writes = self._writes.pop(new_root, None)
        root = self._link(old_root, new_root)
        if old_writes or new_writes:
            self._writes[root] = sorted((old_writes or []) + (new_writes or []))
            self._node_writes.clear()  # refilled on demand

    def storage_class(self, node: fx.Node) -> fx.Node:
        """A representative node of the values that may share ``node``'s storage."""
        return self._find(node)

    def is_written(self, node: fx.Node) -> bool:
        """True when any node writes into storage that ``node`` may share."""
        return bool(self._writes_of(node))

    def version(self, node: fx.Node, *, at: fx.Node) -> int:
        """How many writes into ``node``'s storage happen before position ``at``."""
        positions = self._writes_of(node)
        return bisect_left(positions, self.position[at]) if positions else 0

    def caller_storage(self, gm: fx.GraphModule) -> CallerStorage:
        """What the caller holds and gets back, for a pass that plans rewrites on it."""
        return CallerStorage(self, gm)

    def writers(self, node: fx.Node) -> list[int]:
        """Graph positions of the nodes that write into ``node``'s storage."""
        return list(self._writes_of(node) or ())


class CallerStorage:
    """The storage the caller holds (inputs, attributes) and gets back (outputs), followed
    through the rewrites a pass plans in one analysis.

    A rewrite must not hand the caller one storage under two names where eager gives two
    tensors (``return x.relu(), x.relu()``), or give back a tensor it already holds. A
    planned rewrite that makes ``old`` read ``new`` joins their storage classes: later
    checks in the same analysis see the graph as it will be, so a second run of the pass
    decides exactly as the first did.
    """

    def __init__(self, alias: AliasAnalysis, gm: fx.GraphModule):
        graph, find = gm.graph, alias.storage_class
        self._find = find
        # find_nodes reads fx's per-opcode index: no walk over the whole graph.
        inputs = graph.find_nodes(op="placeholder", sort=False)
        inputs += graph.find_nodes(op="get_attr", sort=False)
        self.held = {find(node) for node in inputs}
        outputs = graph.find_nodes(op="output", sort=False)
        self.returned = {find(value) for output in outputs for value in ops.input_nodes(output)}
        self._joined: dict[fx.Node, fx.Node] = {}  # class -> the class it was joined into

    def _root(self, node: fx.Node) -> fx.Node:
        cls = self._find(node)
        while cls in self._joined:
            cls = self._joined[cls]
        return cls

    def is_returned(self, node: fx.Node) -> bool:
        return self._root(node) in self.returned

    def would_share(self, old: fx.Node, new: fx.Node) -> bool:
        """True when making ``old``'s users read ``new`` may give the caller one storage
        twice: ``old`` is returned and ``new`` is returned or held.

        Also when both are in one storage class already: a class says "may alias", and
        ``x.double()`` twice gives two tensors although ``.to()`` may return its input."""
        mine, theirs = self._root(old), self._root(new)
        return mine in self.returned and (theirs in self.returned or theirs in self.held)

    def join(self, old: fx.Node, new: fx.Node) -> None:
        """Record a planned rewrite that makes ``old``'s users read ``new``."""
        mine, theirs = self._root(old), self._root(new)
        if mine is theirs:
            return
        self._joined[mine] = theirs
        if mine in self.returned:
            self.returned.add(theirs)
        if mine in self.held:
            self.held.add(theirs)


def writes_an_input(gm: fx.GraphModule) -> bool:
    """True when a node of ``gm`` writes in place into a graph input or a view of one
    (export spells an input mutation ``copy_(input, new_value)`` at the end)."""
    table = ops.table(gm)
    for node in gm.graph.nodes:
        if not table[node].inplace or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        base = node.args[0]
        while table[base].view and base.args and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        if base.op == "placeholder":
            return True
    return False
