"""What onert 0.1.0 (the PyPI wheel, cpu backend) and LiteRT 2.3 (reference kernels) do
with quantized operators, as data.

The quantized lowering (issue 16) consults these tables instead of guessing: an operator
the runtime refuses in a scheme is kept in float between DEQUANTIZE and QUANTIZE, or
rewritten (ReLU fused into its producer, per-channel FULLY_CONNECTED as a 1×1 CONV_2D),
and a file is "validated" only by running it. Each scheme has a target runtime
(:func:`target`): onert for uint8 and int8; LiteRT for int16, which onert 0.1.0 does not
run at all (int16 files are for NPU toolchains; LiteRT is the runtime that checks them).
Entries come from one-operator files (float in → QUANTIZE → OP → DEQUANTIZE → float out);
``tests/test_circle_quantized.py`` re-measures every entry it can build and fails when a
runtime's behaviour and its table part.

    >>> kernel("ADD", "uint8"), kernel("RELU", "uint8"), kernel("ADD", "int16")
    ('runs', 'refused', 'refused')
    >>> target("int16"), runs("ADD", "int16")  # LiteRT's int16 ADD (general scales)
    ('litert', True)
"""

from __future__ import annotations

RUNS = "runs"
REFUSED = "refused"  # load, prepare or run fails
# runs, and its outputs are off by more than two quantization steps (the tolerance the
# converter validates quantized outputs within; LiteRT's int16 TANH table is 1.5 off)
WRONG = "wrong"

#: The integer types of the schemes the converter writes.
SCHEMES = ("uint8", "int8", "int16")

# fmt: off
#: (Circle operator, scheme) → RUNS / REFUSED / WRONG. Operators not listed for a scheme are
#: unknown: treat them as not runnable until measured.
ONERT_QUANTIZED: dict[tuple[str, str], str] = {
    # uint8: the scheme onert runs best.
    ("ADD", "uint8"): RUNS,
    ("SUB", "uint8"): RUNS,
    ("MUL", "uint8"): RUNS,
    ("LOGISTIC", "uint8"): RUNS,
    ("TANH", "uint8"): RUNS,
    ("SOFTMAX", "uint8"): RUNS,
    ("RESHAPE", "uint8"): RUNS,
    ("TRANSPOSE", "uint8"): RUNS,
    ("CONCATENATION", "uint8"): RUNS,
    ("MAX_POOL_2D", "uint8"): RUNS,
    ("AVERAGE_POOL_2D", "uint8"): RUNS,
    ("MEAN", "uint8"): RUNS,
    ("PAD", "uint8"): RUNS,
    ("PADV2", "uint8"): RUNS,                     # a uint8 constant value
    ("CONV_2D", "uint8"): RUNS,
    ("DEPTHWISE_CONV_2D", "uint8"): RUNS,
    ("FULLY_CONNECTED", "uint8"): RUNS,           # per-tensor weights; see below
    ("FULLY_CONNECTED per-channel", "uint8"): WRONG,  # up to 103 LSB off
    ("QUANTIZE", "uint8"): RUNS,
    ("DEQUANTIZE", "uint8"): RUNS,
    ("GATHER", "uint8"): RUNS,                    # a uint8 table, int32/int64 indices
    ("RELU", "uint8"): REFUSED,                   # fused into the producer instead
    ("RELU6", "uint8"): REFUSED,
    ("GELU", "uint8"): REFUSED,
    ("HARD_SWISH", "uint8"): REFUSED,
    ("MAXIMUM", "uint8"): RUNS,                   # input and output parameters equal
    ("MAXIMUM requantizing", "uint8"): REFUSED,   # output parameters differ
    ("RELU requantizing", "uint8"): REFUSED,
    ("BATCH_MATMUL", "uint8"): REFUSED,
    # int8: partial; QUANTIZE float → int8 clamps negatives to 0.
    ("QUANTIZE", "int8"): WRONG,
    ("FULLY_CONNECTED", "int8"): REFUSED,
    ("LOGISTIC", "int8"): REFUSED,
    ("TANH", "int8"): REFUSED,
    ("RELU", "int8"): REFUSED,
    # int16: nothing runs (and the Python binding cannot feed int16 inputs).
    ("ADD", "int16"): REFUSED,
    ("MUL", "int16"): REFUSED,
    ("FULLY_CONNECTED", "int16"): REFUSED,
}

#: (Circle operator, scheme) → RUNS / REFUSED / WRONG in LiteRT 2.3's reference kernels:
#: int16 activations with int8 weights ("16x8") and int64 biases. ADD and SUB run with
#: ``pot_scale_int16`` off (the general kernel; on, they demand power-of-two scales).
LITERT_QUANTIZED: dict[tuple[str, str], str] = {
    ("ADD", "int16"): RUNS,
    ("SUB", "int16"): RUNS,
    ("MUL", "int16"): RUNS,
    ("MAXIMUM", "int16"): RUNS,
    ("MAXIMUM requantizing", "int16"): WRONG,
    ("RELU", "int16"): RUNS,
    ("RELU6", "int16"): RUNS,
    ("LOGISTIC", "int16"): RUNS,                  # output scale 1/32768
    ("TANH", "int16"): RUNS,                      # output scale 1/32768
    ("SOFTMAX", "int16"): RUNS,                   # output scale 1/32768
    # From here: measured on whole files (tests/test_quant.py, int16 models in LiteRT).
    ("CONV_2D", "int16"): RUNS,
    ("DEPTHWISE_CONV_2D", "int16"): RUNS,
    ("FULLY_CONNECTED", "int16"): RUNS,
    ("FULLY_CONNECTED per-channel", "int16"): RUNS,
    ("MAX_POOL_2D", "int16"): RUNS,
    ("AVERAGE_POOL_2D", "int16"): RUNS,
    ("MEAN", "int16"): RUNS,
    ("PAD", "int16"): RUNS,
    ("PADV2", "int16"): RUNS,
    ("RESHAPE", "int16"): RUNS,
    ("TRANSPOSE", "int16"): RUNS,
    ("CONCATENATION", "int16"): RUNS,
    ("GATHER", "int16"): RUNS,
    ("QUANTIZE", "int16"): RUNS,
    ("DEQUANTIZE", "int16"): RUNS,
}
# fmt: on

#: Runtime → its table.
TABLES = {"onert": ONERT_QUANTIZED, "litert": LITERT_QUANTIZED}


def target(scheme: str) -> str:
    """The runtime a ``scheme`` file is made for and validated in."""
    _check(scheme)
    return "litert" if scheme == "int16" else "onert"


def kernel(op: str, scheme: str, runtime: str = "onert") -> str | None:
    """What ``runtime`` does with ``op`` quantized in ``scheme`` (None: not measured)."""
    _check(scheme)
    return TABLES[runtime].get((op, scheme))


def runs(op: str, scheme: str, runtime: str | None = None) -> bool:
    """True only for an operator measured to run correctly in ``scheme`` in ``runtime``
    (default: the scheme's :func:`target`)."""
    return kernel(op, scheme, runtime or target(scheme)) == RUNS


def _check(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
