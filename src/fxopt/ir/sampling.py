"""Inputs drawn like an example: what verification, the input contract and the converter's
validation feed a model besides its example. A leaf module: torch only.

    >>> import torch
    >>> ids = torch.tensor([[3, 7, 5]])
    >>> (drawn,) = random_inputs_like((ids,), 1)[0]
    >>> drawn.dtype, bool(drawn.min() >= 3 and drawn.max() <= 7)
    (torch.int64, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def random_inputs_like(example_inputs: Sequence, count: int, seed: int = 0) -> list[tuple]:
    """``count`` input tuples with the shapes, dtypes and devices of ``example_inputs``.

    Integer inputs (token ids, indices) stay within the example's value range, so an
    embedding lookup stays in bounds.
    """
    generator = torch.Generator().manual_seed(seed)
    return [
        tuple(
            random_like(x, list(x.shape), generator) if isinstance(x, torch.Tensor) else x
            for x in example_inputs
        )
        for _ in range(count)
    ]


def random_like(example: torch.Tensor, shape: Sequence[int], generator) -> torch.Tensor:
    """A random tensor of ``shape`` with ``example``'s dtype, device and value range
    (integers within the example's min..max, so indices stay valid)."""
    if example.dtype == torch.bool:
        value = torch.randint(0, 2, shape, generator=generator).bool()
    elif example.is_floating_point() or example.is_complex():
        value = torch.randn(shape, generator=generator, dtype=torch.float64)
    else:
        low = int(example.min()) if example.numel() else 0
        high = int(example.max()) + 1 if example.numel() else 1
        value = torch.randint(low, max(high, low + 1), shape, generator=generator)
    return value.to(dtype=example.dtype, device=example.device)


def other_values(inputs: Sequence, seed: int = 0) -> list:
    """``inputs`` with other values where that keeps them meaningful: the finite entries of
    each float tensor redrawn with the same mean and spread (infinities, as in additive
    masks, stay); integer and bool tensors (ids, indices, masks) and non-tensors kept. A
    list or tuple argument (``torch.cat``'s tensors) has its tensors redrawn the same way.
    A value a conversion baked in by mistake shows here."""
    generator = torch.Generator().manual_seed(seed)

    def redraw(value):
        if type(value) in (list, tuple):
            return type(value)(redraw(item) for item in value)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            finite = torch.isfinite(value)  # -inf in a mask stays: it means "masked"
            values = value[finite]
            spread = float(values.std()) if values.numel() > 1 else 0.0
            spread = spread if spread > 0 else 1.0
            mean = float(values.mean()) if values.numel() else 0.0
            noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            value = torch.where(finite, noise.to(value.device) * spread + mean, value)
        return value

    return [redraw(value) for value in inputs]
