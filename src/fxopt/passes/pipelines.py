"""Named pass pipelines (presets): each a :class:`PassManager` of pass instances, every
step with the reason for its place. ``get`` builds a fresh one, so changing it changes
nothing for the next caller.

The Circle converter's pipelines are in :mod:`fxopt.circle.passes` (the same inference
passes on core ATen, then Circle-level passes after lowering); remat's rewrites in
:mod:`fxopt.remat`.

>>> from fxopt.passes import pipelines
>>> pipelines.get("speed").pass_names()[-2:]
['cse', 'dce']
"""

from __future__ import annotations

from collections.abc import Callable

from fxopt.errors import UserInputError
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.passes.dce import DeadCodeElimination
from fxopt.passes.fold_bn import FoldBatchNorm
from fxopt.passes.fold_constants import FoldConstants
from fxopt.passes.gqa_attention import GqaAttention
from fxopt.passes.manager import PassManager
from fxopt.passes.remove_nops import RemoveNops


def speed(fast_math: bool = False) -> PassManager:
    """Inference, to a fixed point: each step exposes work for the others. Parameters are
    treated as constants (fold-bn, fold-constants)."""
    return PassManager(
        [
            RemoveNops(
                fast_math=fast_math
            ),  # first: identities and inactive dropout hide conv → bn pairs
            GqaAttention(),  # after no-op slices go: attention reads the unrepeated cache
            FoldBatchNorm(),  # before constant folding, so the folded weights are attributes
            FoldConstants(),  # weight transposes / scale products computed once
            CommonSubexpressionElimination(),  # merge repeated pure work: fewer nodes after
            DeadCodeElimination(),  # last: drop what the passes above orphaned
        ],
        max_rounds=4,
        name="speed",
        description="inference: fold BatchNorm and constants, merge and drop redundant work",
    )


def cleanup(fast_math: bool = False) -> PassManager:
    """Graph cleanup only: nothing that treats parameters as constants (safe for training)."""
    return PassManager(
        [RemoveNops(fast_math=fast_math), CommonSubexpressionElimination(), DeadCodeElimination()],
        max_rounds=4,
        name="cleanup",
        description="no-ops, duplicates and dead code only: safe for training",
    )


def none(fast_math: bool = False) -> PassManager:
    """Capture and verify only: the baseline every report compares against."""
    return PassManager([], name="none", description="capture and verify only")


PRESETS: dict[str, Callable[..., PassManager]] = {
    "speed": speed,
    "cleanup": cleanup,
    "none": none,
}


def get(name: str, *, fast_math: bool = False) -> PassManager:
    """A fresh pipeline of preset ``name``; UserInputError lists the presets. ``fast_math``
    allows the rewrites that are exact for finite inputs only (``Pass.inexact_rewrites``)."""
    try:
        preset = PRESETS[name]
    except KeyError:
        raise UserInputError(
            f"unknown preset '{name}'; available presets: {', '.join(PRESETS)}"
        ) from None
    return preset(fast_math=fast_math)
