"""fxopt: a graph optimizer for PyTorch whose every rewrite is verified.

>>> import torch, fxopt
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=0).report["verified"]
True
"""

from fxopt._lazy import exports
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

# The optimizer API imports torch (seconds); the errors and the CLI's argument parsing do
# not need it, so it is imported on first use (fxopt._lazy): `fxopt --help` stays fast.
__getattr__, __dir__ = exports(
    __name__,
    {
        "GraphOptimizer": "fxopt.api",
        "OptimizeResult": "fxopt.api",
        "optimize": "fxopt.api",
        "trace": "fxopt.capture",
    },
)

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
