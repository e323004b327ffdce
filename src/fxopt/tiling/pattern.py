"""Patterns (the fused kernels of a library) and libraries of them.

A pattern is a small graph in the same node format as :class:`~fxopt.tiling.Graph`, plus
the node ids whose values the kernel produces for the rest of the graph (``outputs``)::

    name: linear_gelu
    nodes:
      - {id: l, op: linear, inputs: ["*"]}
      - {id: g, op: gelu,   inputs: [l]}
    outputs: [g]            # default: the nodes no other pattern node reads
    cost: 1.0               # optional; the solver minimizes total cost (default: tile count)
    kernel: mkldnn._linear_pointwise   # optional: what runs the tile (shown in reports)

An input that is not a node id of the pattern is a *wildcard*: it must bind to a value
produced outside the tile (a node of another tile, a graph input). ``"*"`` binds to
anything; any other name binds consistently, so ``add(A, A)`` only matches ``x + x``.
``null`` leaves a slot unconstrained (a constant, or any value from outside the tile).
Slots a pattern node does not list are unconstrained too, so ``linear(*)`` matches a
module-level ``linear(x)`` and an ATen ``linear(x, weight, bias)`` alike.

A node may stand for several ops (``op: [transpose, permute]``, the spellings of the two
capture levels) and may be ``optional: true``: the pattern then also matches without it,
its readers reading its first input (a node of the pattern) instead. So one pattern says
what would otherwise take one per combination, the same vocabulary as the rule engine's
patterns (:mod:`fxopt.ir.pattern`: alternatives, optional nodes)::

    name: attention
    nodes:
      - {id: kt, op: [transpose, permute], inputs: ["k"]}
      - {id: s,  op: matmul, inputs: ["q", kt]}
      - {id: d,  op: div,    inputs: [s]}
      - {id: m,  op: add,    inputs: [d, "mask"], optional: true}
      - {id: p,  op: softmax, inputs: [m]}
      - {id: o,  op: matmul, inputs: [p, "v"]}

A library is ``{"patterns": [...]}`` (JSON or YAML; a bare list works too). Built-in
libraries ship with fxopt: ``transformer``, ``cnn``, ``cpu`` (the fused CPU kernels
fxopt's fuse-kernels step emits) and ``singles`` (one single-node pattern per canonical op
of :mod:`fxopt.ir.ops`, for full-coverage runs); ``+`` joins names: ``transformer+singles``.

    >>> lib = load_library("transformer")
    >>> lib.pattern("linear_gelu").outputs
    ('g',)
    >>> len(load_library("transformer+singles")) > len(lib)
    True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from fxopt.tiling.errors import TilingInputError
from fxopt.tiling.graph import (
    Node,
    is_commutative_op,
    parse_node,
    read_data_file,
    topological_order,
)

__all__ = ["BUILTIN_LIBRARIES", "WILDCARD", "Library", "Pattern", "load_library"]

#: The anonymous wildcard: any value produced outside the tile.
WILDCARD = "*"
#: Built-in library names: data files in ``fxopt/tiling/library/``, plus the generated one.
BUILTIN_LIBRARIES = ("transformer", "cnn", "cpu", "singles")


class Pattern:
    """A fused kernel: op-typed nodes with ordered input slots and declared outputs.

    >>> p = Pattern("add_relu", [{"id": "a", "op": "add", "inputs": ["*", "*"]},
    ...                          {"id": "r", "op": "relu", "inputs": ["a"]}])
    >>> p.outputs, p.wildcards("a")
    (('r',), ['*', '*'])
    """

    def __init__(
        self,
        name: str,
        nodes: Iterable[Node | Mapping[str, Any]],
        outputs: Sequence[str] | None = None,
        cost: float | None = None,
        *,
        where: str | None = None,
        kernel: str | None = None,
    ):
        where = where or f"pattern '{name}'"
        if not isinstance(name, str) or not name:
            raise TilingInputError(f"{where}: 'name' must be a non-empty string")
        nodes, self.choices, self.optional = _choices(nodes, where)
        parsed = [
            n if isinstance(n, Node) else parse_node(n, f"{where}: nodes[{i}]")
            for i, n in enumerate(nodes)
        ]
        if not parsed:
            raise TilingInputError(f"{where}: a pattern needs at least one node")
        ids = [n.id for n in parsed]
        for i, node_id in enumerate(ids):
            if node_id in ids[:i]:
                raise TilingInputError(f"{where}: nodes[{i}]: duplicate node id '{node_id}'")
        # Kahn's order over pattern edges: also rejects a cyclic pattern, naming the cycle.
        topological_order(parsed, where)
        read = {v for n in parsed for v in n.inputs if v in ids}
        if outputs is None:
            outputs = [i for i in ids if i not in read]
        if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
            raise TilingInputError(f"{where}: 'outputs' must be a list of node ids")
        for out in outputs:
            if out not in ids:
                raise TilingInputError(f"{where}: output '{out}' is not one of its nodes")
        _check_optional(parsed, self.optional, where)
        if cost is not None and (
            isinstance(cost, bool)
            or not isinstance(cost, (int, float))
            or not math.isfinite(cost)
            or cost <= 0
        ):
            raise TilingInputError(f"{where}: 'cost' must be a positive number, got {cost!r}")
        if kernel is not None and (not isinstance(kernel, str) or not kernel):
            raise TilingInputError(f"{where}: 'kernel' must be a non-empty string")
        self.name = name
        #: What runs a tile of this pattern (free text, e.g. an op name); None if unsaid.
        self.kernel = kernel
        self.nodes: tuple[Node, ...] = tuple(parsed)
        self.outputs: tuple[str, ...] = tuple(dict.fromkeys(outputs))
        self.cost: float | None = None if cost is None else float(cost)
        self.index: dict[str, int] = {n.id: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"Pattern({self.name!r}, {len(self.nodes)} nodes, outputs={list(self.outputs)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pattern) and self.to_json() == other.to_json()

    __hash__ = None  # type: ignore[assignment]  # equal patterns compare by content

    @property
    def ops(self) -> list[str]:
        """The op of each node, in order."""
        return [n.op for n in self.nodes]

    def is_node(self, value: str | None) -> bool:
        """True when ``value`` names a node of the pattern (not a wildcard or ``None``)."""
        return value is not None and value in self.index

    def wildcards(self, node_id: str) -> list[str]:
        """The wildcard names among a node's inputs, in slot order."""
        return [v for v in self.nodes[self.index[node_id]].inputs if v and v not in self.index]

    def variants(self) -> tuple[Pattern, ...]:
        """The plain patterns this one stands for: every choice of op, every optional node
        present or absent (a pattern without either is its own one variant)."""
        if not self.choices and not self.optional:
            return (self,)
        found = []
        optional = [n.id for n in self.nodes if n.id in self.optional]
        for absent in itertools.product((False, True), repeat=len(optional)):
            gone = {i for i, out in zip(optional, absent) if out}
            through: dict[str, str | None] = {}  # an absent node → what its readers read
            for node in self.nodes:  # topological: an input's own stand-in is known
                if node.id in gone:
                    through[node.id] = through.get(node.inputs[0], node.inputs[0])
            kept = [n for n in self.nodes if n.id not in gone]
            ops = [self.choices.get(n.id, (n.op,)) for n in kept]
            outputs = list(dict.fromkeys(through.get(o, o) for o in self.outputs))
            for choice in itertools.product(*ops):
                nodes = [
                    Node(n.id, op, tuple(through.get(v, v) for v in n.inputs), n.commutative)
                    for n, op in zip(kept, choice)
                ]
                found.append(Pattern(self.name, nodes, outputs, self.cost, kernel=self.kernel))
        return tuple(found)

    def to_json(self) -> dict[str, Any]:
        """The library-file form of this pattern."""
        entry: dict[str, Any] = {
            "name": self.name,
            "nodes": [self._node_json(n) for n in self.nodes],
            "outputs": list(self.outputs),
        }
        if self.cost is not None:
            entry["cost"] = self.cost
        if self.kernel is not None:
            entry["kernel"] = self.kernel
        return entry

    def _node_json(self, node: Node) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": node.id, "op": node.op, "inputs": list(node.inputs)}
        if node.id in self.choices:
            entry["op"] = list(self.choices[node.id])
        if node.id in self.optional:
            entry["optional"] = True
        return entry


def _check_optional(nodes: list[Node], optional: frozenset[str], where: str) -> None:
    ids = {n.id for n in nodes}
    for node in nodes:
        if node.id in optional and (not node.inputs or node.inputs[0] not in ids):
            raise TilingInputError(
                f"{where}: optional node '{node.id}' must read a node of the pattern first "
                "(its readers read that node when it is absent)"
            )


def _choices(
    nodes: Iterable[Node | Mapping[str, Any]], where: str
) -> tuple[list, dict[str, tuple[str, ...]], frozenset[str]]:
    """The nodes with one op each (the first of a list), the op lists by node id, and the
    optional node ids."""
    plain, choices, optional = [], {}, set()
    for i, entry in enumerate(nodes):
        if isinstance(entry, Mapping):
            entry = dict(entry)
            op, flag = entry.get("op"), entry.pop("optional", False)
            if not isinstance(flag, bool):
                raise TilingInputError(f"{where}: nodes[{i}]: 'optional' must be true or false")
            if isinstance(op, list):
                if not op or not all(isinstance(o, str) and o for o in op):
                    raise TilingInputError(
                        f"{where}: nodes[{i}]: 'op' must be a name or a list of names"
                    )
                choices[entry.get("id")] = tuple(dict.fromkeys(op))
                entry["op"] = op[0]
            if flag:
                optional.add(entry.get("id"))
        plain.append(entry)
    return plain, {k: v for k, v in choices.items() if len(v) > 1}, frozenset(optional)


@dataclass(frozen=True)
class Library:
    """An ordered list of uniquely named patterns."""

    name: str
    patterns: tuple[Pattern, ...]

    def __len__(self) -> int:
        return len(self.patterns)

    def __iter__(self) -> Iterator[Pattern]:
        return iter(self.patterns)

    def pattern(self, name: str) -> Pattern:
        """The pattern called ``name``."""
        for p in self.patterns:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def has_costs(self) -> bool:
        """True when any pattern gives a cost (then the solver minimizes total cost)."""
        return any(p.cost is not None for p in self.patterns)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "patterns": [p.to_json() for p in self.patterns]}


LibrarySpec = Library | Pattern | str | Path | Mapping[str, Any] | Sequence[Any]


def load_library(spec: LibrarySpec) -> Library:
    """A library from a built-in name (``"transformer"``, ``"cnn+singles"``), a JSON/YAML
    file path, a ``{"patterns": [...]}`` dict, a list of patterns or pattern dicts.

    >>> load_library({"patterns": [{"name": "r", "nodes": [{"id": "a", "op": "relu"}]}]}).name
    '<library>'
    """
    if isinstance(spec, Library):
        return spec
    if isinstance(spec, Pattern):
        return Library(spec.name, (spec,))
    if isinstance(spec, Path):
        return _from_data(read_data_file(spec, "library file"), str(spec), spec.stem)
    if isinstance(spec, str):
        parts = spec.split("+")
        if all(p in BUILTIN_LIBRARIES for p in parts):
            return _join([_builtin(p) for p in parts], spec)
        path = Path(spec)
        if path.is_file():
            return _from_data(read_data_file(path, "library file"), spec, path.stem)
        if path.suffix.lower() in (".json", ".yaml", ".yml") or "/" in spec:
            raise TilingInputError(f"library file not found: {spec}")
        raise TilingInputError(
            f"unknown library '{spec}': use a file path or a built-in name "
            f"({', '.join(BUILTIN_LIBRARIES)}; join them with '+')"
        )
    if isinstance(spec, Mapping):
        return _from_data(spec, "<library>", str(spec.get("name", "<library>")))
    if isinstance(spec, Sequence):
        if all(isinstance(p, Pattern) for p in spec):
            return _join([Library(p.name, (p,)) for p in spec], "<library>")
        return _from_data({"patterns": list(spec)}, "<library>", "<library>")
    raise TilingInputError(f"cannot make a pattern library from {type(spec).__name__}")


def _from_data(data: object, source: str, name: str) -> Library:
    if isinstance(data, list):
        data = {"patterns": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("patterns"), list):
        raise TilingInputError(f"{source}: expected {{'patterns': [...]}} (a list of patterns)")
    patterns: list[Pattern] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(data["patterns"]):
        where = f"{source}: patterns[{i}]"
        if not isinstance(entry, Mapping):
            raise TilingInputError(f"{where}: expected an object {{name, nodes, outputs}}")
        pattern_name = entry.get("name")
        if isinstance(pattern_name, str) and pattern_name:
            where = f"{where} ('{pattern_name}')"
        nodes = entry.get("nodes")
        if not isinstance(nodes, list):
            raise TilingInputError(f"{where}: 'nodes' must be a list of {{id, op, inputs}}")
        pattern = Pattern(
            pattern_name,
            nodes,
            entry.get("outputs"),
            entry.get("cost"),
            where=where,
            kernel=entry.get("kernel"),
        )
        if pattern.name in seen:
            raise TilingInputError(
                f"{where}: duplicate pattern name '{pattern.name}' "
                f"(also patterns[{seen[pattern.name]}])"
            )
        seen[pattern.name] = i
        patterns.append(pattern)
    return Library(str(data.get("name", name)), tuple(patterns))


def _join(libraries: Sequence[Library], name: str) -> Library:
    """Concatenate libraries; a name defined twice must be the same pattern both times."""
    patterns: dict[str, Pattern] = {}
    for library in libraries:
        for p in library:
            if p.name in patterns and patterns[p.name] != p:
                raise TilingInputError(
                    f"libraries '{name}': pattern name '{p.name}' has two different definitions"
                )
            patterns.setdefault(p.name, p)
    return Library(name, tuple(patterns.values()))


_BUILTIN_CACHE: dict[str, Library] = {}


def _builtin(name: str) -> Library:
    if name not in _BUILTIN_CACHE:
        if name == "singles":
            _BUILTIN_CACHE[name] = _singles()
        else:
            text = resources.files("fxopt.tiling").joinpath(f"library/{name}.yaml").read_text()
            import yaml

            source = f"fxopt/tiling/library/{name}.yaml"
            _BUILTIN_CACHE[name] = _from_data(yaml.safe_load(text), source, name)
    return _BUILTIN_CACHE[name]


def _singles() -> Library:
    """One single-node pattern per canonical op: every node of a known op is coverable."""
    from fxopt.ir import ops

    non_compute = {"placeholder", "get_attr", "output"}
    return Library(
        "singles",
        tuple(
            Pattern(op, [Node(op, op, (), is_commutative_op(op))], [op])
            for op in ops.canonical_names()
            if op not in non_compute
        ),
    )
