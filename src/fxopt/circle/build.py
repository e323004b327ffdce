"""Serialize a :class:`~fxopt.circle.graph.CircleGraph` to Circle bytes.

Uses the ONE project's own schema bindings (``circle_schema``, object API) and
``flatbuffers``; no hand-written tables. What this module decides:

* **Buffers.** Buffer 0 is the empty sentinel every TFLite/Circle reader expects. Constant
  tensors with the same ``buffer_key`` (one torch storage: tied weights) share one buffer.
  Data is packed from uint8 numpy views of the weights (no copy where the weight's layout
  is the file's), straight into the builder, 16-byte aligned: packing a ``bytes`` object
  goes element by element (~1 s/MB), and misaligned float data is what some kernels
  reject.
* **One copy of the weights.** The builder's buffer is sized up front (growing it would
  copy it), and the file is that buffer (a :class:`~fxopt.circle.file.CircleFile` over it:
  no ``bytes`` copy); a file with offset buffers (below) is written to disk one weight at a
  time, straight from the weights' memory.
* **Constants the passes made move into the file.** A weight numpy computed (fold-affine's
  scaled weights, quantized or packed blocks) is dropped once copied into an in-memory
  file, and its tensor then reads the file's copy: held beside the file, they were a
  second copy of most of a Llama's weights (+0.6x on a 0.7 GiB one, measured). The
  model's own weights (views of torch storages) are only read.
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

import mmap

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

from fxopt.circle.file import CircleFile
from fxopt.circle.graph import CircleGraph
from fxopt.memory import release_free_memory

FILE_IDENTIFIER = b"CIR0"
# Circle readers take 0 as the schema version (as TICO and onecc write).
SCHEMA_VERSION = 0
#: How a LiteRT (TFLite) file says what it is: the same schema, version 3, ``TFL3``.
LITERT = (b"TFL3", 3)
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
    """A Buffer whose data vector starts on a 16-byte boundary, copied in one block. With
    ``moved`` set, its data is dropped once copied (``moved`` is called) and ``from_end``
    says where the copy starts, counted from the builder's end (growing it moves the
    start, not the distance to the end)."""

    moved = None
    from_end = 0

    def Pack(self, builder):
        data = None
        if self.data is not None:
            size = self.data.nbytes
            builder.StartVector(1, size, _ALIGN)
            builder.head -= size
            # Through memoryviews: assigning a buffer to a bytearray slice copies it first
            # (a transient copy of the largest weight, 0.18x a Llama's weights, measured).
            with memoryview(builder.Bytes) as target:
                target[builder.head : builder.head + size] = memoryview(self.data).cast("B")
            builder.vectorNumElems = size
            start = len(builder.Bytes) - builder.head
            data = builder.EndVector()
            if self.moved is not None:
                self.from_end, self.data = start, None
                self.moved()
        Buffer.BufferStart(builder)
        if data is not None:
            Buffer.BufferAddData(builder, data)
        if self.offset:
            Buffer.BufferAddOffset(builder, self.offset)
            Buffer.BufferAddSize(builder, self.size)
        return Buffer.BufferEnd(builder)


def build(graph: CircleGraph, *, external_threshold: int = EXTERNAL_THRESHOLD) -> bytes:
    """Circle bytes for ``graph`` (one subgraph, one ``serving_default`` signature)."""
    return build_file(graph, external_threshold=external_threshold).read()


def build_file(
    graph: CircleGraph,
    *,
    external_threshold: int = EXTERNAL_THRESHOLD,
    identifier: bytes = FILE_IDENTIFIER,
    version: int = SCHEMA_VERSION,
) -> CircleFile:
    """The Circle file for ``graph``: in memory (the builder's own buffer), or, when the
    constants exceed ``external_threshold`` bytes, a temporary file with offset buffers,
    each weight written straight from its memory. ``identifier`` and ``version``: what the
    file says it is (``b"TFL3"``, 3: its LiteRT twin, :data:`LITERT`)."""
    graph = _compact(graph)
    blobs, tensor_buffer = _buffers(graph)
    external = sum(b.nbytes for b in blobs) > external_threshold
    header = (identifier, version)
    if not external:
        tensor_buffer, movable = _moving_first(graph, blobs, tensor_buffer)
        return CircleFile(_serialize(graph, blobs, tensor_buffer, None, *header, movable))
    # Offsets point past the FlatBuffer, whose size does not depend on their values
    # (fixed-width uint64 fields): build once with placeholders, then with real offsets.
    placeholder = [1] * len(blobs)
    head = _serialize(graph, blobs, tensor_buffer, placeholder, *header)
    offsets, position = [], _aligned(head.nbytes)
    for blob in blobs:
        offsets.append(position)
        position = _aligned(position + blob.nbytes)
    head = _serialize(graph, blobs, tensor_buffer, offsets, *header)
    circle, out = CircleFile.temporary()
    with out:
        out.write(head)
        written = head.nbytes
        for offset, blob in zip(offsets, blobs):
            out.write(b"\0" * (offset - written))
            out.write(blob)
            written = offset + blob.nbytes
    return circle


def constant_bytes(graph: CircleGraph) -> int:
    """Bytes of constant data after deduplication (what the 2 GiB limit is about)."""
    return sum(b.nbytes for b in _buffers(_compact(graph))[0])


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


def _private(array: np.ndarray) -> bool:
    """Whether numpy allocated ``array``'s memory (a pass's product), rather than a torch
    tensor it views (the model's own weights)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array.base is None


class _Moved:
    """A blob that moves into the file: every tensor reading it holds numpy's own memory.
    :meth:`drop` lets that memory go once copied; :meth:`land` points the tensors at the
    file's copy."""

    # glibc keeps freed blocks below its mmap threshold resident; the builder's pages come
    # on top. Handed back to the system each time this much was dropped.
    TRIM_BYTES = 8 * 2**20
    dropped = 0  # bytes since the last trim (one conversion at a time builds)

    def __init__(self, blobs: list, index: int, tensors: list):
        self.blobs, self.index, self.tensors = blobs, index, tensors
        self.shapes = [(t.data.dtype, t.data.shape) for t in tensors]
        self.nbytes = blobs[index].nbytes

    def drop(self) -> None:
        self.blobs[self.index] = None
        for tensor in self.tensors:
            tensor.data = None
        _Moved.dropped += self.nbytes
        if _Moved.dropped >= self.TRIM_BYTES:
            _Moved.dropped = 0
            release_free_memory()

    def land(self, data: bytearray, start: int) -> None:
        for tensor, (dtype, shape) in zip(self.tensors, self.shapes):
            count = int(np.prod(shape))
            tensor.data = np.frombuffer(data, dtype, count, start).reshape(shape)


def _moving_first(
    graph: CircleGraph, blobs: list, tensor_buffer: list[int]
) -> tuple[list[int], dict[int, _Moved]]:
    """Blobs only numpy-made, contiguous tensors of the blob's own dtype read (as
    ``_buffers`` wrote them) move into the file. They are put first (``blobs`` reordered
    in place): a moved blob is held twice only while it is copied, and copied before the
    file has grown by the others, that moment is no peak. Returns each tensor's new
    buffer index and, by blob index, the :class:`_Moved` ones."""
    readers: dict[int, list] = {}
    for tensor, buffer_index in zip(graph.tensors, tensor_buffer):
        if buffer_index:
            readers.setdefault(buffer_index - 1, []).append(tensor)
    moving = [
        index
        for index, tensors in readers.items()
        if all(
            _private(t.data)
            and t.data.flags.c_contiguous
            and t.data.dtype == t.dtype
            and t.data.nbytes == blobs[index].nbytes
            for t in tensors
        )
    ]
    staying = sorted(set(range(len(blobs))) - set(moving))
    order = sorted(moving) + staying
    renumber = {old: new for new, old in enumerate(order)}
    blobs[:] = [blobs[old] for old in order]
    tensor_buffer = [renumber[b - 1] + 1 if b else 0 for b in tensor_buffer]
    return tensor_buffer, {renumber[i]: _Moved(blobs, renumber[i], readers[i]) for i in moving}


def _serialize(
    graph, blobs, tensor_buffer, offsets, identifier, version, movable=None
) -> memoryview:
    """The FlatBuffer, as a view of the builder's buffer (sized up front: growing it would
    copy it, a weight-sized copy for a file with its data inside). ``movable``: the blobs
    to move into it (see :class:`_Moved`)."""
    movable = movable or {}
    model = Model.ModelT()
    model.version = version
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
        t.type = (
            getattr(TensorType.TensorType, tensor.packed)
            if tensor.packed is not None
            else tensor_type(tensor.dtype)
        )
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
    for i in range(len(blobs)):  # (no loop variable: it would keep the last blob from moving)
        buffer = _AlignedBuffer()
        if offsets is None:
            buffer.data = blobs[i]
            if i in movable:
                buffer.moved = movable[i].drop
        else:
            buffer.offset, buffer.size = offsets[i], len(blobs[i])
        model.buffers.append(buffer)
    model.signatureDefs = [_signature(graph)]
    data = sum(_aligned(b.nbytes) + _ALIGN for b in blobs) if offsets is None else 0
    builder = _builder(data + _tables_estimate(graph))
    builder.Finish(model.Pack(builder), file_identifier=identifier)
    for index, buffer in enumerate(model.buffers[1:]):
        if buffer.moved is not None:
            movable[index].land(builder.Bytes, len(builder.Bytes) - buffer.from_end)
    return memoryview(builder.Bytes)[builder.Head() :]


def _builder(size: int) -> flatbuffers.Builder:
    """A builder over ``size`` bytes of anonymous mapped memory. Its own bytearray would be
    zeroed (every page touched) at once: a file-sized peak before the first weight is
    copied, while the weights that move into it are still held. Mapped pages are taken
    as they are written."""
    builder = flatbuffers.Builder(0)
    builder.Bytes = mmap.mmap(-1, size)
    builder.Clear()  # (its head at the new end)
    return builder


def _tables_estimate(graph: CircleGraph) -> int:
    """An upper estimate of the FlatBuffer's bytes besides the constant data: per tensor its
    table, name and shape vectors; per operator its table, index vectors and options (a
    few hundred bytes at most, measured on the zoo's files)."""
    names = sum(len(t.name) for t in graph.tensors)
    quantized = sum(
        16 * len(t.quantization.scale) for t in graph.tensors if t.quantization is not None
    )
    return 64 * 1024 + names + quantized + 256 * (len(graph.tensors) + len(graph.operators))


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
