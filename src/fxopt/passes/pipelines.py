"""Named pass pipelines: flat, readable lists, each step with the reason for its place.

    >>> from fxopt.passes.pipelines import PIPELINES
    >>> PIPELINES["speed"]
    ('cse', 'dce')
"""

from __future__ import annotations

PIPELINES: dict[str, tuple[str, ...]] = {
    # Inference cleanup. Run to a fixed point by the caller (max_rounds): CSE exposes dead
    # nodes, and DCE can expose new duplicates only through other passes added later.
    "speed": (
        "cse",  # merge repeated pure work first: fewer nodes for every later pass
        "dce",  # then drop what nobody uses, including what CSE orphaned
    ),
    # The smallest useful cleanup: only remove what is provably unused.
    "cleanup": ("dce",),
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
