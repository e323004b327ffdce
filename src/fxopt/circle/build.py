"""Serialize a :class:`~fxopt.circle.graph.CircleGraph` to Circle bytes.

Uses the ONE project's own schema bindings (``circle_schema``, object API) and
``flatbuffers``; no hand-written tables. What this module decides:

* **Buffers.** Buffer 0 is the empty sentinel every TFLite/Circle reader expects. Constant
  tensors with the same ``buffer_key`` (one torch storage: tied weights) share one buffer.
  Data is packed from uint8 numpy arrays in one copy, 16-byte aligned: packing a
  ``bytes`` object goes element by element (~1 s/MB), and misaligned float data is what
  some kernels reject.
* **Operator codes.** ``builtinCode`` holds the real code; ``deprecatedBuiltinCode`` is an
  int8 and holds ``min(code, 127)`` (127 = PLACEHOLDER_FOR_GREATER_OP_CODES) so readers of
  either field agree.
* **The 2 GiB limit.** FlatBuffers use 32-bit offsets. When the constants exceed
  ``external_threshold`` bytes, their data goes after the FlatBuffer and each Buffer holds
  ``offset`` / ``size`` into the file instead of ``data``.
* **Unused tensors** (left by fusions) are dropped and indices renumbered.

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (1, 4), np.float32)
    >>> y = g.add_tensor("y", (1, 4), np.float32)
    >>> g.add_op("RELU", [x], [y]); g.inputs, g.outputs = [x], [y]
    >>> data = build(g)
    >>> data[4:8]
    b'CIR0'
"""

from __future__ import annotations

import flatbuffers
import numpy as np
from circle_schema.v0_10.circle import (
    Buffer,
    BuiltinOperator,
    BuiltinOptions,
    Model,
    Operator,
    OperatorCode,
    QuantizationParameters,
    SignatureDef,
    SubGraph,
    Tensor,
    TensorMap,
    TensorType,
)

from fxopt.circle.graph import CircleGraph

FILE_IDENTIFIER = b"CIR0"
# Circle readers take 0 as the schema version (as TICO and onecc write).
SCHEMA_VERSION = 0
# 2 GiB minus headroom for the tables themselves: FlatBuffers offsets are signed 32-bit.
EXTERNAL_THRESHOLD = 2**31 - 2**26
_ALIGN = 16

_TENSOR_TYPES = {
    np.dtype(np.float32): TensorType.TensorType.FLOAT32,
    np.dtype(np.float16): TensorType.TensorType.FLOAT16,
    np.dtype(np.float64): TensorType.TensorType.FLOAT64,
    np.dtype(np.int32): TensorType.TensorType.INT32,
    np.dtype(np.int64): TensorType.TensorType.INT64,
    np.dtype(np.int16): TensorType.TensorType.INT16,
    np.dtype(np.int8): TensorType.TensorType.INT8,
    np.dtype(np.uint8): TensorType.TensorType.UINT8,
    np.dtype(np.bool_): TensorType.TensorType.BOOL,
}


def tensor_type(dtype: np.dtype) -> int:
    try:
        return _TENSOR_TYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"Circle has no tensor type for numpy dtype {dtype}") from None


def builtin_code(name: str) -> int:
    return getattr(BuiltinOperator.BuiltinOperator, name)


class _AlignedBuffer(Buffer.BufferT):
    """A Buffer whose data vector starts on a 16-byte boundary, copied in one block."""

    def Pack(self, builder):
        data = None
        if self.data is not None:
            payload = self.data.tobytes()
            builder.StartVector(1, len(payload), _ALIGN)
            builder.head -= len(payload)
            builder.Bytes[builder.head : builder.head + len(payload)] = payload
            builder.vectorNumElems = len(payload)
            data = builder.EndVector()
        Buffer.BufferStart(builder)
        if data is not None:
            Buffer.BufferAddData(builder, data)
        if self.offset:
            Buffer.BufferAddOffset(builder, self.offset)
            Buffer.BufferAddSize(builder, self.size)
        return Buffer.BufferEnd(builder)


def build(graph: CircleGraph, *, external_threshold: int = EXTERNAL_THRESHOLD) -> bytes:
    """Circle bytes for ``graph`` (one subgraph, one ``serving_default`` signature)."""
    graph = _compact(graph)
    blobs, tensor_buffer = _buffers(graph)
    external = sum(len(b) for b in blobs) > external_threshold
    if not external:
        return _serialize(graph, blobs, tensor_buffer, offsets=None)
    # Offsets point past the FlatBuffer, whose size does not depend on their values
    # (fixed-width uint64 fields): build once with placeholders, then with real offsets.
    placeholder = [1] * len(blobs)
    head = _serialize(graph, blobs, tensor_buffer, offsets=placeholder)
    offsets, position = [], _aligned(len(head))
    for blob in blobs:
        offsets.append(position)
        position = _aligned(position + len(blob))
    head = _serialize(graph, blobs, tensor_buffer, offsets=offsets)
    out = bytearray(head)
    for offset, blob in zip(offsets, blobs):
        out.extend(b"\0" * (offset - len(out)))
        out.extend(blob.tobytes())
    return bytes(out)


def constant_bytes(graph: CircleGraph) -> int:
    """Bytes of constant data after deduplication (what the 2 GiB limit is about)."""
    return sum(len(b) for b in _buffers(_compact(graph))[0])


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _compact(graph: CircleGraph) -> CircleGraph:
    used = set(graph.inputs) | set(graph.outputs)
    for op in graph.operators:
        used.update(i for i in op.inputs if i >= 0)
        used.update(op.outputs)
    keep = [i for i in range(len(graph.tensors)) if i in used]
    if len(keep) == len(graph.tensors):
        return graph
    renumber = {old: new for new, old in enumerate(keep)}
    renumber[-1] = -1  # the "optional input absent" marker
    out = CircleGraph(
        tensors=[graph.tensors[i] for i in keep],
        inputs=[renumber[i] for i in graph.inputs],
        outputs=[renumber[i] for i in graph.outputs],
        input_names=list(graph.input_names),
        output_names=list(graph.output_names),
    )
    for op in graph.operators:
        out.add_op(
            op.code, [renumber[i] for i in op.inputs], [renumber[i] for i in op.outputs], op.options
        )
    return out


def _buffers(graph: CircleGraph) -> tuple[list[np.ndarray], list[int]]:
    """Constant data as uint8 arrays (one per distinct key) and each tensor's buffer index."""
    blobs: list[np.ndarray] = []
    by_key: dict[object, int] = {}
    tensor_buffer = []
    for tensor in graph.tensors:
        if tensor.data is None:
            tensor_buffer.append(0)
            continue
        key = tensor.buffer_key if tensor.buffer_key is not None else ("tensor", id(tensor))
        if key not in by_key:
            data = np.ascontiguousarray(tensor.data, dtype=tensor.dtype)
            blobs.append(data.reshape(-1).view(np.uint8))
            by_key[key] = len(blobs)  # buffer 0 is the empty sentinel
        tensor_buffer.append(by_key[key])
    return blobs, tensor_buffer


def _serialize(graph, blobs, tensor_buffer, offsets) -> bytes:
    model = Model.ModelT()
    model.version = SCHEMA_VERSION
    model.description = "fxopt"
    codes: dict[str, int] = {}
    model.operatorCodes = []
    sub = SubGraph.SubGraphT()
    sub.name = "main"
    sub.tensors = []
    for tensor, buffer_index in zip(graph.tensors, tensor_buffer):
        t = Tensor.TensorT()
        t.name = tensor.name
        t.shape = np.asarray(tensor.shape, dtype=np.int32)
        t.type = tensor_type(tensor.dtype)
        t.buffer = buffer_index
        if tensor.shape_signature is not None:
            t.shapeSignature = np.asarray(tensor.shape_signature, dtype=np.int32)
        if tensor.quantization is not None:
            t.quantization = _quantization(tensor.quantization)
        sub.tensors.append(t)
    sub.operators = []
    for op in graph.operators:
        if op.code not in codes:
            code = OperatorCode.OperatorCodeT()
            code.builtinCode = builtin_code(op.code)
            code.deprecatedBuiltinCode = min(code.builtinCode, 127)
            code.version = 1
            codes[op.code] = len(model.operatorCodes)
            model.operatorCodes.append(code)
        o = Operator.OperatorT()
        o.opcodeIndex = codes[op.code]
        o.inputs = np.asarray(op.inputs, dtype=np.int32)
        o.outputs = np.asarray(op.outputs, dtype=np.int32)
        if op.options is not None:
            o.builtinOptionsType = getattr(
                BuiltinOptions.BuiltinOptions, type(op.options).__name__.removesuffix("T")
            )
            o.builtinOptions = op.options
        sub.operators.append(o)
    sub.inputs = np.asarray(graph.inputs, dtype=np.int32)
    sub.outputs = np.asarray(graph.outputs, dtype=np.int32)
    model.subgraphs = [sub]
    model.buffers = [_AlignedBuffer()]
    for i, blob in enumerate(blobs):
        buffer = _AlignedBuffer()
        if offsets is None:
            buffer.data = blob
        else:
            buffer.offset, buffer.size = offsets[i], len(blob)
        model.buffers.append(buffer)
    model.signatureDefs = [_signature(graph)]
    builder = flatbuffers.Builder(1024 + sum(len(b) for b in blobs) if offsets is None else 1024)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _quantization(q) -> QuantizationParameters.QuantizationParametersT:
    params = QuantizationParameters.QuantizationParametersT()
    params.scale = np.asarray(q.scale, dtype=np.float32)
    params.zeroPoint = np.asarray(q.zero_point, dtype=np.int64)
    params.quantizedDimension = q.axis
    return params


def _signature(graph: CircleGraph):
    signature = SignatureDef.SignatureDefT()
    signature.signatureKey = "serving_default"
    signature.subgraphIndex = 0
    signature.inputs, signature.outputs = [], []
    for names, indices, out in (
        (graph.input_names, graph.inputs, signature.inputs),
        (graph.output_names, graph.outputs, signature.outputs),
    ):
        for name, index in zip(names, indices):
            entry = TensorMap.TensorMapT()
            entry.name, entry.tensorIndex = name, index
            out.append(entry)
    return signature
