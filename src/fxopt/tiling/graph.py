"""The tiler's graph: nodes with a canonical op name and ordered input slots. No torch.

A node is ``{id, op, inputs}``. ``inputs[i]`` is whatever feeds argument slot ``i``: the id
of another node, the id of an *external input* (any id that is not a node: a graph input,
a weight), or ``None`` for a constant. Slots are the real argument positions: ``x - 1.0``
is ``sub`` with inputs ``[x, None]`` and ``1.0 - x`` is ``sub`` with ``[None, x]``.
``outputs`` are the node ids the graph returns. The JSON form::

    {"nodes": [{"id": "n1", "op": "matmul", "inputs": ["x", "n0"]}, ...],
     "outputs": ["n7"],
     "inputs": ["x"]}                      # optional: declare external inputs

When ``"inputs"`` is given, every id that is not a node must be listed there (typos are
caught); without it, every id that is not a node is an external input. A node may also
say ``"commutative": true|false``; by default it is what the op table says for its op.

Nodes are kept in a topological order (Kahn's algorithm, ties broken by the order given,
so an already sorted listing keeps its order). ``Graph.from_fx`` builds the graph of a
``torch.fx`` GraphModule through :mod:`fxopt.ir.ops` canonical names:

    >>> import torch
    >>> from fxopt.tiling import Graph
    >>> gm = torch.fx.symbolic_trace(lambda x, y: torch.relu(1.0 - x) + y)
    >>> g = Graph.from_fx(gm)
    >>> [(n.id, n.op, n.inputs) for n in g.nodes]
    [('sub', 'sub', (None, 'x')), ('relu', 'relu', ('sub',)), ('add', 'add', ('relu', 'y'))]
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fxopt.errors import UserInputError
from fxopt.paths import read_text
from fxopt.tiling.errors import TilingInputError

__all__ = [
    "Graph",
    "Node",
    "is_commutative_op",
    "parse_node",
    "read_data_file",
    "topological_order",
]

#: Argument slots that a commutative op may swap (ops.py: "the first two tensor inputs").
COMMUTATIVE_SLOTS = (0, 1)


@dataclass(frozen=True)
class Node:
    """One operation: ``inputs[i]`` feeds argument slot ``i`` (``None``: a constant)."""

    id: str
    op: str
    inputs: tuple[str | None, ...] = ()
    commutative: bool = False


def is_commutative_op(op: str) -> bool:
    """What the canonical op table says about ``op`` (a canonical name).

    >>> is_commutative_op("add"), is_commutative_op("sub")
    (True, False)
    """
    return op in _commutative_ops()


_COMMUTATIVE: frozenset[str] | None = None


def _commutative_ops() -> frozenset[str]:
    global _COMMUTATIVE
    if _COMMUTATIVE is None:
        # ops.py answers per fx node; a JSON graph has only names, so read the table's specs.
        from fxopt.ir import ops

        _COMMUTATIVE = ops.commutative_names()
    return _COMMUTATIVE


class Graph:
    """A DAG of :class:`Node` in topological order, with external inputs and outputs."""

    def __init__(
        self,
        nodes: Iterable[Node],
        outputs: Sequence[str] = (),
        inputs: Sequence[str] | None = None,
        *,
        source: str = "<graph>",
        elided: Sequence[str] = (),
    ):
        given = list(nodes)
        self.source = source
        #: Node ids dropped on capture (eval-mode dropout, identity, runtime checks).
        self.elided: tuple[str, ...] = tuple(elided)
        position = _node_positions(given, source)
        externals = _external_inputs(given, position, inputs, source)
        for value in outputs:
            if value not in position and value not in externals:
                raise TilingInputError(
                    f"{source}: output '{value}' is not a node or an input of the graph"
                )
        self.nodes: tuple[Node, ...] = tuple(given[i] for i in topological_order(given, source))
        self.inputs: tuple[str, ...] = tuple(externals)
        self.outputs: tuple[str, ...] = tuple(dict.fromkeys(outputs))
        #: id → position in :attr:`nodes`.
        self.index: dict[str, int] = {n.id: i for i, n in enumerate(self.nodes)}
        #: position → positions of the nodes that read it, ascending, without duplicates.
        self.users: tuple[tuple[int, ...], ...] = self._users()
        #: position → positions of node inputs, in slot order (external inputs left out).
        self.preds: tuple[tuple[int, ...], ...] = tuple(
            tuple(dict.fromkeys(self.index[v] for v in n.inputs if v in self.index))
            for n in self.nodes
        )
        self.output_positions: frozenset[int] = frozenset(
            self.index[v] for v in self.outputs if v in self.index
        )
        #: position → its input slots with node ids replaced by positions (externals stay
        #: ids, constants None): what the matcher compares.
        self.slots: tuple[tuple[int | str | None, ...], ...] = tuple(
            tuple(self.index.get(v, v) if v is not None else None for v in n.inputs)
            for n in self.nodes
        )
        #: op → positions of its nodes, ascending.
        self.by_op: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            self.by_op.setdefault(n.op, []).append(i)

    def _users(self) -> tuple[tuple[int, ...], ...]:
        users: list[dict[int, None]] = [{} for _ in self.nodes]
        for i, node in enumerate(self.nodes):
            for value in node.inputs:
                j = self.index.get(value) if value is not None else None
                if j is not None:
                    users[j][i] = None
        return tuple(tuple(u) for u in users)  # ascending: nodes are visited in order

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        shown = f"{len(self.nodes)} nodes, {len(self.inputs)} inputs"
        return f"Graph({shown}, outputs={list(self.outputs)})"

    def node(self, node_id: str) -> Node:
        """The node with this id."""
        return self.nodes[self.index[node_id]]

    def op_counts(self) -> dict[str, int]:
        """How many nodes have each op, in order of first appearance."""
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> dict[str, Any]:
        """The JSON form (``from_json(g.to_json())`` rebuilds ``g``).

        >>> Graph([Node("a", "relu", ("x",))], outputs=["a"]).to_json()["nodes"]
        [{'id': 'a', 'op': 'relu', 'inputs': ['x']}]
        """
        nodes = []
        for n in self.nodes:
            entry: dict[str, Any] = {"id": n.id, "op": n.op, "inputs": list(n.inputs)}
            if n.commutative != is_commutative_op(n.op):
                entry["commutative"] = n.commutative
            nodes.append(entry)
        return {"nodes": nodes, "outputs": list(self.outputs), "inputs": list(self.inputs)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str | Path, *, source: str | None = None):
        """A graph from its JSON form: a dict, or the path of a JSON (or YAML) file.

        >>> g = Graph.from_json({"nodes": [{"id": "b", "op": "add", "inputs": ["a", "a"]},
        ...                                {"id": "a", "op": "relu", "inputs": ["x"]}],
        ...                      "outputs": ["b"]})
        >>> [n.id for n in g.nodes], g.inputs, g.node("b").commutative
        (['a', 'b'], ('x',), True)
        """
        if isinstance(data, (str, Path)):
            source = source or str(data)
            data = read_data_file(Path(data), "graph file")
        source = source or "<graph>"
        if not isinstance(data, Mapping):
            raise TilingInputError(f"{source}: expected an object with 'nodes' and 'outputs'")
        raw_nodes = data.get("nodes")
        if not isinstance(raw_nodes, list):
            raise TilingInputError(f"{source}: 'nodes' must be a list of {{id, op, inputs}}")
        nodes = [parse_node(entry, f"{source}: nodes[{i}]") for i, entry in enumerate(raw_nodes)]
        outputs = _string_list(data.get("outputs", []), f"{source}: 'outputs'")
        inputs = data.get("inputs")
        if inputs is not None:
            inputs = _string_list(inputs, f"{source}: 'inputs'")
        return cls(nodes, outputs, inputs, source=source)

    # ------------------------------------------------------------------ torch.fx

    @classmethod
    def from_fx(cls, gm, *, elide_noops: bool = True) -> Graph:
        """The graph of a ``torch.fx.GraphModule``, ops named by :mod:`fxopt.ir.ops`.

        Placeholders and ``get_attr`` nodes become external inputs. Slot ``i`` is the
        node's ``i``-th positional argument, with a nested list or tuple (``cat([a, b])``)
        flattened in place; node-valued keyword arguments follow, in keyword order. With
        ``elide_noops``, nodes that compute nothing at inference (eval-mode dropout,
        ``nn.Identity``, ATen runtime checks such as ``_assert_tensor_metadata``) are
        dropped and their readers read the node's input instead (see :attr:`elided`).
        """
        from torch import fx

        from fxopt.ir import ops

        replaced: dict[str, str | None] = {}  # elided node → the value its readers get
        nodes: list[Node] = []
        externals: list[str] = []
        outputs: list[str] = []

        def resolve(value: object) -> str | None:
            if not isinstance(value, fx.Node):
                return None
            return replaced.get(value.name, value.name)

        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                externals.append(node.name)
                continue
            if node.op == "output":
                outputs.extend(
                    v for v in (resolve(a) for a in _flatten(node.args)) if v is not None
                )
                continue
            info = ops.info(node, gm)
            if elide_noops and is_elided(node, info):
                first = node.args[0] if node.args else None
                replaced[node.name] = resolve(first)
                continue
            slots = [resolve(a) for a in _flatten(node.args)]
            slots += [v for v in (resolve(a) for a in _flatten(node.kwargs.values())) if v]
            nodes.append(Node(node.name, info.name, tuple(slots), info.commutative))
        outputs = [v for v in dict.fromkeys(outputs) if v not in externals]
        return cls(nodes, outputs, externals, source="<fx graph>", elided=tuple(replaced))


def _node_positions(nodes: Sequence[Node], source: str) -> dict[str, int]:
    """Node id → position in ``nodes``; ids must be non-empty strings, each used once."""
    position: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if not isinstance(node.id, str) or not node.id:
            raise TilingInputError(f"{source}: nodes[{i}]: 'id' must be a non-empty string")
        if node.id in position:
            raise TilingInputError(
                f"{source}: nodes[{i}]: duplicate id '{node.id}' (also nodes[{position[node.id]}])"
            )
        position[node.id] = i
    return position


def _external_inputs(
    nodes: Sequence[Node], position: dict[str, int], inputs: Sequence[str] | None, source: str
) -> dict[str, None]:
    """The graph's external inputs, in order: the ``inputs`` declared, or else every id
    a node reads that is not a node. With a declaration, an undeclared one is an error."""
    declared = None if inputs is None else list(dict.fromkeys(inputs))
    externals: dict[str, None] = dict.fromkeys(declared or ())
    for i, node in enumerate(nodes):
        for value in node.inputs:
            if value is None or value in position:
                continue
            if declared is not None and value not in externals:
                raise TilingInputError(
                    f"{source}: nodes[{i}] ('{node.id}'): input '{value}' is not a node "
                    "and not one of the declared graph inputs"
                )
            externals.setdefault(value, None)
    for name in externals:
        if name in position:
            raise TilingInputError(
                f"{source}: '{name}' is declared as a graph input and is also a node id"
            )
    return externals


def is_elided(node, info) -> bool:
    """True when :meth:`Graph.from_fx` drops ``node`` (``info``: its op-table entry): it
    computes nothing at inference, and its readers read its input instead."""
    if info.name == "dropout":
        return not info.random and not info.mutates
    if info.name == "identity":
        return not info.mutates
    # torch.export's runtime checks return nothing and are read by nothing.
    return info.name.startswith("_assert") and not node.users


def _flatten(values: Iterable[object]) -> list[object]:
    flat: list[object] = []
    stack = [iter(values)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, (list, tuple)):
                stack.append(iter(value))
                break
            if isinstance(value, dict):
                stack.append(iter(value.values()))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def parse_node(entry: object, where: str) -> Node:
    """A :class:`Node` from ``{"id", "op", "inputs", ["commutative"]}``."""
    if not isinstance(entry, Mapping):
        raise TilingInputError(f"{where}: expected an object {{id, op, inputs}}")
    node_id, op, inputs = entry.get("id"), entry.get("op"), entry.get("inputs", [])
    if not isinstance(node_id, str) or not node_id:
        raise TilingInputError(f"{where}: 'id' must be a non-empty string")
    where = f"{where} ('{node_id}')"
    if not isinstance(op, str) or not op:
        raise TilingInputError(f"{where}: 'op' must be a non-empty string")
    if not isinstance(inputs, list) or not all(v is None or isinstance(v, str) for v in inputs):
        raise TilingInputError(f"{where}: 'inputs' must be a list of ids (or null)")
    commutative = entry.get("commutative", is_commutative_op(op))
    if not isinstance(commutative, bool):
        raise TilingInputError(f"{where}: 'commutative' must be true or false")
    return Node(node_id, op, tuple(inputs), commutative)


def _string_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TilingInputError(f"{where} must be a list of ids")
    return value


def read_data_file(path: Path, what: str = "file") -> Any:
    """Parse a JSON or YAML file (``what``: "graph file", "library file"); errors name
    the file and the line."""
    try:
        text = read_text(path, what)  # a binary file is a user mistake, not a crash
    except UserInputError as error:
        raise TilingInputError(str(error)) from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except RecursionError:
            raise TilingInputError(f"{path}: nested too deeply to read") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise TilingInputError(f"{path}: malformed YAML{at}: {problem}") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise TilingInputError(f"{path}: nested too deeply to read") from None
    except json.JSONDecodeError as error:
        raise TilingInputError(
            f"{path}: malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None


def topological_order(nodes: Sequence[Node], source: str) -> list[int]:
    """Positions of ``nodes`` in a topological order; ties go to the earlier listing."""
    position = {n.id: i for i, n in enumerate(nodes)}
    waiting = [0] * len(nodes)
    readers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for j in dict.fromkeys(position[v] for v in node.inputs if v in position):
            waiting[i] += 1
            readers[j].append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers[i]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) < len(nodes):
        cycle = _find_cycle(nodes, position, {i for i, w in enumerate(waiting) if w})
        raise TilingInputError(
            f"{source}: the graph has a cycle: {' → '.join(cycle)} (a graph must be a DAG)"
        )
    return order


def _find_cycle(nodes: Sequence[Node], position: dict[str, int], stuck: set[int]) -> list[str]:
    """Ids along one cycle among the ``stuck`` nodes (each has a stuck input)."""
    # Walking backwards along stuck inputs must revisit a node: that stretch is a cycle.
    seen: dict[int, int] = {}
    walk: list[int] = []
    current = min(stuck)
    while current not in seen:
        seen[current] = len(walk)
        walk.append(current)
        current = next(
            position[v] for v in nodes[current].inputs if v in position and position[v] in stuck
        )
    cycle = walk[seen[current] :][::-1]  # reversed: in the direction values flow
    start = cycle.index(min(cycle))
    cycle = cycle[start:] + cycle[:start]
    return [nodes[i].id for i in [*cycle, cycle[0]]]
