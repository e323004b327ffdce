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
    # Circle conversion (fxopt.circle), on the core-ATen graph after export. One round: the
    # lowering, not these passes, does the Circle-specific work. Each step can be switched
    # off in the Circle config (fold_bn, fold_constants, cse, remove_nops).
    "circle": (
        "remove-nops",  # eval dropout, aliases, clones: fewer nodes to lower, none to copy
        "fold-bn",  # BN into conv weights before layout work: no per-channel MUL/ADD left
        "fold-constants",  # weight transposes, masks, arange: stored once as buffers
        "cse",  # shared subexpressions lower once (one Circle tensor, one op)
        "dce",  # last: what the passes above orphaned would otherwise need a lowering
    ),
}

# After lowering, on the Circle graph (fxopt.circle.optimize), in this order.
CIRCLE_STEPS: tuple[str, ...] = (
    "fuse-activations",  # RELU/RELU6 into CONV_2D/FC/ADD: must see ops before cleanups
    "merge-reshapes",  # RESHAPE∘RESHAPE left by layout conversions at flatten points
    "remove-dead-ops",  # last: what fusion and merging orphaned
)


def get(name: str) -> tuple[str, ...]:
    """The pass names of preset ``name``; UserInputError lists the presets."""
    from fxopt.errors import UserInputError

    try:
        return PIPELINES[name]
    except KeyError:
        raise UserInputError(
            f"unknown preset '{name}'; available presets: {', '.join(PIPELINES)}"
        ) from None
