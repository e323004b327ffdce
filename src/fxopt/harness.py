"""Seed 003's pass harness: one pass on a captured model, checked four ways.

It sits above capture, the passes and :mod:`fxopt.verify` (whose comparison primitives
capture itself uses), so none of those imports it.
"""

from __future__ import annotations

from torch import nn

from fxopt.capture import as_input_tuple, trace
from fxopt.passes import PassManager, resolve
from fxopt.verify import (
    CheckResult,
    check_gradients,
    check_lint,
    check_outputs,
    check_parameters,
)


def verify_pass(
    model: nn.Module,
    pass_,
    example_inputs,
    *,
    mode: str = "fx",
    samples: int = 4,
    gradients: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
) -> dict:
    """Seed 003's harness: run one pass and report numerical, gradient, lint and params.

    >>> import torch
    >>> from fxopt.harness import verify_pass
    >>> report = verify_pass(torch.nn.Linear(3, 2), "cse", torch.randn(4, 3))
    >>> report["numerical"], report["gradient"], report["lint"], report["params"]
    (True, True, True, True)
    """
    inputs = as_input_tuple(example_inputs)
    pass_ = resolve(pass_)
    before = trace(model, inputs, mode)
    after = PassManager([pass_]).run(before).module
    checks = {
        "numerical": check_outputs(model, after, inputs, random_sets=samples, rtol=rtol, atol=atol),
        "gradient": check_gradients(model, after, inputs, rtol=rtol, atol=atol)
        if gradients
        else CheckResult(True, message="skipped"),
        "lint": check_lint(after),
        "params": check_parameters(before, after, allow_new=pass_.adds_parameters),
    }
    report: dict = {name: result.ok for name, result in checks.items()}
    report["details"] = {
        name: {"max_abs_error": r.max_abs_error, "message": r.message} for name, r in checks.items()
    }
    report["module"] = after
    return report
