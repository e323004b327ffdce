"""Post-training quantization for Circle: a float model → a PT2E quantized graph that
:func:`fxopt.circle.convert` turns into an integer file onert runs.

The machinery is torchao's (the ``quant`` extra): ``prepare_pt2e`` inserts its observers,
calibration runs the model, ``convert_pt2e`` writes ``quantize``/``dequantize`` nodes. What
is fxopt's own is :class:`~fxopt.quant.quantizer.CircleQuantizer`, the annotation: which
values get which quantization, chosen for the kernels onert 0.1.0 runs (a ReLU / ReLU6
after a conv, linear or add is annotated with it, so it fuses into the integer kernel;
pools, reshapes and concatenations share their input's parameters, as their uint8
kernels demand; sigmoid and softmax get the fixed 1/256 output range). XNNPACK's quantizer
(torchao's test copy, deprecated) quantizes a ReLU6 on its own, which onert cannot run.

    >>> import torch
    >>> from fxopt.quant import quantize
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> quantized = quantize(model, (torch.randn(1, 3, 8, 8),), calibration=4)
    >>> from fxopt.circle import convert
    >>> convert(quantized, (torch.randn(1, 3, 8, 8),)).report["quantization"]["quantized_ops"]
    {'TRANSPOSE': 2, 'CONV_2D': 1}
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import fx, nn

from fxopt.errors import UserInputError

#: Quantization schemes :func:`quantize` writes.
SCHEMES = ("uint8",)
#: Activation observers: min-max, or a histogram that minimizes the quantization error.
OBSERVERS = ("minmax", "histogram")


def quantize(
    model: nn.Module,
    example_inputs: object,
    *,
    calibration: int | Iterable = 16,
    scheme: str = "uint8",
    observer: str = "minmax",
) -> fx.GraphModule:
    """``model`` (in eval mode) quantized after training: exported, annotated by
    :class:`~fxopt.quant.quantizer.CircleQuantizer`, calibrated, converted (PT2E).

    ``calibration`` is an iterable of inputs (a tuple of tensors, or one tensor, per
    batch) or a number of batches drawn like the example (each float entry redrawn with
    the example's mean and spread; ids and masks kept). ``scheme`` ``uint8``: asymmetric
    8-bit activations, symmetric per-channel 8-bit weights (written as uint8 in the file).
    The user's model is not changed.
    """
    from fxopt.capture import as_input_tuple
    from fxopt.circle.convert import other_values
    from fxopt.circle.export import buffers_restored, preflight

    if scheme not in SCHEMES:
        raise UserInputError(
            f"unknown quantization scheme {scheme!r}; fxopt.quant writes {', '.join(SCHEMES)} "
            "(int16 is not written yet)"
        )
    if observer not in OBSERVERS:
        raise UserInputError(f"unknown observer {observer!r}; expected one of {OBSERVERS}")
    quantize_pt2e = _torchao()
    from fxopt.quant.quantizer import CircleQuantizer

    args = as_input_tuple(example_inputs)
    with buffers_restored(model):
        preflight(model, args)
        exported = torch.export.export(model, args)
    prepared = quantize_pt2e.prepare_pt2e(exported.module(), CircleQuantizer(scheme, observer))
    batches = (
        [other_values(args, seed) for seed in range(1, int(calibration) + 1)]
        if isinstance(calibration, int)
        else calibration
    )
    count = 0
    with torch.no_grad():
        for batch in batches:
            prepared(*as_input_tuple(batch))
            count += 1
    if count == 0:
        raise UserInputError("calibration gave no batches: pass a number or a non-empty iterable")
    return quantize_pt2e.convert_pt2e(prepared)


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10·log10(Σ ref² / Σ (ref − approx)²)``
    (inf when they are equal).

    >>> round(sqnr_db(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1])), 2)
    26.99
    """
    reference = reference.detach().double()
    noise = (reference - approximation.detach().double()).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def _torchao():
    try:
        from torchao.quantization.pt2e import quantize_pt2e
    except ImportError as error:
        raise UserInputError(
            "quantization needs torchao (PT2E): pip install 'fxopt[quant]'"
        ) from error
    return quantize_pt2e


__all__ = ["OBSERVERS", "SCHEMES", "quantize", "sqnr_db"]
