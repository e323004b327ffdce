"""Quantized Circle tensors: the builder writes their parameters, and onert 0.1.0 behaves as
the capability table (fxopt.circle.onert_quantized) says, and so does LiteRT for int16,
re-measured on one-operator files: float in → QUANTIZE → OP → DEQUANTIZE → float out
(onert's Python binding cannot feed integer inputs itself)."""

from __future__ import annotations

import numpy as np
import pytest
from circle_schema.v0_10.circle.AddOptions import AddOptionsT
from circle_schema.v0_10.circle.GeluOptions import GeluOptionsT
from circle_schema.v0_10.circle.Model import Model, ModelT
from circle_schema.v0_10.circle.MulOptions import MulOptionsT
from circle_schema.v0_10.circle.SubOptions import SubOptionsT

from fxopt.circle.build import build
from fxopt.circle.graph import CircleGraph, Quantization
from fxopt.circle.onert_quantized import REFUSED, RUNS, WRONG, kernel
from fxopt.circle.runtime import litert_available, onert_available, open_session

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
needs_litert = pytest.mark.skipif(not litert_available(), reason="LiteRT is not installed")
F32 = np.float32
_INTEGER = {"uint8": np.uint8, "int8": np.int8, "int16": np.int16}
_RANGE = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-32768, 32767)}


def _params(low: float, high: float, scheme: str) -> Quantization:
    """Parameters covering [low, high]: asymmetric for uint8/int8, symmetric for int16."""
    qmin, qmax = _RANGE[scheme]
    if scheme == "int16":
        return Quantization((max(abs(low), abs(high)) / qmax,), (0,))
    scale = (high - low) / (qmax - qmin)
    return Quantization((scale,), (round(qmin - low / scale),))


# op → (reference in float, number of operands, output range, options factory)
_OPS = {
    "ADD": (np.add, 2, (-4.0, 4.0), AddOptionsT),
    "SUB": (np.subtract, 2, (-4.0, 4.0), SubOptionsT),
    "MUL": (np.multiply, 2, (-4.0, 4.0), MulOptionsT),
    "MAXIMUM": (np.maximum, 2, (-2.0, 2.0), None),  # the inputs' own parameters
    "MAXIMUM requantizing": (np.maximum, 2, (-4.0, 4.0), None),
    "RELU requantizing": (lambda x: np.maximum(x, 0), 1, (-2.0, 2.0), None),
    "LOGISTIC": (lambda x: 1 / (1 + np.exp(-x)), 1, (0.0, 255 / 256), None),
    "TANH": (np.tanh, 1, (-1.0, 127 / 128), None),
    "RELU": (lambda x: np.maximum(x, 0), 1, (0.0, 2.0), None),
    "RELU6": (lambda x: np.clip(x, 0, 6), 1, (0.0, 2.0), None),
    "GELU": (None, 1, (-0.2, 2.0), GeluOptionsT),
}


def one_op_file(op: str, scheme: str) -> tuple[bytes, Quantization, Quantization]:
    """The file for ``op`` ("MAXIMUM" or a variant such as "MAXIMUM requantizing"), and its
    input and output parameters."""
    _, arity, (low, high), options = _OPS[op]
    g = CircleGraph()
    integer = _INTEGER[scheme]
    in_q = _params(-2.0, 2.0, scheme)
    out_q = _params(low, high, scheme)
    if op == "LOGISTIC" and scheme == "uint8":
        out_q = Quantization((1 / 256,), (0,))  # what TFLite kernels require
    if op == "TANH" and scheme == "uint8":
        out_q = Quantization((1 / 128,), (128,))
    if op in ("LOGISTIC", "TANH") and scheme == "int16":
        out_q = Quantization((1 / 32768,), (0,))
    operands = []
    for i in range(arity):
        x = g.add_tensor(f"x{i}", (2, 8), F32)
        q = g.add_tensor(f"q{i}", (2, 8), integer, quantization=in_q)
        g.add_op("QUANTIZE", [x], [q])
        g.inputs.append(x)
        g.input_names.append(f"x{i}")
        operands.append(q)
    y = g.add_tensor("y", (2, 8), integer, quantization=out_q)
    options = options() if options else None
    if hasattr(options, "potScaleInt16"):
        options.potScaleInt16 = False  # int16 ADD/SUB with any scales (see the table)
    g.add_op(op.split()[0], operands, [y], options)
    out = g.add_tensor("out", (2, 8), F32)
    g.add_op("DEQUANTIZE", [y], [out])
    g.outputs, g.output_names = [out], ["output_0"]
    return build(g), in_q, out_q


def _dequantized(x: np.ndarray, q: Quantization, scheme: str) -> np.ndarray:
    """``x`` through quantize then dequantize with ``q``: what the operator really sees."""
    qmin, qmax = _RANGE[scheme]
    steps = np.clip(np.round(x / q.scale[0]) + q.zero_point[0], qmin, qmax)
    return ((steps - q.zero_point[0]) * q.scale[0]).astype(F32)


def measure(op: str, scheme: str, runtime: str = "onert") -> str:
    """RUNS, REFUSED or WRONG for ``op`` quantized in ``scheme``, as ``runtime`` behaves."""
    data, in_q, out_q = one_op_file(op, scheme)
    reference, arity = _OPS[op][0], _OPS[op][1]
    rng = np.random.default_rng(0)
    inputs = [rng.uniform(-1.9, 1.9, (2, 8)).astype(F32) for _ in range(arity)]
    try:
        with open_session(data, runtime) as session:
            (actual,) = session.run(inputs)
    except Exception:
        return REFUSED
    if reference is None:
        return RUNS
    expected = reference(*(_dequantized(x, in_q, scheme) for x in inputs))
    expected = _dequantized(expected, out_q, scheme)
    steps = np.max(np.abs(actual - expected)) / out_q.scale[0]
    return RUNS if steps <= 2.01 else WRONG  # the validation tolerance: 2 steps


MEASURED = [
    ("ADD", "uint8"),
    ("SUB", "uint8"),
    ("MUL", "uint8"),
    ("LOGISTIC", "uint8"),
    ("TANH", "uint8"),
    ("RELU", "uint8"),
    ("RELU6", "uint8"),
    ("GELU", "uint8"),
    ("MAXIMUM", "uint8"),
    ("MAXIMUM requantizing", "uint8"),
    ("RELU requantizing", "uint8"),
    ("RELU", "int8"),
    ("LOGISTIC", "int8"),
    ("ADD", "int16"),
    ("MUL", "int16"),
]


@needs_onert
@pytest.mark.parametrize("op, scheme", MEASURED)
def test_onert_quantized_kernels_behave_as_the_table_says(op, scheme):
    assert kernel(op, scheme) is not None, "measured entries must be in the table"
    assert measure(op, scheme) == kernel(op, scheme)


LITERT_MEASURED = [
    (op, "int16")
    for op in ("ADD", "SUB", "MUL", "MAXIMUM", "MAXIMUM requantizing", "RELU", "RELU6")
] + [("LOGISTIC", "int16"), ("TANH", "int16")]


@needs_litert
@pytest.mark.parametrize("op, scheme", LITERT_MEASURED)
def test_litert_int16_kernels_behave_as_the_table_says(op, scheme):
    assert kernel(op, scheme, "litert") is not None, "measured entries must be in the table"
    assert measure(op, scheme, "litert") == kernel(op, scheme, "litert")


def test_builder_writes_quantization_parameters():
    g = CircleGraph()
    x = g.add_tensor("x", (1, 4), F32)
    q = g.add_tensor("q", (1, 4), np.uint8, quantization=Quantization((0.25,), (128,)))
    w = g.add_tensor(
        "w",
        (3, 4),
        np.int8,
        np.ones((3, 4), np.int8),
        quantization=Quantization((0.5, 0.25, 0.125), (0, 0, 0), axis=0),
    )
    g.add_op("QUANTIZE", [x], [q])
    g.inputs, g.outputs = [x], [q]
    g.input_names, g.output_names = ["x"], ["output_0"]
    g.add_op("RESHAPE", [w], [g.add_tensor("dead", (12,), np.int8)])  # keeps w in the file
    tensors = ModelT.InitFromObj(Model.GetRootAsModel(build(g), 0)).subgraphs[0].tensors
    by_name = {t.name.decode(): t for t in tensors}
    assert list(by_name["q"].quantization.scale) == [0.25]
    assert list(by_name["q"].quantization.zeroPoint) == [128]
    assert list(by_name["w"].quantization.scale) == [0.5, 0.25, 0.125]
    assert by_name["w"].quantization.quantizedDimension == 0
    assert by_name["x"].quantization is None
    assert "q(scale=0.25, zp=128)" in g.format()


def test_unknown_scheme_is_an_error():
    with pytest.raises(ValueError, match="unknown scheme 'uint4'"):
        kernel("ADD", "uint4")
