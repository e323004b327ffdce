"""Conversion options, and the versioned YAML file that sets them.

Every step that changes numerics can be switched off; defaults favour
compatibility. Unknown keys are an error, not silently ignored (a typo in a toggle must not
quietly convert a different model than the user asked for).

    >>> cfg = CircleConfig.from_dict({"version": 1, "fuse_activations": False})
    >>> cfg.fuse_activations, cfg.fold_bn
    (False, True)
    >>> CircleConfig.from_dict({"fuse_activation": False})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    fxopt.circle.errors.ConfigError: unknown config key 'fuse_activation' (did you mean ...
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields
from pathlib import Path

from fxopt.circle.errors import ConfigError
from fxopt.errors import UserInputError
from fxopt.paths import read_text

#: The schema version this fxopt reads. A file with another version is rejected.
CONFIG_VERSION = 1


@dataclass(frozen=True)
class CircleConfig:
    version: int = CONFIG_VERSION
    # fx-level inference passes (fxopt.passes). Folding changes rounding slightly.
    fold_bn: bool = True
    fold_constants: bool = True
    cse: bool = True
    remove_nops: bool = True
    # Circle-level: RELU / RELU6 / TANH after CONV_2D, FULLY_CONNECTED, ADD... become the
    # producer's fused activation (one kernel, no intermediate tensor).
    fuse_activations: bool = True
    # Circle-level: a per-channel MUL / ADD by constants before a FULLY_CONNECTED or an
    # unpadded CONV_2D (a LayerNorm's affine), or a MUL after a FULLY_CONNECTED (layer
    # scale), folded into its weights. Rounding changes as with BatchNorm folding.
    fold_affine: bool = True
    # mm / matmul whose right operand is a constant → FULLY_CONNECTED (weights pre-transposed).
    matmul_to_fully_connected: bool = True
    # mm / bmm whose *left* operand is a constant (2-D, or 3-D with batch 1) →
    # FULLY_CONNECTED on the transposed problem (bᵀ aᵀ)ᵀ, two TRANSPOSEs around it. Off
    # writes a BATCH_MATMUL with a constant left operand, which onert 0.1.0 refuses.
    const_lhs_matmul_to_fully_connected: bool = True
    # NPU legalizations (seed 004), off by default as in TICO:
    # -inf in attention masks (a where/masked_fill value, a constant mask added to scores)
    # → -120: a masked position weighs ~8e-53 instead of 0, and quantizers see a finite
    # range.
    legalize_causal_mask_value: bool = False
    # expand (BROADCAST_TO) → CONCATENATION of copies along each expanded dim, for NPUs
    # without a broadcast kernel; exact, but one op per expanded dim.
    convert_expand_to_slice_cat: bool = False
    # Keep 4-D values NHWC across layout-agnostic ops; False wraps every conv in TRANSPOSEs
    # (the naive lowering, kept for comparison and as an escape hatch).
    propagate_nhwc: bool = True
    # A non-tensor output (an int size, a float, a flag) is a constant output of the file
    # (int64 / float32 / bool scalar), as the model returns it; True refuses such a model,
    # naming the outputs, for a toolchain that takes only computed tensors. None is left out.
    tensor_outputs_only: bool = False
    # Re-produce at the end every graph output another operator reads. onert 0.1.0's memory
    # planner may hand such an output's buffer to a later operator (measured: `d = x / y;
    # return d, x - floor(d) * y` returned d off by 4.1); when a file's values differ in
    # validation, convert tries once more with this on. True: always.
    copy_read_outputs: bool = False
    # Parity tolerances for --validate (float32 outputs).
    rtol: float = 1e-4
    atol: float = 1e-4
    # Quantize a float model after training before converting it (fxopt.quant, the
    # 'quant' extra): "none", "uint8" (what onert runs) or "int16" (16-bit activations,
    # 8-bit weights; validated in LiteRT: onert 0.1.0 has no int16 kernels).
    quantize: str = "none"
    # With quantize: the number of random calibration batches drawn like the example, or
    # "path/to/file.py:NAME" naming an iterable of batches (or a function returning one).
    calibration: int | str = 16
    # With quantize: "per_channel" weight scales (accurate) or "per_tensor" (onert 0.1.0
    # runs those uint8 kernels 7-11x faster on CNNs; depthwise convolutions lose the most).
    quantize_weights: str = "per_channel"
    # Weight-only quantization of the linear layers in ggml's block formats, which onert
    # runs beside float activations (fxopt.quant.ggml): "none", "q8_0" (8.5 bits a
    # weight) or "q4_0" (4.5). Not with quantize.
    weight_only: str = "none"
    # Quantized graphs: int8 tensors are written as uint8 with the zero point moved by 128
    # (the same real values, exactly): onert 0.1.0's int8 kernels are partial and its
    # float → int8 QUANTIZE is wrong, its uint8 kernels run.
    int8_as_uint8: bool = True
    # Quantized graphs: an output of the file may differ from the quantized model's (its
    # fake-quant arithmetic in float) by this many quantization steps of that output:
    # integer kernels round accumulators and requantize where float does not.
    quantized_tolerance_steps: float = 2.0
    # Constants above this many bytes go outside the FlatBuffer (its 2 GiB limit).
    external_buffer_threshold: int = 2**31 - 2**26

    @classmethod
    def from_dict(cls, data: dict) -> CircleConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"a Circle config is a mapping of keys to values, got {data!r}")
        known = [f.name for f in fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(
                    f"unknown config key '{key}'{hint}; known keys: {', '.join(known)}"
                )
        version = data.get("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise ConfigError(
                f"config version {version} is not supported; this fxopt reads version "
                f"{CONFIG_VERSION}"
            )
        values = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            value, default = data[f.name], f.default
            expected = _TYPES.get(f.name, (type(default),))
            ok = isinstance(value, expected) and not (
                bool not in expected and isinstance(value, bool)
            )
            if float in expected and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                names = " or ".join(t.__name__ for t in expected)
                raise ConfigError(f"config key '{f.name}' must be {names}, got {value!r}")
            if f.name in _CHOICES and value not in _CHOICES[f.name]:
                raise ConfigError(
                    f"config key '{f.name}' must be one of {', '.join(_CHOICES[f.name])}, "
                    f"got {value!r}"
                )
            low = _LOWEST.get(f.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if low is not None and number and not (math.isfinite(value) and value >= low):
                raise ConfigError(
                    f"config key '{f.name}' must be a finite number >= {low}, got {value!r}"
                )
            values[f.name] = value
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: Keys whose values may have more than one type (the rest: the default's type).
_TYPES = {"calibration": (int, str)}
#: Numeric keys and the least value each takes: a tolerance of inf validates anything, a
#: negative one nothing, a negative threshold puts every constant outside the file.
_LOWEST = {
    "rtol": 0,
    "atol": 0,
    "quantized_tolerance_steps": 0,
    "external_buffer_threshold": 0,
    "calibration": 1,
}
#: Keys whose values come from a fixed set.
_CHOICES = {
    "quantize": ("none", "uint8", "int16"),
    "quantize_weights": ("per_channel", "per_tensor"),
    "weight_only": ("none", "q8_0", "q4_0"),
}


def load_config(path: str | Path | None) -> CircleConfig:
    """The config in YAML file ``path`` (defaults when ``path`` is None)."""
    if path is None:
        return CircleConfig()
    import yaml

    try:
        text = read_text(Path(path), "config file")  # missing, a directory, or binary
    except UserInputError as error:
        raise ConfigError(str(error)) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {_yaml_problem(error)}") from None
    try:
        return CircleConfig.from_dict(data)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from error


def _yaml_problem(error: Exception) -> str:
    """PyYAML's multi-line error as one line: where, and what."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"
