"""Remat: fit training into less memory by recomputing activations in the backward.

    capture (joint fwd+bwd graph) → profile (cost table) → plan (budget) → rewrite → run

See docs/remat.md. Entry points: :func:`compile_step` (one compiled training iteration)
and :func:`backend` (for ``torch.compile``).
"""

from fxopt.remat.compile_backend import COMPILERS, backend
from fxopt.remat.planners import PLANNERS, BudgetError, Plan, plan
from fxopt.remat.runtime import Step, compile_step, sum_of_outputs

__all__ = [
    "COMPILERS",
    "PLANNERS",
    "BudgetError",
    "Plan",
    "Step",
    "backend",
    "compile_step",
    "plan",
    "sum_of_outputs",
]
