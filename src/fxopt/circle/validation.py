"""Parity of a Circle model in a runtime against PyTorch: count, shape, dtype and values.

Never validates against an interpreter that shares the converter's lowering code: the
reference is the torch model itself; the runtime is onert (the ONE runtime, the file's
target) or, for the operators onert 0.1.0 has no kernel for, LiteRT's reference kernels
(:class:`~fxopt.circle.runtime.LiteRTSession`). Each :class:`Validation` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxopt.circle import onert_quantized
from fxopt.circle.model import CircleModel

#: Circle operators the onert 0.1.0 cpu backend cannot run (measured; see docs/circle.md).
ONERT_MISSING = (
    "CONV_3D",
    "CUMSUM",
    "GATHER_ND",
    "RESIZE_NEAREST_NEIGHBOR",
    "TOPK_V2",
    "TRANSPOSE_CONV",
)

#: The runtimes :func:`validate` can use, in the order it prefers them.
RUNTIMES = ("onert", "litert")


@dataclass
class Validation:
    """The outcome of running a Circle file and comparing it with PyTorch.

    ``validated`` is True when every output matched; ``max_abs_error`` is None when no
    values were compared (no runtime could run the file, or it failed to).
    """

    validated: bool
    max_abs_error: float | None
    message: str
    runtime: str | None = None

    @property
    def mismatch(self) -> bool:
        """The runtime ran the file and its outputs differ from PyTorch's."""
        return not self.validated and self.max_abs_error is not None

    @property
    def failed(self) -> bool:
        """The file ran and differed, or the runtime chosen for it could not run it: in
        either case the file is wrong for its user (unlike "no runtime available")."""
        return not self.validated and self.runtime is not None

    def to_dict(self) -> dict:
        return {
            "validated": self.validated,
            "max_abs_error": self.max_abs_error,
            "message": self.message,
            "runtime": self.runtime,
        }


def choose_runtime(circle: CircleModel) -> tuple[str | None, str]:
    """(the runtime that can run ``circle``, or None; why that one / why none)."""
    from fxopt.circle.runtime import litert_available, onert_available

    if circle.report.get("external_buffers"):
        # Measured: onert 0.1.0 segfaults on Buffer.offset/size (the >2 GiB form); LiteRT
        # reads them (its twin file, written beside the Circle file: converter).
        why = "onert 0.1.0 cannot read offset buffers (a file over 2 GiB)"
        if circle.litert is not None and litert_available():
            return "litert", why
        return None, why
    missing = sorted({op for op in circle.operators if op in ONERT_MISSING})
    missing += _missing_integer_kernels(circle)
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        shown = ", ".join(missing[:4]) + more
        why = f"onert cannot run {shown}"
        if litert_available():
            return "litert", why
        return None, f"{why}, and LiteRT (ai-edge-litert) is not installed"
    if onert_available():
        return "onert", "the ONE runtime"
    if litert_available():
        return "litert", "onert is not installed"
    return None, "neither onert nor LiteRT is installed"


def _missing_integer_kernels(circle: CircleModel) -> list[str]:
    """The "OP type" integer kernels of ``circle`` onert is not measured to run."""
    found = (circle.report.get("quantization") or {}).get("integer_kernels", ())
    missing = []
    for kernel in found:
        op, dtype = kernel.split()
        if dtype not in onert_quantized.SCHEMES or not onert_quantized.runs(op, dtype, "onert"):
            missing.append(f"{dtype} {op}")
    return missing


def validate(
    circle: CircleModel,
    inputs: Sequence,
    expected: Sequence,
    *,
    rtol: float = 1e-4,
    atol: float | Sequence[float] = 1e-4,
    runtime: str | None = None,
) -> Validation:
    """Run ``circle`` on ``inputs`` and compare with the torch ``expected`` outputs.

    ``runtime`` is one of :data:`RUNTIMES`, or None to let :func:`choose_runtime` pick
    onert, or LiteRT where onert has no kernel. Non-tensor inputs (baked into the file at
    conversion) are skipped. ``atol`` may be one tolerance per output (a quantized output
    is compared to within a few of its quantization steps).
    """
    from fxopt.circle.runtime import open_session

    if runtime is None:
        runtime, why = choose_runtime(circle)
        if runtime is None:
            return Validation(False, None, f"converted, not validated: {why}")
    elif runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
    tensors = runtime_inputs(inputs)
    try:
        with open_session(circle.file, runtime, litert_file=circle.litert) as session:
            actual = session.run(tensors)
    except Exception as error:  # load or run failure: a finding, reported, not raised
        return Validation(False, None, f"{runtime} failed to run the model: {error}", runtime)
    result = compare(actual, [e.detach().cpu().numpy() for e in expected], rtol=rtol, atol=atol)
    result.runtime = runtime
    if result.validated:
        result.message = f"outputs match in {runtime}"
    return result


def runtime_inputs(values: Sequence) -> list:
    """The tensors a file takes, in its input order: a list, tuple or dict argument
    (``torch.cat``'s tensors) flattened as torch.export flattens it; non-tensors, baked
    into the file at conversion, skipped."""
    import torch
    from torch.utils import _pytree as pytree

    return [x for x in pytree.tree_leaves(list(values)) if isinstance(x, torch.Tensor)]


def compare(
    actual: Sequence[np.ndarray],
    expected: Sequence[np.ndarray],
    *,
    rtol: float,
    atol: float | Sequence[float],
) -> Validation:
    """Outputs of the file against PyTorch's: count, then per output shape, dtype, values
    (``atol`` one for all outputs, or one per output). NaN where PyTorch has NaN is a
    match (``log`` of a negative input), as are equal infinities; NaN on one side only
    is an error of inf."""
    if len(actual) != len(expected):
        return Validation(
            False, None, f"the file returned {len(actual)} outputs, torch {len(expected)}"
        )
    worst = 0.0
    tolerances = [atol] * len(expected) if isinstance(atol, (int, float)) else list(atol)
    for i, (a, e, atol) in enumerate(zip(actual, expected, tolerances)):
        if tuple(a.shape) != tuple(e.shape):
            return Validation(False, None, f"output {i}: shape {a.shape} vs torch {e.shape}")
        if a.dtype != e.dtype:
            return Validation(False, None, f"output {i}: dtype {a.dtype} vs torch {e.dtype}")
        if e.dtype.kind in "biu":
            if not np.array_equal(a, e):
                wrong = int(np.count_nonzero(a != e))
                return Validation(False, float("inf"), f"output {i}: {wrong} integer values differ")
            continue
        error = _max_error(a, e)
        worst = max(worst, error)
        if not np.allclose(a, e, rtol=rtol, atol=atol, equal_nan=True):
            return Validation(
                False,
                worst,
                f"output {i}: max abs error {error:.3g} over rtol={rtol}, atol={atol:.3g}",
            )
    return Validation(True, worst, "outputs match")


def _max_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """The largest absolute difference; 0 where both are the same NaN or infinity, inf
    where only one side is NaN."""
    if not expected.size:
        return 0.0
    same = (actual == expected) | (np.isnan(actual) & np.isnan(expected))
    with np.errstate(invalid="ignore"):
        diff = np.abs(actual.astype(np.float64) - expected)
    diff = np.nan_to_num(np.where(same, 0.0, diff), nan=np.inf, posinf=np.inf)
    return float(diff.max())
