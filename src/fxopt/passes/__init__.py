"""Passes and the machinery that runs them.

>>> from fxopt.passes import Pass, PassResult, PassManager, available
>>> "cse" in available()
True
"""

from fxopt.passes.base import Pass, PassResult, Plan, Skip
from fxopt.passes.manager import PassManager, PassRecord, PipelineResult
from fxopt.passes.registry import PASSES, available, resolve
from fxopt.passes.rewrite import Rewrite

__all__ = [
    "PASSES",
    "Pass",
    "PassManager",
    "PassRecord",
    "PassResult",
    "PipelineResult",
    "Plan",
    "Rewrite",
    "Skip",
    "available",
    "resolve",
]
