"""What onert 0.1.0 (the PyPI wheel, cpu backend) does with quantized operators, as data.

The quantized lowering (issue 16) consults this table instead of guessing: an operator the
runtime refuses in a scheme is kept in float between DEQUANTIZE and QUANTIZE, or rewritten
(ReLU fused into its producer, per-channel FULLY_CONNECTED as a 1×1 CONV_2D), and a file is
"validated" only by running it. Entries come from one-operator files run in onert
(float in → QUANTIZE → OP → DEQUANTIZE → float out); ``tests/test_circle_quantized.py``
re-measures every entry it can build and fails when onert's behaviour and the table part.

    >>> kernel("ADD", "uint8"), kernel("RELU", "uint8"), kernel("ADD", "int16")
    ('runs', 'refused', 'refused')
"""

from __future__ import annotations

RUNS = "runs"
REFUSED = "refused"  # load, prepare or run fails
WRONG = "wrong"  # runs, and its outputs are off by more than one quantization step

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
    ("CONV_2D", "uint8"): RUNS,
    ("DEPTHWISE_CONV_2D", "uint8"): RUNS,
    ("FULLY_CONNECTED", "uint8"): RUNS,           # per-tensor weights; see below
    ("FULLY_CONNECTED per-channel", "uint8"): WRONG,  # up to 103 LSB off
    ("QUANTIZE", "uint8"): RUNS,
    ("DEQUANTIZE", "uint8"): RUNS,
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
# fmt: on


def kernel(op: str, scheme: str) -> str | None:
    """What onert 0.1.0 does with ``op`` quantized in ``scheme`` (None: not measured)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    return ONERT_QUANTIZED.get((op, scheme))


def runs(op: str, scheme: str) -> bool:
    """True only for an operator measured to run correctly in ``scheme``."""
    return kernel(op, scheme) == RUNS
