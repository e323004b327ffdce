"""Remat: fit training into less memory by recomputing activations in the backward.

    capture (joint fwd+bwd graph) → profile (cost table) → plan (budget) → rewrite → run

See docs/remat.md. Entry points: :func:`compile_step` (one compiled training iteration),
:func:`backend` (for ``torch.compile``) and :func:`compile_blocks` (per block, e.g. under
FSDP2).
"""

from fxopt._lazy import exports

# Imported on first use: importing the package, or a light module of it (plans, planners),
# imports no torch.
__getattr__, __dir__ = exports(
    __name__,
    {
        "COMPILERS": "fxopt.remat.compile_backend",
        "backend": "fxopt.remat.compile_backend",
        "compile_blocks": "fxopt.remat.blocks",
        "CompiledBlocks": "fxopt.remat.blocks",
        "PLANNERS": "fxopt.remat.planners",
        "BudgetError": "fxopt.remat.planners",
        "RematPlan": "fxopt.remat.planners",
        "Offload": "fxopt.remat.planners",
        "plan": "fxopt.remat.planners",
        "Step": "fxopt.remat.runtime",
        "compile_step": "fxopt.remat.runtime",
        "sum_of_outputs": "fxopt.remat.runtime",
    },
)

__all__ = [
    "COMPILERS",
    "PLANNERS",
    "BudgetError",
    "CompiledBlocks",
    "Offload",
    "RematPlan",
    "Step",
    "backend",
    "compile_blocks",
    "compile_step",
    "plan",
    "sum_of_outputs",
]
