"""The lowered Circle graph as a kind of graph the PassManager runs passes on.

Its invariant ``well-formed`` is what the builder and the runtime rely on: every operand is
a tensor of the graph (or -1, an omitted optional operand), every tensor has at most one
producer and no constant has one, operators come in dependency order, and every graph
output is computed, an input or a constant.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x, y = g.add_tensor("x", (2,), np.float32), g.add_tensor("y", (2,), np.float32)
    >>> g.add_op("RELU", [y], [x])
    >>> g.inputs, g.outputs = [], [x]
    >>> CIRCLE.invariant("well-formed").find_problems(g)
    ["RELU (operator 0) reads t1 'y', which is not computed before it, an input or a constant"]
"""

from __future__ import annotations

import copy

from fxopt.circle.graph import CircleGraph
from fxopt.ir.spec import Invariant
from fxopt.passes.kinds import GraphKind

_MAX_PROBLEMS = 10


def _well_formed(graph: CircleGraph) -> list[str]:
    problems: list[str] = []
    available = {i for i in graph.inputs if _known(graph, i)}
    available |= {i for i, t in enumerate(graph.tensors) if t.data is not None}
    for position, op in enumerate(graph.operators):
        where = f"{op.code} (operator {position})"
        problems += _operand_problems(graph, where, op.inputs, available)
        problems += _result_problems(graph, where, op.outputs, available)
        available.update(op.outputs)
        if len(problems) >= _MAX_PROBLEMS:
            return problems
    for index in graph.outputs:
        if index not in available:
            problems.append(f"graph output {_label(graph, index)} is never computed")
    return problems


def _operand_problems(
    graph: CircleGraph, where: str, operands: list[int], available: set[int]
) -> list[str]:
    problems = []
    for index in operands:
        if index == -1:  # an omitted optional operand
            continue
        if not _known(graph, index):
            problems.append(f"{where} reads {_label(graph, index)}, not a tensor of the graph")
        elif index not in available:
            problems.append(
                f"{where} reads {_label(graph, index)}, which is not computed before it, an "
                "input or a constant"
            )
    return problems


def _result_problems(
    graph: CircleGraph, where: str, results: list[int], available: set[int]
) -> list[str]:
    problems = []
    for index in results:
        if not _known(graph, index):
            problems.append(f"{where} writes {_label(graph, index)}, not a tensor of the graph")
        elif index in available:
            problems.append(f"{where} writes {_label(graph, index)}, which already has a value")
    return problems


def _known(graph: CircleGraph, index: int) -> bool:
    return 0 <= index < len(graph.tensors)


def _label(graph: CircleGraph, index: int) -> str:
    return f"t{index} '{graph.tensors[index].name}'" if _known(graph, index) else f"t{index}"


INVARIANTS = {
    "well-formed": Invariant(
        "well-formed",
        "operands exist, one producer per tensor, dependency order, outputs computed",
        _well_formed,
    ),
}

CIRCLE = GraphKind(
    name="circle",
    graph_type=CircleGraph,
    invariants=INVARIANTS,
    copy=copy.deepcopy,
    text=CircleGraph.format,
)
