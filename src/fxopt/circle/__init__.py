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

from fxopt.circle.config import CircleConfig, load_config
from fxopt.circle.convert import convert, convert_from_exported_program, convert_from_pt2
from fxopt.circle.errors import (
    CircleValidationError,
    ConfigError,
    DynamicShapeError,
    NotValidatedWarning,
    TrainingModeError,
    Unsupported,
    UnsupportedOpsError,
)
from fxopt.circle.lower import supported_ops
from fxopt.circle.model import CircleModel
from fxopt.circle.validate import Validation, validate

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
