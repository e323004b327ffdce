"""What the converter needs to know about a quantized model and file: whether a graph is
quantized, the quantization step each output is compared within, and the report's
quantization section.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph, Quantization
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (4,), np.float32)
    >>> q = g.add_tensor("q", (4,), np.uint8, quantization=Quantization((0.5,), (128,)))
    >>> y = g.add_tensor("y", (4,), np.float32)
    >>> g.add_op("QUANTIZE", [x], [q])
    >>> g.add_op("DEQUANTIZE", [q], [y])
    >>> g.inputs, g.outputs = [x], [y]
    >>> output_steps(g)
    [0.5]
    >>> summary(g)["tensor_dtypes"]
    {'float32': 2, 'uint8': 1}
"""

from __future__ import annotations

from collections import Counter

from torch import fx

from fxopt.circle.graph import CircleGraph
from fxopt.ir import ops

_QUANTIZATION_OPS = ("quantize", "dequantize", "fake_quantize")


def is_quantized(gm: fx.GraphModule) -> bool:
    """True when ``gm`` quantizes or dequantizes anything (PT2E, fake-quant, fxopt.quant)."""
    return any(
        ops.is_compute(node) and ops.info(node, gm).name in _QUANTIZATION_OPS
        for node in gm.graph.nodes
    )


def is_quantized_module(model: object) -> bool:
    """True for a PT2E or fake-quant GraphModule (what :func:`is_quantized` says of its
    graph); False for any other module, which is not looked into."""
    return isinstance(model, fx.GraphModule) and is_quantized(model)


def output_steps(graph: CircleGraph) -> list[float | None]:
    """Per output of ``graph``, the largest quantization step of the integer tensors
    nearest upstream of it (None for an output no integer tensor feeds): the unit in which
    integer kernels, which round where the quantized model's float arithmetic does not,
    may make it differ."""
    producers = graph.producers()
    steps: list[float | None] = []
    for output in graph.outputs:
        found: list[float] = []
        seen, frontier = set(), [output]
        while frontier:
            index = frontier.pop()
            if index in seen or index < 0:
                continue
            seen.add(index)
            tensor = graph.tensors[index]
            if tensor.quantization is not None and tensor.data is None:
                found.append(max(tensor.quantization.scale))
                continue
            producer = producers.get(index)
            if producer is not None:
                frontier.extend(producer.inputs)
        steps.append(max(found) if found else None)
    return steps


def summary(graph: CircleGraph) -> dict:
    """The report's quantization section: how many tensors of each type, and how many
    operators run on integers (an integer output) against those left in float."""
    live = {i for op in graph.operators for i in (*op.inputs, *op.outputs)}
    live.update(graph.inputs)
    activations = [
        graph.tensors[i] for i in sorted(live) if i >= 0 and graph.tensors[i].data is None
    ]
    integer_ops = Counter()
    float_ops = Counter()
    for op in graph.operators:
        if op.code in ("QUANTIZE", "DEQUANTIZE"):
            continue
        (integer_ops if graph.tensors[op.outputs[0]].quantization else float_ops)[op.code] += 1
    return {
        "tensor_dtypes": dict(sorted(Counter(t.dtype.name for t in activations).items())),
        "integer_kernels": integer_kernels(graph),
        "quantized_ops": dict(integer_ops.most_common()),
        "float_ops": dict(float_ops.most_common()),
        "quantize_ops": sum(op.code == "QUANTIZE" for op in graph.operators),
        "dequantize_ops": sum(op.code == "DEQUANTIZE" for op in graph.operators),
    }


def integer_kernels(graph: CircleGraph) -> list[str]:
    """The integer kernels a runtime needs for ``graph``: "OP type" for each operator that
    reads or writes an integer activation (QUANTIZE and DEQUANTIZE included), sorted.

    >>> import numpy as np
    >>> from fxopt.circle.graph import Quantization
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (4,), np.float32)
    >>> q = g.add_tensor("q", (4,), np.int16, quantization=Quantization((0.5,), (0,)))
    >>> g.add_op("QUANTIZE", [x], [q])
    >>> integer_kernels(g)
    ['QUANTIZE int16']
    """
    found = set()
    for op in graph.operators:
        for index in (*op.outputs, *op.inputs):
            tensor = graph.tensors[index] if index >= 0 else None
            if tensor is not None and tensor.data is None and tensor.quantization is not None:
                found.add(f"{op.code} {tensor.dtype.name}")
                break
    return sorted(found)
