"""CircleQuantizer: which values of an exported graph are quantized, and how, for the
integer kernels onert runs (a torchao PT2E ``Quantizer``).

Walks the graph once in order and asks :mod:`fxopt.ir.ops` what each node is:

* conv / linear: input and output quantized, weight symmetric per output channel; the
  bias stays float (the converter stores it as int32 at the accumulator's scale). A ReLU
  or ReLU6 that is the only reader of the result is annotated *with* it: one quantized
  output after the activation, so the activation fuses into the integer kernel.
* add / sub / mul of two activations: both operands and the output (a following ReLU
  fuses too). With a constant or scalar operand: nothing (it runs in float; a QUANTIZE
  after it would only round).
* pools, reshapes, permutes, slices, concatenations: the output shares the input's
  parameters (onert's uint8 pool and concatenation kernels need them equal; for the rest
  it makes the operator a no-op on the integers).
* embedding: the table in the activations' type, per tensor, the output sharing its
  parameters (so the file stores the table as integers and looks rows up on them).
* mean: input and output. sigmoid, softmax: the fixed output range [0, 1) in 1/256 steps;
  tanh: [-1, 1) in 1/128 steps (what the integer kernels require).
* everything else (GELU, matmul, layer norm...): not annotated, so it runs in float
  between a DEQUANTIZE and a QUANTIZE.
"""

from __future__ import annotations

import torch
from torch import fx
from torchao.quantization.pt2e.observer import (
    HistogramObserver,
    MinMaxObserver,
    PerChannelMinMaxObserver,
)
from torchao.quantization.pt2e.quantizer import (
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

from fxopt.ir import ops

_WEIGHTED = ("conv", "linear")
_ARITHMETIC = ("add", "sub", "mul")
_ACTIVATIONS = ("relu", "relu6", "hardtanh")
_SHARED = (
    "max_pool",
    "avg_pool",
    "adaptive_avg_pool",
    "flatten",
    "view",
    "reshape",
    "permute",
    "transpose",
    "squeeze",
    "unsqueeze",
    "slice",
    "pad",
)
#: scheme → op → (scale, zero point) of its output that the integer kernels require
#: (uint8 written as int8 here: the converter adds 128 to the zero point).
_FIXED = {
    "uint8": {"sigmoid": (1 / 256, -128), "softmax": (1 / 256, -128), "tanh": (1 / 128, 0)},
    "int16": {"sigmoid": (1 / 32768, 0), "softmax": (1 / 32768, 0), "tanh": (1 / 32768, 0)},
}
#: scheme → activation type, its range, and whether the zero point is free.
_ACTIVATION = {
    "uint8": (torch.int8, -128, 127, torch.per_tensor_affine),
    "int16": (torch.int16, -32768, 32767, torch.per_tensor_symmetric),
}


class CircleQuantizer(Quantizer):
    """The annotation :func:`fxopt.quant.quantize` uses (see the module docstring)."""

    def __init__(
        self, scheme: str = "uint8", observer: str = "minmax", weights: str = "per_channel"
    ):
        super().__init__()
        activation_observer = MinMaxObserver if observer == "minmax" else HistogramObserver
        # uint8: int8 in the graph, the zero point free; the converter writes uint8.
        # int16: symmetric (zero point 0), as the 16-bit kernels of TFLite/NPUs require.
        dtype, qmin, qmax, qscheme = _ACTIVATION[scheme]
        # The smallest scale: 8 bits cannot use a finer one, 16 bits can.
        eps = 2**-12 if scheme == "uint8" else 2**-24
        self.activation = QuantizationSpec(
            dtype=dtype,
            quant_min=qmin,
            quant_max=qmax,
            qscheme=qscheme,
            observer_or_fake_quant_ctr=activation_observer.with_args(eps=eps),
        )
        per_channel = weights == "per_channel"
        self.weight = QuantizationSpec(
            dtype=torch.int8,
            quant_min=-127,
            quant_max=127,
            qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
            ch_axis=0,
            observer_or_fake_quant_ctr=(
                PerChannelMinMaxObserver if per_channel else MinMaxObserver
            ).with_args(eps=2**-12),
        )
        self.scheme = scheme

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        for node in model.graph.nodes:
            if not ops.is_compute(node) or _annotated(node) or not _is_float_tensor(node):
                continue  # integer results (ids, positions, shapes) are not quantized
            name = ops.info(node, model).name
            if name in _WEIGHTED:
                self._weighted(node, model)
            elif name in _ARITHMETIC and all(_is_activation(a) for a in node.args[:2]):
                # With a constant or scalar operand the integer kernel cannot be used (the
                # constant has no grid of its own): a QUANTIZE would only round.
                self._annotate(node, {a: self.activation for a in node.args[:2]}, model)
            elif name in _SHARED and _is_float_tensor(node.args[0]):
                source = node.args[0]
                _set(node, {source: self.activation}, SharedQuantizationSpec((source, node)))
            elif name == "cat":
                self._cat(node)
            elif name == "embedding" and isinstance(node.args[0], fx.Node):
                # The table stored in the activations' type; the looked-up rows keep its
                # parameters (a lookup moves values without changing them).
                table = node.args[0]
                _set(node, {table: self.activation}, SharedQuantizationSpec((table, node)))
            elif name == "mean" and _is_float_tensor(node.args[0]):
                _set(node, {node.args[0]: self.activation}, self.activation)
            elif name in _FIXED[self.scheme] and _is_float_tensor(node.args[0]):
                scale, zero_point = _FIXED[self.scheme][name]
                fixed = FixedQParamsQuantizationSpec(
                    dtype=self.activation.dtype,
                    scale=scale,
                    zero_point=zero_point,
                    quant_min=self.activation.quant_min,
                    quant_max=self.activation.quant_max,
                    qscheme=torch.per_tensor_affine,
                )
                _set(node, {node.args[0]: self.activation}, fixed)
        return model

    def validate(self, model: fx.GraphModule) -> None:
        pass

    def _weighted(self, node: fx.Node, model: fx.GraphModule) -> None:
        x, weight = node.args[0], node.args[1]
        if not (_is_float_tensor(x) and isinstance(weight, fx.Node)):
            return
        self._annotate(node, {x: self.activation, weight: self.weight}, model)

    def _annotate(self, node: fx.Node, inputs: dict, model: fx.GraphModule) -> None:
        """``node``'s inputs, and its output or that of the ReLU that is its only reader."""
        users = list(node.users)
        activation = users[0] if len(users) == 1 else None
        if activation is not None and _fusable(activation, model):
            _set(node, inputs, None)
            _set(activation, {}, self.activation)
        else:
            _set(node, inputs, self.activation)

    def _cat(self, node: fx.Node) -> None:
        tensors = [t for t in node.args[0] if _is_float_tensor(t)]
        if not tensors:
            return
        first = tensors[0]
        inputs = {first: self.activation}
        inputs.update({t: SharedQuantizationSpec((first, node)) for t in tensors[1:]})
        _set(node, inputs, SharedQuantizationSpec((first, node)))


def _fusable(node: fx.Node, model: fx.GraphModule) -> bool:
    """A ReLU, ReLU6 or hardtanh(0, 6): what Circle kernels fuse."""
    name = ops.info(node, model).name if ops.is_compute(node) else ""
    if name == "hardtanh":
        low = node.args[1] if len(node.args) > 1 else -1.0
        high = node.args[2] if len(node.args) > 2 else 1.0
        return (low, high) == (0.0, 6.0)
    return name in _ACTIVATIONS


def _is_float_tensor(value: object) -> bool:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _is_activation(value: object) -> bool:
    """A float tensor computed by the graph (not a parameter, buffer or scalar)."""
    return isinstance(value, fx.Node) and value.op != "get_attr" and _is_float_tensor(value)


def _annotated(node: fx.Node) -> bool:
    annotation = node.meta.get("quantization_annotation")
    return annotation is not None and annotation._annotated


def _set(node: fx.Node, inputs: dict, output) -> None:
    node.meta["quantization_annotation"] = QuantizationAnnotation(
        input_qspec_map=inputs, output_qspec=output, _annotated=True
    )
