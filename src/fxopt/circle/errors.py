"""Errors of the Circle converter. All are user-facing: the CLI prints one line, exits 2."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxopt.errors import UnsupportedOpError, UserInputError


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
