"""Parity of a Circle model in onert against PyTorch: count, shape, dtype and values.

Never validates against an interpreter that shares the converter's lowering code: the
reference is the torch model itself, the runtime is onert.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxopt.circle.model import CircleModel

#: Circle operators the onert 0.1.0 cpu backend cannot run (measured; see docs/circle.md).
ONERT_MISSING = ("CUMSUM", "GATHER_ND", "TRANSPOSE_CONV", "RESIZE_NEAREST_NEIGHBOR")


@dataclass
class Validation:
    validated: bool
    max_abs_error: float | None
    message: str

    def to_dict(self) -> dict:
        return {
            "validated": self.validated,
            "max_abs_error": self.max_abs_error,
            "message": self.message,
        }


def validate(
    circle: CircleModel,
    inputs: Sequence,
    expected: Sequence,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-4,
) -> Validation:
    """Run ``circle`` in onert on ``inputs`` and compare with the torch ``expected`` outputs."""
    missing = sorted({op for op in circle.operators if op in ONERT_MISSING})
    if missing:
        return Validation(
            False, None, f"converted, not validated: onert cannot run {', '.join(missing)}"
        )
    if circle.report.get("external_buffers"):
        # Measured: onert 0.1.0 segfaults on Buffer.offset/size (the >2 GiB form).
        return Validation(
            False, None, "converted, not validated: onert 0.1.0 cannot read external buffers"
        )
    from fxopt.circle.runtime import onert_available

    if not onert_available():
        return Validation(False, None, "converted, not validated: onert is not installed")
    try:
        actual = circle.run(*inputs)
    except Exception as error:  # load or run failure: a finding, reported, not raised
        return Validation(False, None, f"onert failed to run the model: {error}")
    expected = [e.detach().cpu().numpy() for e in expected]
    if len(actual) != len(expected):
        return Validation(
            False, None, f"onert returned {len(actual)} outputs, torch {len(expected)}"
        )
    worst = 0.0
    for i, (a, e) in enumerate(zip(actual, expected)):
        if tuple(a.shape) != tuple(e.shape):
            return Validation(False, None, f"output {i}: shape {a.shape} vs torch {e.shape}")
        if a.dtype != e.dtype:
            return Validation(False, None, f"output {i}: dtype {a.dtype} vs torch {e.dtype}")
        if e.dtype.kind in "biu":
            if not np.array_equal(a, e):
                return Validation(False, None, f"output {i}: integer values differ")
            continue
        error = float(np.max(np.abs(a.astype(np.float64) - e))) if e.size else 0.0
        worst = max(worst, error)
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            return Validation(
                False, worst, f"output {i}: max abs error {error:.3g} over rtol={rtol}, atol={atol}"
            )
    return Validation(True, worst, "outputs match")
