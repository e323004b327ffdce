"""Named pass pipelines: flat, readable lists, each step with the reason for its place.

>>> from fxopt.passes.pipelines import PIPELINES
>>> PIPELINES["speed"][-2:]
('cse', 'dce')
"""

from __future__ import annotations

PIPELINES: dict[str, tuple[str, ...]] = {
    # Inference. Run to a fixed point by the caller (max_rounds): each step exposes work for
    # the others. Parameters are treated as constants (fold-bn, fold-constants).
    "speed": (
        "remove-nops",  # first: identities and inactive dropout hide conv → bn pairs
        "fold-bn",  # before constant folding, so the folded weights are plain attributes
        "fold-constants",  # weight transposes / scale products computed once
        "cse",  # merge repeated pure work: fewer nodes for every later pass
        "dce",  # last: drop what the passes above orphaned
    ),
    # Graph cleanup only: nothing that treats parameters as constants (safe for training).
    "cleanup": ("remove-nops", "cse", "dce"),
    # Capture and verify only: the baseline every report compares against.
    "none": (),
}


def get(name: str) -> tuple[str, ...]:
    """The pass names of preset ``name``; UserInputError lists the presets."""
    from fxopt.errors import UserInputError

    try:
        return PIPELINES[name]
    except KeyError:
        raise UserInputError(
            f"unknown preset '{name}'; available presets: {', '.join(PIPELINES)}"
        ) from None
