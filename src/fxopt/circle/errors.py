"""Errors of the Circle converter. All are user-facing: the CLI prints one line, exits 2."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxopt.errors import UnsupportedOpError, UserInputError, VerificationError


class ConfigError(UserInputError):
    """A Circle config file or dict is malformed (unknown key, wrong type, wrong version)."""


class TrainingModeError(UserInputError):
    """The model is in training mode: Circle files are for inference."""


class DynamicShapeError(UserInputError):
    """A dimension asked to be dynamic is not dynamic in the exported program."""


@dataclass(frozen=True)
class Unsupported:
    """One op the converter cannot lower: how often, and where it first appears."""

    op: str
    count: int
    where: str  # the user's source line of the first occurrence, or the node name
    reason: str = ""

    def __str__(self) -> str:
        reason = f": {self.reason}" if self.reason else ""
        return f"{self.op} ×{self.count} (first at {self.where}){reason}"


class UnsupportedOpsError(UnsupportedOpError, UserInputError):
    """Every op the converter cannot lower, listed at once (not just the first)."""

    def __init__(self, unsupported: Sequence[Unsupported]):
        self.unsupported = list(unsupported)
        lines = "; ".join(str(u) for u in self.unsupported)
        total = sum(u.count for u in self.unsupported)
        super().__init__(
            f"cannot convert to Circle: {len(self.unsupported)} unsupported op kind(s), "
            f"{total} node(s): {lines}"
        )


class CircleValidationError(VerificationError):
    """The converted file runs and computes something else than PyTorch, or the runtime
    chosen for it cannot run it. No file is handed over; ``validation`` says what differed,
    on which input, in which runtime."""

    def __init__(self, message: str, validation, input_description: str):
        self.validation = validation
        super().__init__(
            f"the Circle file does not match PyTorch: {message}",
            input_description=input_description,
        )


class NotValidatedWarning(UserWarning):
    """A file was converted but no runtime could run it (none installed, or none has a
    kernel for one of its operators): it is unchecked, and the report says so."""
