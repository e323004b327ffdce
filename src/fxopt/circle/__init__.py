"""Convert PyTorch models to Circle (the ONE NPU format) through fxopt's passes, and check
them in onert, the ONE runtime.

    >>> import torch
    >>> from fxopt import circle
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
    >>> cm = circle.convert(model.eval(), (torch.randn(1, 3, 8, 8),))
    >>> cm.op_counts                 # ReLU fused into the conv; NHWC only at the boundary
    {'TRANSPOSE': 2, 'CONV_2D': 1}

See ``docs/circle.md`` for the pipeline, the layout strategy and the supported ops.
"""

from fxopt._lazy import exports
from fxopt.circle.config import CircleConfig, load_config
from fxopt.circle.errors import (
    CircleValidationError,
    ConfigError,
    DynamicShapeError,
    NotValidatedWarning,
    TrainingModeError,
    Unsupported,
    UnsupportedOpsError,
)

# The converter imports torch: imported on first use, so the CLI parses without it.
__getattr__, __dir__ = exports(
    __name__,
    {
        "convert": "fxopt.circle.converter",
        "convert_from_exported_program": "fxopt.circle.converter",
        "convert_from_pt2": "fxopt.circle.converter",
        "supported_ops": "fxopt.circle.lower",
        "CircleModel": "fxopt.circle.model",
        "Validation": "fxopt.circle.validation",
        "validate": "fxopt.circle.validation",
    },
)

__all__ = [
    "CircleConfig",
    "CircleModel",
    "CircleValidationError",
    "ConfigError",
    "DynamicShapeError",
    "NotValidatedWarning",
    "TrainingModeError",
    "Unsupported",
    "UnsupportedOpsError",
    "Validation",
    "convert",
    "convert_from_exported_program",
    "convert_from_pt2",
    "load_config",
    "supported_ops",
    "validate",
]
