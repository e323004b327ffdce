"""Deep copies of modules: fxopt never rewrites an object the caller still holds."""

from __future__ import annotations

import copy
import warnings

from torch import nn


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy, silencing the pytree deprecation warning that copying the codegen of
    ``torch.export``'s GraphModules triggers (torch 2.13)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module)
