"""fxopt: a graph optimizer for PyTorch whose every rewrite is verified.

>>> import torch, fxopt
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=0).report["verified"]
True
"""

from fxopt.api import GraphOptimizer, OptimizeResult, optimize
from fxopt.capture import trace
from fxopt.errors import (
    CaptureError,
    FxoptError,
    InputMismatchError,
    InvariantError,
    PassError,
    UnknownPassError,
    UnsupportedOpError,
    UserInputError,
    VerificationError,
)

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "FxoptError",
    "GraphOptimizer",
    "InputMismatchError",
    "InvariantError",
    "OptimizeResult",
    "PassError",
    "UnknownPassError",
    "UnsupportedOpError",
    "UserInputError",
    "VerificationError",
    "__version__",
    "optimize",
    "trace",
]
