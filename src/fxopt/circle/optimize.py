"""Circle-level optimizations on the lowered graph, each a small named function.

* ``fuse-activations``: RELU / RELU6 / RELU_N1_TO_1 whose only input is the sole
  use of a CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, ADD, SUB, MUL, DIV or pool output
  becomes that op's ``fusedActivationFunction`` (one kernel, one tensor fewer). Not when
  the producer's output is a graph output (it would change that output) or already fused.
* ``merge-reshapes``: RESHAPE of a RESHAPE reads the first one's input (the middle tensor
  dies when nothing else reads it).
* ``remove-dead-ops``: operators whose outputs nobody reads.

    >>> [name for name, _ in STEPS]
    ['fuse-activations', 'merge-reshapes', 'remove-dead-ops']
"""

from __future__ import annotations

from collections.abc import Callable

from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType as Act

from fxopt.circle.config import CircleConfig
from fxopt.circle.graph import CircleGraph

_ACTIVATIONS = {
    "RELU": Act.RELU,
    "RELU6": Act.RELU6,
    "RELU_N1_TO_1": Act.RELU_N1_TO_1,
    # TANH is a legal fused activation in the schema, but onert 0.1.0 fails at run time
    # with "Unsupported fused activation function" (measured on FC + tanh): not fused.
}
_FUSIBLE = {
    "CONV_2D",
    "DEPTHWISE_CONV_2D",
    "FULLY_CONNECTED",
    "ADD",
    "SUB",
    "MUL",
    "DIV",
    "MAX_POOL_2D",
    "AVERAGE_POOL_2D",
}


def fuse_activations(graph: CircleGraph) -> int:
    producers, users = graph.producers(), graph.consumers()
    outputs = set(graph.outputs)
    removed = []
    for op in graph.operators:
        act = _ACTIVATIONS.get(op.code)
        if act is None:
            continue
        source = op.inputs[0]
        producer = producers.get(source)
        if (
            producer is None
            or producer.code not in _FUSIBLE
            or len(users.get(source, [])) != 1
            or source in outputs
            or getattr(producer.options, "fusedActivationFunction", None) != Act.NONE
            or graph.tensors[source].dtype != graph.tensors[op.outputs[0]].dtype
        ):
            continue
        producer.options.fusedActivationFunction = act
        producer.outputs = [op.outputs[0]]
        producers[op.outputs[0]] = producer
        removed.append(op)
    graph.operators = [op for op in graph.operators if all(op is not r for r in removed)]
    return len(removed)


def merge_reshapes(graph: CircleGraph) -> int:
    producers = graph.producers()
    changed = 0
    for op in graph.operators:
        if op.code != "RESHAPE":
            continue
        first = producers.get(op.inputs[0])
        if first is not None and first.code == "RESHAPE":
            op.inputs = [first.inputs[0], *op.inputs[1:]]
            changed += 1
    return changed


def remove_dead_ops(graph: CircleGraph) -> int:
    removed = 0
    while True:
        users = graph.consumers()
        live = set(graph.outputs)
        dead = [
            op for op in graph.operators if not any(o in live or users.get(o) for o in op.outputs)
        ]
        if not dead:
            return removed
        removed += len(dead)
        graph.operators = [op for op in graph.operators if all(op is not d for d in dead)]


STEPS: tuple[tuple[str, Callable[[CircleGraph], int]], ...] = (
    ("fuse-activations", fuse_activations),
    ("merge-reshapes", merge_reshapes),
    ("remove-dead-ops", remove_dead_ops),
)


def optimize(graph: CircleGraph, config: CircleConfig) -> dict[str, int]:
    """Run the Circle-level steps the config enables; step name → sites changed."""
    stats = {}
    for name, step in STEPS:
        if name == "fuse-activations" and not config.fuse_activations:
            continue
        stats[name] = step(graph)
    return stats
