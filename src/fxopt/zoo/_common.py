"""Helpers shared by the zoo's model families: option checks and weight initialization."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fxopt.errors import UserInputError


def check_positive(**values: int | float) -> None:
    """Raise :class:`UserInputError` unless every keyword value is > 0."""
    for option, value in values.items():
        if value <= 0:
            raise UserInputError(f"option '{option}' must be > 0, got {value}")


def check_choice(option: str, value: str, choices: Iterable[str]) -> None:
    """Raise :class:`UserInputError` unless ``value`` is one of ``choices``."""
    choices = sorted(choices)
    if value not in choices:
        raise UserInputError(
            f"option '{option}' must be one of {', '.join(choices)}, got '{value}'"
        )


@torch.no_grad()
def randomize_batchnorm(model: nn.Module) -> None:
    """Give every BatchNorm random affine parameters and running statistics.

    Fresh BatchNorm layers are the identity in eval mode (mean 0, var 1, weight 1, bias 0),
    so BN folding would be tested on a no-op; random statistics make it count. The ranges
    stay near the identity so that deep residual stacks keep activations O(1).
    """
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 1.5)  # strictly positive
            if module.affine:
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0.0, 0.1)


def transformer_config(
    configs: Mapping[str, Any], config: str, *, batch: int, seq: int, layers: int
) -> Any:
    """The named config, with ``layers`` > 0 overriding its depth; checks batch and seq."""
    check_choice("config", config, configs)
    check_positive(batch=batch, seq=seq)
    cfg = configs[config]
    if layers < 0:
        raise UserInputError(f"option 'layers' must be >= 0 (0: the config's), got {layers}")
    if layers:
        cfg = replace(cfg, layers=layers)
    if seq > cfg.max_positions:
        raise UserInputError(
            f"option 'seq' must be <= {cfg.max_positions} for config '{config}', got {seq}"
        )
    return cfg


def init_transformer_weights(module: nn.Module) -> None:
    """BERT/GPT-2's N(0, 0.02) init (PyTorch's defaults give far larger activations);
    use as ``model.apply(init_transformer_weights)``."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
