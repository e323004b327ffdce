"""Per-kernel validation of a file with ggml weights: each such FULLY_CONNECTED against
ggml's arithmetic, on the input the file itself computed.

onert's kernel for a ggml weight (:mod:`fxopt.quant.ggml`) rounds its input to q8_0
blocks before the product. The quantized model does the same rounding in torch, but on
an input computed by torch's kernels, which differs from onert's in the last bits: where
a value sits on a rounding boundary the two round it to neighbouring steps, and the
difference (one step of that block, times the weights) is carried to the outputs. End to
end the file and the quantized model then differ by more than float rounding, though
every kernel is right. This check asks whether every kernel is right, in one runtime
call: the file with each ggml FULLY_CONNECTED's input and output as extra outputs, then
ggml's arithmetic (:func:`fxopt.quant.ggml.round_input` and the unpacked weight) on each
probed input, compared with the probed output within ``rtol`` of its largest magnitude.

    >>> import numpy as np, torch
    >>> from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
    >>> from fxopt.circle.graph import CircleGraph
    >>> from fxopt.quant.ggml import pack
    >>> g = CircleGraph()
    >>> x, y = g.add_tensor("x", (2, 64), np.float32), g.add_tensor("y", (2, 8), np.float32)
    >>> w = g.add_tensor("w", (8, 64), np.uint8, pack(torch.randn(8, 64), "q4_0").numpy())
    >>> g.tensors[w].packed = "GGML_Q4_0"
    >>> g.add_op("FULLY_CONNECTED", [x, w, -1], [y], FullyConnectedOptionsT())
    >>> g.inputs, g.outputs, g.input_names, g.output_names = [x], [y], ["x"], ["y"]
    >>> x = np.random.default_rng(0).standard_normal((2, 64), np.float32)
    >>> found = check_ggml_kernels(g, [x])
    >>> found.checked, found.failures
    (1, [])
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from fxopt.circle.graph import CircleGraph
from fxopt.circle.kernel_check import KernelCheck

#: Each kernel's result within this fraction of its largest magnitude (measured: 1.5e-7).
RTOL = 1e-5


def ggml_operators(graph: CircleGraph) -> list[int]:
    """Indices of the FULLY_CONNECTEDs whose weight is in a ggml block format."""
    return [
        i
        for i, op in enumerate(graph.operators)
        if op.code == "FULLY_CONNECTED" and graph.tensors[op.inputs[1]].packed is not None
    ]


def check_ggml_kernels(
    graph: CircleGraph, inputs: list[np.ndarray], runtime: str = "onert", rtol: float = RTOL
) -> KernelCheck:
    """Compare every ggml FULLY_CONNECTED of ``graph`` with ggml's arithmetic on the input
    the file computed for it (module docs). ``worst_steps`` is the largest difference as a
    fraction of the kernel's output range."""
    from fxopt.circle.build import build
    from fxopt.circle.runtime import open_session
    from fxopt.quant.ggml import CIRCLE_TYPES, ggml_linear

    kinds = {circle: kind for kind, circle in CIRCLE_TYPES.items()}
    ops = ggml_operators(graph)
    if not ops:
        return KernelCheck()
    operands = {i for k in ops for i in (graph.operators[k].inputs[0], *graph.operators[k].outputs)}
    probes = sorted(operands - set(graph.inputs))
    probed = _with_copies_out(graph, probes)
    values = dict(zip(graph.inputs, inputs))
    with open_session(build(probed), runtime) as session:
        outputs = session.run(inputs)
    values.update(zip(probes, outputs[len(graph.outputs) :]))
    result = KernelCheck(checked=len(ops))
    for index in ops:
        op = graph.operators[index]
        weight = graph.tensors[op.inputs[1]]
        x = torch.from_numpy(np.ascontiguousarray(values[op.inputs[0]]))
        expected = ggml_linear(
            x, torch.from_numpy(weight.data), None, kinds[weight.packed], weight.shape[0]
        ).numpy()
        expected = _activated(expected, getattr(op.options, "fusedActivationFunction", 0))
        got = values[op.outputs[0]]
        scale = float(np.max(np.abs(expected))) if expected.size else 0.0
        error = float(np.max(np.abs(got - expected))) if expected.size else 0.0
        relative = error / scale if scale else error
        result.worst_steps = max(result.worst_steps, relative)
        if not relative <= rtol:
            name = graph.tensors[op.outputs[0]].name
            result.failures.append(f"FULLY_CONNECTED {name}: {relative:.2g} of its range")
    return result


def _with_copies_out(graph: CircleGraph, probes: list[int]) -> CircleGraph:
    """A copy of ``graph`` whose extra outputs are copies (RESHAPEs to the same shape) of
    the tensors ``probes``. An intermediate tensor made a graph output directly comes out
    of onert 0.1.0 with other values (measured: a Llama's normalized hidden state off by
    3.4, where the copy matches torch within 7e-7)."""
    from circle_schema.v0_10.circle.ReshapeOptions import ReshapeOptionsT

    probed = copy.copy(graph)
    probed.tensors, probed.operators = list(graph.tensors), list(graph.operators)
    probed.outputs, probed.output_names = list(graph.outputs), list(graph.output_names)
    for index in probes:
        tensor = graph.tensors[index]
        out = probed.add_tensor(f"{tensor.name}_probe", tensor.shape, tensor.dtype)
        shape = probed.add_tensor("shape", (len(tensor.shape),), np.int32)
        probed.tensors[shape].data = np.asarray(tensor.shape, np.int32)
        options = ReshapeOptionsT()
        options.newShape = list(tensor.shape)
        probed.add_op("RESHAPE", [index, shape], [out], options)
        probed.outputs.append(out)
        probed.output_names.append(f"probe_{index}")
    return probed


def _activated(values: np.ndarray, activation: int) -> np.ndarray:
    """``values`` after a FULLY_CONNECTED's fused activation, as the file states it."""
    from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType as Act

    bounds = {Act.RELU: (0, None), Act.RELU6: (0, 6), Act.RELU_N1_TO_1: (-1, 1)}
    if activation == Act.NONE:
        return values
    if activation not in bounds:
        return np.full_like(values, np.nan)  # no arithmetic to compare with: a failure
    return np.clip(values, *bounds[activation])
