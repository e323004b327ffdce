"""Per-kernel validation of a quantized Circle file: each integer operator against its float
twin, on the integers the file itself computed.

End to end, an integer file and the quantized model it came from drift apart with depth:
an integer kernel rounds its accumulator where the model's float arithmetic does not, so
one layer's output may be one step off, and the next layer carries that difference
forward and adds its own. A deep network (MobileNetV2, ResNet-18) ends several steps away
from the quantized model though every kernel is right. This check asks the question that
holds at any depth — is every integer kernel right? — in two runtime calls:

1. the file, with every integer activation also dequantized to an extra output: what each
   integer operator read and wrote;
2. one file holding, for each integer operator, its float twin: the same operator and
   options on the dequantized inputs (weights and biases dequantized from their integers),
   then QUANTIZE / DEQUANTIZE with the operator's output parameters — the quantized
   model's arithmetic for that one operator.

Each integer operator's output must be within ``steps`` of its twin's, element by element.

    >>> import numpy as np
    >>> from circle_schema.v0_10.circle.AddOptions import AddOptionsT
    >>> from fxopt.circle.graph import CircleGraph, Quantization
    >>> g = CircleGraph()
    >>> q = Quantization((0.1,), (128,))
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> xq = g.add_tensor("xq", (2, 3), np.uint8, quantization=q)
    >>> yq = g.add_tensor("yq", (2, 3), np.uint8, quantization=Quantization((0.2,), (128,)))
    >>> out = g.add_tensor("out", (2, 3), np.float32)
    >>> g.add_op("QUANTIZE", [x], [xq])
    >>> g.add_op("ADD", [xq, xq], [yq], AddOptionsT())  # onert needs the options
    >>> g.add_op("DEQUANTIZE", [yq], [out])
    >>> g.inputs, g.outputs, g.input_names, g.output_names = [x], [out], ["x"], ["out"]
    >>> result = check_kernels(g, [np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)])
    >>> result.checked, result.failures
    (1, [])
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from fxopt.circle.graph import CircleGraph, Quantization

_BOUNDARY = ("QUANTIZE", "DEQUANTIZE")


@dataclass
class KernelCheck:
    """How the integer kernels of a file compare with their float twins."""

    checked: int = 0  # integer operators compared
    worst_steps: float = 0.0  # the largest difference, in output quantization steps
    failures: list[str] = field(default_factory=list)  # "OP tensor: N steps"

    @property
    def passed(self) -> bool:
        return self.checked > 0 and not self.failures


def integer_operators(graph: CircleGraph) -> list[int]:
    """Indices of the operators that write an integer activation (QUANTIZE excluded)."""
    return [
        i
        for i, op in enumerate(graph.operators)
        if op.code not in _BOUNDARY and _integer(graph, op.outputs[0])
    ]


def check_kernels(
    graph: CircleGraph, inputs: list[np.ndarray], runtime: str = "onert", steps: float = 2.0
) -> KernelCheck:
    """Compare every integer operator of ``graph`` with its float twin on ``inputs`` (the
    file's float inputs), in ``runtime`` ("onert" or "litert")."""
    from fxopt.circle.build import build

    ops = integer_operators(graph)
    if not ops:
        return KernelCheck()
    probed, probes = _with_probes(graph, ops)
    values = dict(zip(probes, _run(build(probed), inputs, runtime)[len(graph.outputs) :]))
    values.update(zip(graph.inputs, inputs))
    feeds = [values[i] for index in ops for i in _runtime_operands(graph, index)]
    actual = _run(build(_twins(graph, ops)), feeds, runtime)
    result = KernelCheck(checked=len(ops))
    for index, twin_output in zip(ops, actual):
        out = graph.operators[index].outputs[0]
        step = max(graph.tensors[out].quantization.scale)
        error = float(np.max(np.abs(values[out] - twin_output))) if twin_output.size else 0.0
        difference = error / step
        result.worst_steps = max(result.worst_steps, difference)
        if difference > steps * 1.001:
            op = graph.operators[index]
            result.failures.append(f"{op.code} {graph.tensors[out].name}: {difference:.1f} steps")
    return result


def _integer(graph: CircleGraph, index: int) -> bool:
    tensor = graph.tensors[index] if index >= 0 else None
    return tensor is not None and tensor.data is None and tensor.quantization is not None


def _runtime_operands(graph: CircleGraph, index: int) -> list[int]:
    """The operands of operator ``index`` computed at run time (not constants), in order."""
    return [i for i in graph.operators[index].inputs if i >= 0 and graph.tensors[i].data is None]


def _with_probes(graph: CircleGraph, ops: list[int]) -> tuple[CircleGraph, list[int]]:
    """A copy of ``graph`` whose extra outputs are every integer activation, dequantized,
    and the other run-time operands of the operators ``ops`` (indices into an embedding
    table, ...) as they are; and the probed tensors' indices, in output order."""
    probed = copy.copy(graph)
    probed.tensors = list(graph.tensors)
    probed.operators = list(graph.operators)
    probed.outputs, probed.output_names = list(graph.outputs), list(graph.output_names)
    integer = {i for op in graph.operators for i in (*op.inputs, *op.outputs) if _integer(graph, i)}
    others = {i for index in ops for i in _runtime_operands(graph, index)} - integer
    probes = sorted(integer) + sorted(others - set(graph.inputs))
    for index in probes:
        tensor = graph.tensors[index]
        if index in integer:
            out = probed.add_tensor(f"{tensor.name}_probe", tensor.shape, np.float32)
            probed.add_op("DEQUANTIZE", [index], [out])
        else:
            out = index
        probed.outputs.append(out)
        probed.output_names.append(f"probe_{index}")
    return probed, probes


def _twins(graph: CircleGraph, ops: list[int]) -> CircleGraph:
    """One graph with the float twin of each integer operator in ``ops``: float inputs
    (one per integer operand, in order), constants dequantized, the operator, then
    QUANTIZE / DEQUANTIZE with its output parameters."""
    twins = CircleGraph()
    constants: dict[int, int] = {}
    for index in ops:
        op = graph.operators[index]
        operands = []
        for i in op.inputs:
            if i < 0:
                operands.append(i)
            elif graph.tensors[i].data is None:  # fed: dequantized if integer, else as is
                t = graph.tensors[i]
                dtype = np.float32 if _integer(graph, i) else t.dtype
                operands.append(twins.add_tensor(f"{t.name}_in{index}", t.shape, dtype))
                twins.inputs.append(operands[-1])
                twins.input_names.append(f"in_{index}_{i}")
            else:
                if i not in constants:
                    constants[i] = _float_constant(twins, graph.tensors[i])
                operands.append(constants[i])
        out = graph.tensors[op.outputs[0]]
        y = twins.add_tensor(f"{out.name}_float", out.shape, np.float32)
        q = twins.add_tensor(f"{out.name}_q", out.shape, out.dtype, quantization=out.quantization)
        back = twins.add_tensor(f"{out.name}_twin", out.shape, np.float32)
        twins.add_op(op.code, operands, [y], op.options)
        twins.add_op("QUANTIZE", [y], [q])
        twins.add_op("DEQUANTIZE", [q], [back])
        twins.outputs.append(back)
        twins.output_names.append(f"twin_{index}")
    return twins


def _float_constant(graph: CircleGraph, tensor) -> int:
    """``tensor`` in ``graph``: a quantized constant (weight, bias) as its real values, any
    other constant (shapes, axes, paddings) as it is."""
    q: Quantization | None = tensor.quantization
    if q is None:
        return graph.add_tensor(tensor.name, tensor.shape, tensor.dtype, tensor.data)
    shape = [1] * tensor.data.ndim
    if len(q.scale) > 1:
        shape[q.axis] = len(q.scale)
    scale = np.asarray(q.scale, np.float64).reshape(shape)
    zero_point = np.asarray(q.zero_point, np.float64).reshape(shape)
    real = ((tensor.data.astype(np.float64) - zero_point) * scale).astype(np.float32)
    return graph.add_tensor(f"{tensor.name}_real", tensor.shape, np.float32, real)


def _run(data: bytes, inputs: list[np.ndarray], runtime: str) -> list[np.ndarray]:
    from fxopt.circle.runtime import open_session

    with open_session(data, runtime) as session:
        return [np.array(o, copy=True) for o in session.run(inputs)]
