"""The errors fxopt raises. Every one says what failed, where, and what to try next.

All derive from :class:`FxoptError`, so ``except fxopt.FxoptError`` catches any of them.
Errors caused by the user's input (a model that cannot be traced, an unknown pass name,
a bad shape string) also derive from :class:`UserInputError`; the CLI prints those as one
line and exits with status 2.
"""

from __future__ import annotations

from collections.abc import Sequence


class FxoptError(Exception):
    """Base class of every error fxopt raises on purpose."""


class UserInputError(FxoptError):
    """The input was wrong (model spec, option, file): fixable by the caller."""


class CaptureError(UserInputError):
    """A model could not be captured as a graph."""


class InputMismatchError(UserInputError):
    """An optimized module was called with an input outside its contract (a dtype, shape,
    device or layout it was not optimized and verified for). Nothing was computed."""


class NotEnoughMemoryError(UserInputError):
    """The machine has less memory free than a job needs beside the model (estimated from
    the model's weight bytes before the job starts)."""


class StaleWeightsError(FxoptError):
    """A weight the optimized module derived from the model's (a folded BatchNorm, a packed
    weight) is out of date: the model's source tensor was changed in place since."""


class WritesWeightsError(UserInputError):
    """A model's forward writes one of its parameters in place. fxopt shares the model's
    weights rather than copying them, so it refuses to run such a forward (the write is
    refused before it happens on the first run, and detected on any later one)."""


class UnknownPassError(UserInputError, KeyError):
    """A pass name that the registry does not know."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnsupportedOpError(FxoptError):
    """An operator that a stage of fxopt cannot handle."""


class InvariantError(FxoptError):
    """A graph broke a named invariant (see :mod:`fxopt.ir.spec`)."""

    def __init__(self, invariant: str, problems: Sequence[str]):
        self.invariant = invariant
        self.problems = list(problems)
        shown = "; ".join(self.problems[:5])
        more = f" (+{len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"invariant '{invariant}' does not hold: {shown}{more}")


class PassError(FxoptError):
    """A pass failed or left a broken graph. The caller's graph is unchanged."""

    def __init__(
        self,
        pass_name: str,
        message: str,
        *,
        passes_before: Sequence[str] = (),
        nodes: Sequence[str] = (),
    ):
        self.pass_name = pass_name
        self.passes_before = list(passes_before)
        self.nodes = list(nodes)
        where = f" at nodes {', '.join(self.nodes[:8])}" if self.nodes else ""
        before = f" (after {' → '.join(self.passes_before)})" if self.passes_before else ""
        super().__init__(f"pass '{pass_name}' failed{before}{where}: {message}")


class VerificationError(FxoptError):
    """An optimized model does not compute what the original computes."""

    def __init__(
        self,
        message: str,
        *,
        max_abs_error: float | None = None,
        input_description: str | None = None,
        first_bad_pass: str | None = None,
    ):
        self.max_abs_error = max_abs_error
        self.input_description = input_description
        self.first_bad_pass = first_bad_pass
        parts = [message]
        if max_abs_error is not None:
            parts.append(f"max abs error {max_abs_error:.3g}")
        if input_description:
            parts.append(f"on {input_description}")
        if first_bad_pass:
            parts.append(f"outputs first diverge after pass '{first_bad_pass}'")
        super().__init__("; ".join(parts))
