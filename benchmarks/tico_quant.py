"""TICO's own post-training quantization, the peer of fxopt's quantized Circle files.

TICO 0.3.0 (Samsung's torch → Circle converter) quantizes in eager mode, module by module
("WrapQ"): ``tico.quantization.prepare(model, PTQConfig(...))`` replaces every module it has
a wrapper for (Conv2d, Linear, MaxPool2d, ReLU/ReLU6/GELU, LayerNorm, Embedding, QuantStub,
...) with a wrapper holding min/max observers on its input, output and weight; running the
prepared model on calibration batches fills them; ``tico.quantization.convert`` freezes the
scales and switches the wrappers to fake quantization; ``tico.convert`` exports that model,
and its quantization passes (FoldQuantOps, PropagateQParam*, QuantizeBias, ...) turn the
fake-quant pairs into the integer tensors of the Circle file. Anything outside a wrapper
(BatchNorm, ``torch.matmul``, softmax, ...) has no observer of its own: elementwise ops
between wrapped modules (a residual ``+``) get their parameters propagated from a
neighbour, the rest stays float. 0.3.0 has no graph-level (PT2E) PTQ flow.

Two schemes (:data:`SCHEMES`), both defaults of TICO's own:

* ``uint8``: ``PTQConfig()`` as it comes. Activations uint8 affine per tensor; weights
  uint8 affine *per channel* (the Conv2d and Linear wrappers ask for per-channel).
* ``int16``: ``affine(DType.int(16))`` for both roles, the default of TICO's config
  builders (and ``activation: int16`` of its LLM recipe CLI). Activations int16 symmetric
  per tensor; Conv2d weights int16 symmetric per channel; Linear weights int16 per channel
  but *asymmetric* (QuantLinear hard-codes PER_CHANNEL_ASYMM, which the signed-dtype rule
  does not override).

TICO's files have quantized graph inputs and outputs (no QUANTIZE / DEQUANTIZE at the
boundary): :func:`runs_in` quantizes float inputs with each input's scale and zero point
and dequantizes the outputs. :func:`tico_ptq` lists the workarounds applied before PTQ.

    python benchmarks/tico_quant.py [--scheme uint8|int16|both] [--models cnn_bn,bert] [--bare]
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

SCHEMES = ("uint8", "int16")


def ptq_config(scheme: str = "uint8", *, strict_wrap: bool = False):
    """TICO's ``PTQConfig`` for ``scheme`` (tico/quantization/config/ptq.py).

    ``strict_wrap=False``: with TICO's default (True), ``prepare`` raises
    ``NotImplementedError: PTQWrapHelper: no quantization wrapper for <Model>`` for every
    model whose top module has no wrapper (all models here); False wraps the modules it
    can and leaves the others float.
    """
    from tico.quantization.config.ptq import PTQConfig
    from tico.quantization.config.specs import affine
    from tico.quantization.wrapq.dtypes import DType

    if scheme == "uint8":
        return PTQConfig(strict_wrap=strict_wrap)  # uint8 is the default for both roles
    if scheme == "int16":
        int16 = DType.int(16)
        return PTQConfig(activation=affine(int16), weight=affine(int16), strict_wrap=strict_wrap)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def tico_ptq(
    model: torch.nn.Module,
    calibration: list[tuple],
    scheme: str = "uint8",
    *,
    fold_batchnorm: bool = True,
    unshare_calls: bool = True,
    bias_for_convs: bool = True,
    strict_wrap: bool = False,
) -> torch.nn.Module:
    """prepare → calibrate on exactly ``calibration`` → convert, on a deep copy of
    ``model``: TICO's fake-quantized module, ready for ``tico.convert``.

    Workarounds (flags; all off gives the bare recipe):

    * ``fold_batchnorm``: TICO has no BatchNorm wrapper, so BatchNorm stays float between
      two quantized tensors: the file gets a MUL with a uint8 input and float32 output
      and an ADD back to uint8, which neither runtime loads. BatchNorm is folded into the
      preceding conv first with ``torch.fx.experimental.optimization.fuse`` (torch's own
      inference fusion; it returns a GraphModule). Only when the model has a BatchNorm.
    * ``unshare_calls``: WrapQ observes per *module*, so a module called at several sites
      (torchvision's BasicBlock calls one ``self.relu`` twice) gets one observer for all
      of them, and TICO writes one set of quantization parameters for tensors of different
      ranges. In the GraphModule the fold made, each further call site gets its own copy
      (eager-mode quantization's usual rule). Only where the fold traced the model.
    * ``bias_for_convs``: for a Conv2d without bias TICO writes a *float32* zero bias
      beside uint8 input and weights (QuantizeBias only quantizes a bias parameter), which
      LiteRT rejects ("bias->type != kTfLiteInt32"). Such convs get a zero bias parameter.
    * ``strict_wrap``: see :func:`ptq_config`.
    """
    from tico.quantization import convert, prepare

    model = copy.deepcopy(model).eval()
    if fold_batchnorm and any(
        isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()
    ):
        from torch.fx.experimental.optimization import fuse

        model = fuse(model).eval()
        if unshare_calls:
            _unshare_calls(model)
    if bias_for_convs:
        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d) and module.bias is None:
                module.bias = torch.nn.Parameter(torch.zeros(module.out_channels))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = prepare(model, ptq_config(scheme, strict_wrap=strict_wrap))
        with torch.no_grad():
            for batch in calibration:
                prepared(*batch)
        return convert(prepared).eval()


def _unshare_calls(gm: torch.fx.GraphModule) -> int:
    """Give every call of a module after its first one a copy of its own; returns how many
    call sites changed."""
    calls: Counter[str] = Counter()
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        calls[node.target] += 1
        if calls[node.target] > 1:
            target = f"{node.target}_call{calls[node.target]}"
            gm.add_submodule(target, copy.deepcopy(gm.get_submodule(node.target)))
            node.target = target
            changed += 1
    gm.recompile()
    return changed


def to_circle(quantized: torch.nn.Module, example_inputs: tuple) -> bytes:
    """``tico.convert`` → ``CircleModel.save`` → the file's bytes."""
    import tico

    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp:
        warnings.simplefilter("ignore")
        path = Path(tmp) / "model.circle"
        tico.convert(quantized, tuple(example_inputs)).save(str(path))
        return path.read_bytes()


def quantize_tico(
    model: torch.nn.Module,
    example_inputs: tuple,
    calibration: list[tuple],
    scheme: str = "uint8",
    **workarounds: bool,
) -> bytes:
    """TICO 0.3.0's PTQ recipe: ``prepare(model, PTQConfig)`` (min/max observers, ``scheme``
    uint8 or int16, see :func:`ptq_config`), run each batch of ``calibration`` once,
    ``convert``, ``tico.convert(model, example_inputs)``, save; returns the .circle file
    bytes. Does not mutate ``model`` (deepcopy). ``workarounds``: :func:`tico_ptq`'s flags."""
    return to_circle(tico_ptq(model, calibration, scheme, **workarounds), example_inputs)


# --- reading the file ----------------------------------------------------------------

_NUMPY = {
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FLOAT32": np.float32,
    "BOOL": np.bool_,
}


def _model(data: bytes):
    from circle_schema.v0_10.circle.Model import Model, ModelT

    return ModelT.InitFromObj(Model.GetRootAsModel(data, 0))


def _type_names() -> dict[int, str]:
    from circle_schema.v0_10.circle.TensorType import TensorType

    return {v: k for k, v in vars(TensorType).items() if not k.startswith("_")}


def _scales(tensor) -> int:
    q = tensor.quantization
    return 0 if q is None or q.scale is None else len(q.scale)


#: Operators whose TFLite / onert integer kernels move values without rescaling them: the
#: output must carry the input's scale and zero point, or the result is silently wrong.
SAME_QPARAMS = frozenset(
    {"MAX_POOL_2D", "RESHAPE", "TRANSPOSE", "PAD", "PADV2", "SQUEEZE", "EXPAND_DIMS",
     "GATHER", "SLICE", "STRIDED_SLICE", "SPACE_TO_DEPTH", "DEPTH_TO_SPACE"}
)  # fmt: skip


def _qparams(tensor) -> tuple:
    q = tensor.quantization
    return (float(q.scale[0]), int(q.zeroPoint[0]) if q.zeroPoint is not None else 0)


def describe(circle_bytes: bytes) -> dict:
    """Operator counts (builtin name → count, via benchmarks/circle.py's ``op_names``),
    tensor dtype counts over all subgraphs, ``has_int16`` / ``has_uint8``, whether a tensor
    is quantized per channel, operators mixing float and quantized operands, operators of
    :data:`SAME_QPARAMS` whose output scale / zero point differ from their input's, the
    graph inputs'/outputs' dtypes, and the file size."""
    from circle_schema.v0_10.circle.BuiltinOperator import BuiltinOperator
    from circle_schema.v0_10.circle.TensorType import TensorType

    from circle import op_names  # benchmarks/circle.py, the fxopt-vs-TICO benchmark

    model = _model(circle_bytes)
    names = _type_names()
    tensors = [t for sg in model.subgraphs for t in sg.tensors]
    dtypes = Counter(names[t.type] for t in tensors)
    main = model.subgraphs[0]
    converters = {BuiltinOperator.QUANTIZE, BuiltinOperator.DEQUANTIZE}
    mixed = Counter()
    for op in main.operators or []:
        code = model.operatorCodes[op.opcodeIndex].builtinCode
        operands = [main.tensors[i] for i in [*op.inputs, *op.outputs] if i >= 0]
        has_float = any(t.type == TensorType.FLOAT32 for t in operands)
        if code not in converters and has_float and any(_scales(t) > 0 for t in operands):
            mixed[code] += 1
    op_name = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    requantizing = Counter()
    for op in main.operators or []:
        name = op_name.get(model.operatorCodes[op.opcodeIndex].builtinCode)
        if name in SAME_QPARAMS and op.inputs[0] >= 0 and op.outputs[0] >= 0:
            source, target = main.tensors[op.inputs[0]], main.tensors[op.outputs[0]]
            if _scales(source) == _scales(target) == 1 and _qparams(source) != _qparams(target):
                requantizing[name] += 1
    return {
        "bytes": len(circle_bytes),
        "op_counts": dict(Counter(op_names(circle_bytes)).most_common()),
        "tensor_dtypes": dict(dtypes.most_common()),
        "has_int16": dtypes["INT16"] > 0,
        "has_uint8": dtypes["UINT8"] > 0,
        "float_tensors": dtypes["FLOAT32"],
        # operators with float32 and quantized operands together (no QUANTIZE between):
        # what a module without a TICO wrapper leaves behind; no runtime accepts them
        "mixed_ops": {op_name[code]: n for code, n in mixed.most_common()},
        "per_channel": any(_scales(t) > 1 for t in tensors),
        "requantizing_ops": dict(requantizing.most_common()),
        "input_dtypes": [names[main.tensors[i].type] for i in main.inputs],
        "output_dtypes": [names[main.tensors[i].type] for i in main.outputs],
    }


def _io(circle_bytes: bytes) -> tuple[list[dict], list[dict]]:
    """(inputs, outputs) of the main graph: numpy dtype, and scale / zero point when the
    tensor is an integer tensor quantized per tensor (else scale None)."""
    model = _model(circle_bytes)
    names = _type_names()
    main = model.subgraphs[0]

    def info(index: int) -> dict:
        tensor = main.tensors[index]
        dtype = _NUMPY.get(names[tensor.type])
        q = tensor.quantization
        quantized = _scales(tensor) == 1 and dtype is not None and np.issubdtype(dtype, np.integer)
        return {
            "dtype": dtype,
            "scale": float(q.scale[0]) if quantized else None,
            "zero_point": int(q.zeroPoint[0]) if quantized and q.zeroPoint is not None else 0,
        }

    return [info(i) for i in main.inputs], [info(i) for i in main.outputs]


def _numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value)


def _quantize(value, info: dict) -> np.ndarray:
    """``value`` in the file's input dtype: quantized with the input's scale and zero point
    when the input is quantized, else cast."""
    array = _numpy(value)
    dtype = info["dtype"]
    if info["scale"] is None:
        return array if dtype is None else np.ascontiguousarray(array.astype(dtype))
    limits = np.iinfo(dtype)
    q = np.round(array.astype(np.float64) / info["scale"]) + info["zero_point"]
    return np.ascontiguousarray(np.clip(q, limits.min, limits.max).astype(dtype))


def _dequantize(array: np.ndarray, info: dict) -> np.ndarray:
    array = np.asarray(array)
    if info["scale"] is None or not np.issubdtype(array.dtype, np.integer):
        return array
    return ((array.astype(np.float64) - info["zero_point"]) * info["scale"]).astype(np.float32)


def float_io_twin(circle_bytes: bytes) -> bytes:
    """``circle_bytes`` with float32 graph inputs and outputs: a QUANTIZE from a new float
    input into each quantized input, a DEQUANTIZE from each quantized output to a new float
    output; nothing else changes.

    Why: onert 0.1.0's Python binding cannot feed a uint8 or int16 graph input. Its first
    ``infer`` re-sets every input's tensorinfo, the dtype string does not convert back
    ("Cannot convert string to NNFW_TYPE"), and a typo in its error path turns that into
    ``NameError: name 'Oner' is not defined``."""
    import flatbuffers
    from circle_schema.v0_10.circle import Model, Operator, OperatorCode, Tensor
    from circle_schema.v0_10.circle.BuiltinOperator import BuiltinOperator
    from circle_schema.v0_10.circle.TensorType import TensorType

    model = Model.ModelT.InitFromPackedBuf(circle_bytes, 0)
    main = model.subgraphs[0]
    in_info, out_info = _io(circle_bytes)

    def opcode(code: int) -> int:
        for i, existing in enumerate(model.operatorCodes):
            if existing.builtinCode == code:
                return i
        new = OperatorCode.OperatorCodeT()
        new.builtinCode, new.deprecatedBuiltinCode, new.version = code, min(code, 127), 1
        model.operatorCodes.append(new)
        return len(model.operatorCodes) - 1

    def float_copy(index: int) -> int:
        tensor, new = main.tensors[index], Tensor.TensorT()
        new.shape, new.shapeSignature = tensor.shape, tensor.shapeSignature
        new.type, new.buffer = TensorType.FLOAT32, 0
        new.name = (tensor.name or b"") + b"_float"
        main.tensors.append(new)
        return len(main.tensors) - 1

    def operator(code: int, source: int, target: int):
        new = Operator.OperatorT()
        new.opcodeIndex, new.inputs, new.outputs = opcode(code), [source], [target]
        return new

    renamed: dict[int, int] = {}
    before, after = [], []
    for index, info in zip(main.inputs, in_info):
        if info["scale"] is not None:
            renamed[index] = float_copy(index)
            before.append(operator(BuiltinOperator.QUANTIZE, renamed[index], index))
    for index, info in zip(main.outputs, out_info):
        if info["scale"] is not None and index not in renamed:
            renamed[index] = float_copy(index)
            after.append(operator(BuiltinOperator.DEQUANTIZE, index, renamed[index]))
    main.operators = [*before, *(main.operators or []), *after]
    main.inputs = [renamed.get(i, i) for i in main.inputs]
    main.outputs = [renamed.get(i, i) for i in main.outputs]
    for signature in model.signatureDefs or []:
        for entry in [*(signature.inputs or []), *(signature.outputs or [])]:
            entry.tensorIndex = renamed.get(entry.tensorIndex, entry.tensorIndex)
    builder = flatbuffers.Builder(len(circle_bytes) + 4096)
    builder.Finish(model.Pack(builder), file_identifier=b"CIR0")
    return bytes(builder.Output())


def error_line(error: BaseException | str, native: list[str] | None = None) -> str:
    """``Type: first line``, plus the first two lines the runtime printed (onert prints why
    it refuses a model and raises only NNFW_STATUS_ERROR)."""
    if isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        line = f"{type(error).__name__}: {text[0][:240] if text else ''}"
    else:
        line = error
    if native:
        line += " [" + " | ".join(n[:160] for n in native[:2]) + "]"
    return line


# A child process runs one runtime on one file: numpy and fxopt.circle.runtime only.
_CHILD = """
import sys
from pathlib import Path

import numpy as np

from fxopt.circle.runtime import open_session

runtime, folder = sys.argv[1], Path(sys.argv[2])
with np.load(folder / "inputs.npz") as saved:
    arrays = [saved[f"arr_{i}"] for i in range(len(saved.files))]
data = (folder / "model.circle").read_bytes()
try:
    with open_session(data, runtime) as session:
        outputs = session.run(arrays)
except Exception as error:
    text = str(error).strip().splitlines()
    (folder / "error.txt").write_text(f"{type(error).__name__}: {text[0][:240] if text else ''}")
    raise SystemExit(1)
np.savez(folder / "outputs.npz", *outputs)
"""


def run_isolated(runtime: str, circle_bytes: bytes, arrays: list, timeout: float = 300) -> list:
    """``runtime`` ("onert" | "litert") on ``arrays`` in a child process, so that a runtime
    aborting on a file (LiteRT does, on TICO's BERT) costs one row, not the run. Returns
    the outputs; raises RuntimeError with the runtime's error and what it printed."""
    import signal
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "model.circle").write_bytes(circle_bytes)
        np.savez(os.path.join(folder, "inputs.npz"), *arrays)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, runtime, folder],
                capture_output=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s") from None
        if done.returncode == 0:
            with np.load(os.path.join(folder, "outputs.npz")) as saved:
                return [saved[f"arr_{i}"] for i in range(len(saved.files))]
        printed = (done.stdout + done.stderr).decode(errors="replace").splitlines()
        # the runtime's own lines, not torch's or torchao's import chatter
        noise = ("W1", "Failed to load", "warnings.warn", "Traceback", "File ", "/")
        native = [
            line.strip()
            for line in printed
            if line.strip() and not line.strip().startswith(noise) and "Warning" not in line
        ]
        error_path = Path(folder, "error.txt")
        if error_path.exists():
            message = error_path.read_text()
        else:
            code = done.returncode
            died = signal.Signals(-code).name if code < 0 else f"exit code {code}"
            message = f"the runtime's process died ({died})"
        raise RuntimeError(error_line(message, native))


def example_for(circle_bytes: bytes, seed: int = 0) -> tuple:
    """An input for each graph input: standard normal floats where the file's input is
    float or quantized, zeros where it is an integer (index) tensor."""
    model = _model(circle_bytes)
    main = model.subgraphs[0]
    in_info, _ = _io(circle_bytes)
    generator = np.random.default_rng(seed)
    inputs = []
    for index, info in zip(main.inputs, in_info):
        shape = [int(d) for d in main.tensors[index].shape]
        dtype = info["dtype"] or np.float32
        if info["scale"] is not None or np.issubdtype(dtype, np.floating):
            inputs.append(generator.standard_normal(shape).astype(np.float32))
        else:
            inputs.append(np.zeros(shape, dtype=dtype))
    return tuple(inputs)


def runs_in(circle_bytes: bytes, inputs: tuple | None = None) -> dict:
    """Whether onert (:class:`fxopt.circle.runtime.Session`) and LiteRT
    (:class:`~fxopt.circle.runtime.LiteRTSession`: the file re-packed as TFLite, reference
    kernels) load and run the file on ``inputs``: runtime → ``{"runs", "error",
    "outputs"}``, outputs as float arrays (None when it did not run). Each runtime runs in
    a child process (:func:`run_isolated`).

    LiteRT runs the file itself: float inputs are quantized here with each input's scale
    and zero point, and the outputs dequantized. onert runs :func:`float_io_twin` (its
    Python binding cannot feed quantized inputs), where QUANTIZE / DEQUANTIZE do the same
    arithmetic inside the runtime. ``inputs`` None: :func:`example_for`."""
    if inputs is None:
        inputs = example_for(circle_bytes)
    in_info, out_info = _io(circle_bytes)
    report = {}
    try:
        arrays = [
            _numpy(x).astype(np.float32) if i["scale"] is not None else _quantize(x, i)
            for x, i in zip(inputs, in_info)
        ]
        outputs = run_isolated("onert", float_io_twin(circle_bytes), arrays)
        report["onert"] = {"runs": True, "error": None, "outputs": outputs}
    except Exception as error:
        report["onert"] = {"runs": False, "error": _message(error), "outputs": None}
    try:
        arrays = [_quantize(x, info) for x, info in zip(inputs, in_info)]
        raw = run_isolated("litert", circle_bytes, arrays)
        outputs = [_dequantize(o, info) for o, info in zip(raw, out_info)]
        report["litert"] = {"runs": True, "error": None, "outputs": outputs}
    except Exception as error:
        report["litert"] = {"runs": False, "error": _message(error), "outputs": None}
    return report


def _message(error: BaseException) -> str:
    return str(error) if isinstance(error, RuntimeError) else error_line(error)


def tico_fake_quant(circle_bytes: bytes, inputs: tuple) -> list[np.ndarray]:
    """The file's outputs from TICO's own reference runtime in ``FAKE_QUANTIZE`` mode
    (tico/circle/runtime: float arithmetic, every quantized tensor rounded to its stored
    scale / zero point, as ONE's ``--fake_quantize``). Not an integer runtime and not
    independent of TICO, but it measures the file's quantization parameters when no
    runtime runs the file (its NATIVE mode refuses integer CONV_2D and friends)."""
    from tico.circle.runtime import CircleReferenceRuntime, ExecutionMode

    in_info, _ = _io(circle_bytes)
    arrays = [
        _numpy(x).astype(np.float32) if i["scale"] is not None else _quantize(x, i)
        for x, i in zip(inputs, in_info)
    ]
    runtime = CircleReferenceRuntime(circle_bytes)
    return list(runtime.run(arrays, mode=ExecutionMode.FAKE_QUANTIZE).outputs)


def sqnr_db(reference, approximation) -> float:
    """SQNR over all outputs together (:func:`fxopt.quant.sqnr_db`); NaN on a shape
    mismatch."""
    from fxopt.quant import sqnr_db as sqnr

    def flat(arrays) -> torch.Tensor:
        return torch.cat(
            [torch.as_tensor(np.asarray(a, dtype=np.float64)).reshape(-1) for a in arrays]
        )

    if [np.shape(r) for r in reference] != [np.shape(a) for a in approximation]:
        return float("nan")
    return sqnr(flat(reference), flat(approximation))


# --- the run --------------------------------------------------------------------------


def _zoo(spec: str):
    """A model of fxopt's zoo (torchvision's layouts; torchvision itself is not installed
    here) and a function drawing inputs of its example's shape from a seed."""

    def make():
        from fxopt import zoo

        name, options = zoo.parse_spec(spec)
        entry = zoo.create(name, **options)
        shape = entry.example_inputs[0].shape

        def images(seed: int) -> tuple:
            return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)),)

        return entry.model.eval(), images

    return make


def _bert():
    """transformers' BertModel (hidden 64, 2 layers, 2 heads, FFN 128), no pooler, weights
    redrawn at a trained model's scale (benchmarks/circle_models.py's ``_Outputs``), input_ids
    (1, 16); its output is ``last_hidden_state``."""
    from transformers import BertConfig, BertModel

    from circle_models import _Outputs

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
    )
    model = _Outputs(BertModel(config, add_pooling_layer=False), ("last_hidden_state",))

    def tokens(seed: int) -> tuple:
        generator = torch.Generator().manual_seed(seed)
        return (torch.randint(0, config.vocab_size, (1, 16), generator=generator),)

    return model.eval(), tokens


MODELS = {
    "cnn_bn": _zoo("cnn_bn?batch=1&image=32"),
    "resnet18": _zoo("resnet18?image=64"),
    "mobilenet_v2": _zoo("mobilenet_v2?image=64"),
    "bert": _bert,
}


def run_model(name: str, scheme: str, calibration_batches: int = 8, **workarounds) -> dict:
    """Quantize one model with TICO and measure the file: conversion, size, operators,
    the runtimes, and SQNR against the float model on a held-out input (seed 999;
    example seed 0, calibration seeds 100…)."""
    model, make_inputs = MODELS[name]()
    example = make_inputs(0)
    calibration = [make_inputs(100 + i) for i in range(calibration_batches)]
    held_out = make_inputs(999)
    with torch.no_grad():
        expected = model(*held_out)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    expected = [e.numpy() for e in expected]
    row: dict = {"model": name, "scheme": scheme}
    start = time.perf_counter()
    try:
        quantized = tico_ptq(model, calibration, scheme, **workarounds)
        row["ptq_s"] = time.perf_counter() - start
        with torch.no_grad():
            fake = quantized(*held_out)
        fake = [fake] if isinstance(fake, torch.Tensor) else list(fake)
        row["torch_fake_quant_sqnr_db"] = sqnr_db(expected, [f.numpy() for f in fake])
        data = to_circle(quantized, example)
    except Exception as error:
        row.update(converted=False, error=error_line(error), convert_s=time.perf_counter() - start)
        return row
    row.update(converted=True, convert_s=time.perf_counter() - start, **describe(data))
    for runtime, result in runs_in(data, held_out).items():
        row[runtime] = result["runs"]
        row[f"{runtime}_error"] = result["error"]
        if result["runs"]:
            row[f"{runtime}_sqnr_db"] = sqnr_db(expected, result["outputs"])
    try:
        row["tico_fake_quant_sqnr_db"] = sqnr_db(expected, tico_fake_quant(data, held_out))
    except Exception as error:
        row["tico_fake_quant_error"] = error_line(error)
    return row


def _print(row: dict) -> None:
    head = f"{row['model']} / {row['scheme']}:"
    if not row["converted"]:
        print(f"{head} converted: no ({row['convert_s']:.1f} s) {row['error']}", flush=True)
        return
    print(
        f"{head} converted: yes in {row['convert_s']:.1f} s (PTQ {row['ptq_s']:.1f} s), "
        f"{row['bytes'] / 1024:.1f} KiB, per-channel: {row['per_channel']}, "
        f"io {row['input_dtypes']} -> {row['output_dtypes']}"
    )
    print(f"    ops: {row['op_counts']}")
    print(
        f"    tensors: {row['tensor_dtypes']}; float/quantized mixed ops: {row['mixed_ops']}; "
        f"requantizing pass-through ops: {row['requantizing_ops']}"
    )
    for runtime in ("onert", "litert"):
        if row[runtime]:
            print(f"    {runtime}: runs, SQNR {row[f'{runtime}_sqnr_db']:.1f} dB")
        else:
            print(f"    {runtime}: no: {row[f'{runtime}_error']}")
    tico_ref = row.get("tico_fake_quant_sqnr_db")
    tico_ref = f"{tico_ref:.1f} dB" if tico_ref is not None else row.get("tico_fake_quant_error")
    print(
        f"    SQNR of TICO's fake-quant torch model {row['torch_fake_quant_sqnr_db']:.1f} dB; "
        f"of the file in TICO's reference runtime (FAKE_QUANTIZE) {tico_ref}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="both", choices=(*SCHEMES, "both"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--bare", action="store_true", help="no workarounds: TICO's recipe exactly as documented"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    workarounds = {}
    if args.bare:
        workarounds = {
            "fold_batchnorm": False,
            "unshare_calls": False,
            "bias_for_convs": False,
            "strict_wrap": True,
        }
    schemes = SCHEMES if args.scheme == "both" else (args.scheme,)
    # Warm up (torch.export's and TICO's first call pay for imports), so the first model's
    # conversion time is not charged with them.
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    quantize_tico(tiny, (torch.randn(1, 4),), [(torch.randn(1, 4),)])
    started = time.perf_counter()
    for name in args.models.split(","):
        for scheme in schemes:
            _print(run_model(name, scheme, **workarounds))
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
