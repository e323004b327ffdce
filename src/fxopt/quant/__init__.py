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

import logging
from collections.abc import Iterable

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from fxopt.errors import UserInputError

#: Quantization schemes :func:`quantize` writes.
SCHEMES = ("uint8", "int16")
#: Activation observers: min-max, or a histogram that minimizes the quantization error.
OBSERVERS = ("minmax", "histogram")
#: Weight granularity: a scale per output channel (accurate), or one per tensor (onert
#: 0.1.0 runs uint8 convolutions with per-tensor weights 7-11x faster: docs/circle.md).
WEIGHTS = ("per_channel", "per_tensor")


def quantize(
    model: nn.Module,
    example_inputs: object,
    *,
    calibration: int | str | Iterable = 16,
    scheme: str = "uint8",
    observer: str = "minmax",
    weights: str = "per_channel",
) -> fx.GraphModule:
    """``model`` (in eval mode) quantized after training: exported, annotated by
    :class:`~fxopt.quant.quantizer.CircleQuantizer`, calibrated, converted (PT2E).

    ``calibration`` is an iterable of inputs (a tuple of tensors, or one tensor, per
    batch), a number of batches drawn like the example (each float entry redrawn with
    the example's mean and spread; ids and masks kept), or ``"file.py:NAME"`` naming such
    an iterable or a function that returns one (real data for real scales).

    ``scheme`` ``uint8``: asymmetric 8-bit activations, symmetric per-channel 8-bit
    weights (written as uint8 in the file; what onert runs). ``int16``: symmetric 16-bit
    activations, the same 8-bit weights ("16x8", what TICO's NPU targets take; onert 0.1.0
    runs none of it, so the converter validates those files in LiteRT). The user's model
    is not changed.

    ``weights``: ``per_channel`` (a scale per output channel, the default: accurate) or
    ``per_tensor`` (one scale per weight: less accurate, notably for depthwise
    convolutions, but onert 0.1.0's uint8 kernels for it are 7-11x faster on CNNs).
    """
    from fxopt.capture import as_input_tuple
    from fxopt.circle.export import buffers_restored, preflight
    from fxopt.ir.sampling import other_values

    if scheme not in SCHEMES:
        raise UserInputError(
            f"unknown quantization scheme {scheme!r}; expected one of {', '.join(SCHEMES)}"
        )
    if observer not in OBSERVERS:
        raise UserInputError(f"unknown observer {observer!r}; expected one of {OBSERVERS}")
    if weights not in WEIGHTS:
        raise UserInputError(f"unknown weight granularity {weights!r}; expected one of {WEIGHTS}")
    quantize_pt2e = _torchao()
    from fxopt.quant.quantizer import CircleQuantizer

    args = as_input_tuple(example_inputs)
    with buffers_restored(model):
        preflight(model, args)
        exported = torch.export.export(model, args)
    prepared = quantize_pt2e.prepare_pt2e(
        exported.module(), CircleQuantizer(scheme, observer, weights)
    )
    if isinstance(calibration, str):
        calibration = calibration_batches(calibration)
    if isinstance(calibration, int):
        if calibration < 1:
            raise UserInputError(f"calibration needs at least 1 batch, got {calibration}")
        calibration = [other_values(args, seed) for seed in range(1, calibration + 1)]
    count = 0
    with torch.no_grad():
        for batch in calibration:
            try:
                prepared(*as_input_tuple(batch))
            except Exception as error:
                raise UserInputError(
                    f"calibration batch {count} does not fit the model: "
                    f"{type(error).__name__}: {error}"
                ) from error
            count += 1
    if count == 0:
        raise UserInputError("calibration gave no batches: pass a number or a non-empty iterable")
    return quantize_pt2e.convert_pt2e(prepared)


def calibration_batches(spec: str) -> Iterable:
    """The calibration iterable ``spec`` (``path/to/file.py:NAME``) names: NAME is an
    iterable of batches, or a function that returns one. A number ("16") is kept as one."""
    from fxopt.models import load_attribute

    if spec.isdigit():
        return int(spec)
    found = load_attribute(spec, "calibration")
    if callable(found):
        try:
            found = found()
        except Exception as error:
            raise UserInputError(f"{spec} raised {type(error).__name__}: {error}") from error
    if not isinstance(found, Iterable) or isinstance(found, (str, torch.Tensor)):
        raise UserInputError(f"{spec} gave {type(found).__name__}, not an iterable of batches")
    return found


def accuracy(reference: nn.Module, outputs_per_batch: list, batches: list) -> dict:
    """How close a quantized file's outputs are to the float ``reference`` model's, over
    ``batches`` (input tuples) and ``outputs_per_batch`` (the file's outputs on each):
    per output, the SQNR in dB, the largest absolute error, and for a classifier's
    logits (a 2-D output with more than one column) the share of rows whose top-1 class
    agrees (None for other outputs).

    >>> model = nn.Linear(4, 3).eval()
    >>> x = torch.randn(8, 4)
    >>> noisy = model(x).detach() + 1e-3
    >>> result = accuracy(model, [[noisy.numpy()]], [(x,)])
    >>> result["top1_agreement"], round(result["max_abs_error"][0], 4)
    ([1.0], 0.001)
    """
    expected, actual = [], []
    with torch.no_grad():
        for batch, outputs in zip(batches, outputs_per_batch):
            # the file's outputs are the model's tensors, flattened (a transformers
            # output object too)
            result = [r for r in tree_leaves(reference(*batch)) if isinstance(r, torch.Tensor)]
            expected.append([r.detach().float() for r in result])
            actual.append([torch.as_tensor(a).float() for a in outputs])
    report = {"sqnr_db": [], "max_abs_error": [], "top1_agreement": []}
    for i in range(len(expected[0])):
        ref = torch.cat([e[i].reshape(-1) for e in expected])
        got = torch.cat([a[i].reshape(-1) for a in actual])
        report["sqnr_db"].append(round(sqnr_db(ref, got), 2))
        report["max_abs_error"].append(float((ref - got).abs().max()))
        logits = [(e[i], a[i]) for e, a in zip(expected, actual)]
        if all(e.ndim == 2 and e.shape[1] > 1 for e, _ in logits):
            agree = sum(int((e.argmax(1) == a.argmax(1)).sum()) for e, a in logits)
            report["top1_agreement"].append(agree / sum(e.shape[0] for e, _ in logits))
        else:
            report["top1_agreement"].append(None)
    return report


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
    # torchao logs, on import, each CUDA kernel library it cannot load (and torch logs a
    # deprecation for an Enum torchao registers): lines about nothing this CPU path uses.
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    try:
        for log in quiet:
            log.setLevel(logging.ERROR)
        from torchao.quantization.pt2e import quantize_pt2e
    except ImportError as error:
        raise UserInputError(
            "quantization needs torchao (PT2E): pip install 'fxopt[quant]'"
        ) from error
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)
    return quantize_pt2e


__all__ = [
    "OBSERVERS",
    "SCHEMES",
    "WEIGHTS",
    "accuracy",
    "calibration_batches",
    "quantize",
    "sqnr_db",
]
