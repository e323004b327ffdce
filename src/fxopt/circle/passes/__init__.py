"""The Circle converter's two pipelines, run by the same :class:`~fxopt.passes.PassManager`
as every other rewrite in fxopt.

* :func:`aten_pipeline`: fxopt's inference passes on the core-ATen graph, once, before
  lowering. It takes a core-ATen graph and hands the lowering one that is core ATen,
  inference-only and shaped (``ensures``: the lowering relies on all four).
* :func:`circle_pipeline`: the Circle-level passes on the lowered graph (a
  :class:`~fxopt.circle.graph.CircleGraph`, graph kind :data:`CIRCLE`).

Each step the config can switch off is left out of the pipeline, so ``--dump-after`` and
the report never name a step that did not run.

    >>> from fxopt.circle.config import CircleConfig
    >>> aten_pipeline(CircleConfig()).pass_names()
    ['remove-nops', 'fold-bn', 'fold-constants', 'cse', 'dce']
    >>> config = CircleConfig(fuse_activations=False, fold_affine=False)
    >>> circle_pipeline(config).pass_names()  # doctest: +NORMALIZE_WHITESPACE
    ['merge-concatenations', 'merge-reshapes', 'share-duplicates', 'skip-reshapes-into-fc',
     'broadcast-past-reshapes', 'remove-dead-ops', 'copy-aliased-outputs']
    >>> aten_pipeline(CircleConfig(), quantized=True).pass_names()[0]
    'quantized-weights'
"""

from __future__ import annotations

from collections.abc import Sequence

from fxopt.circle.config import CircleConfig
from fxopt.circle.passes.broadcast_past_reshapes import BroadcastPastReshapes
from fxopt.circle.passes.copy_aliased_outputs import CopyAliasedOutputs
from fxopt.circle.passes.fold_affine import FoldAffine
from fxopt.circle.passes.fuse_activations import FuseActivations
from fxopt.circle.passes.kind import CIRCLE
from fxopt.circle.passes.merge_concatenations import MergeConcatenations
from fxopt.circle.passes.merge_reshapes import MergeReshapes
from fxopt.circle.passes.propagate_quantization import PropagateQuantization
from fxopt.circle.passes.quantize_operators import QuantizeOperators
from fxopt.circle.passes.quantized_weights import QuantizedWeights
from fxopt.circle.passes.remove_dead_ops import RemoveDeadOps
from fxopt.circle.passes.share_duplicates import ShareDuplicates
from fxopt.circle.passes.skip_reshapes_into_fc import SkipReshapesIntoFC
from fxopt.passes import PassManager
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.passes.dce import DeadCodeElimination
from fxopt.passes.fold_bn import FoldBatchNorm
from fxopt.passes.fold_constants import FoldConstants
from fxopt.passes.remove_nops import RemoveNops

# What the lowering relies on (fxopt.ir.spec names).
LOWERING_INVARIANTS = ("well-formed", "core-aten", "inference-only", "has-shapes")


def aten_pipeline(
    config: CircleConfig, *, dump_after: Sequence[str] = (), quantized: bool = False
) -> PassManager:
    """The fx passes before lowering, in this order, each unless the config turns it off;
    the quantization passes only for a ``quantized`` graph."""
    steps = [
        # first: fold-constants would fold a weight's dequantize and lose its integer grid
        (quantized, QuantizedWeights),
        # eval dropout, aliases, clones: fewer nodes to lower, none to copy
        (config.remove_nops, RemoveNops),
        # BN into conv weights before layout work: no per-channel MUL/ADD left
        (config.fold_bn, FoldBatchNorm),
        # weight transposes, masks, arange: stored once as buffers
        (config.fold_constants, FoldConstants),
        # shared subexpressions lower once (one Circle tensor, one op)
        (config.cse, CommonSubexpressionElimination),
        # last: what the passes above orphaned would otherwise need a lowering
        (True, DeadCodeElimination),
    ]
    return PassManager(
        [make() for enabled, make in steps if enabled],
        name="circle-aten",
        description="fxopt's inference passes on the core-ATen graph, before lowering",
        requires=("core-aten",),
        ensures=LOWERING_INVARIANTS,
        copy=False,  # the converter built the graph: no defensive copy
        dump_after=dump_after,
    )


def circle_pipeline(
    config: CircleConfig, *, dump_after: Sequence[str] = (), quantized: bool = False
) -> PassManager:
    """The Circle-level passes after lowering, in this order (the quantization passes only
    for a ``quantized`` graph)."""
    steps = [
        (config.fuse_activations, FuseActivations),  # must see ops before the cleanups
        (config.fold_affine, FoldAffine),  # LayerNorm affine, layer scale into FC weights
        (quantized, PropagateQuantization),  # layout and flatten work on the integer tensors
        (quantized, QuantizeOperators),  # after fusion: a fused RELU runs in the integer kernel
        (True, MergeConcatenations),  # cat of cat along one axis
        (True, MergeReshapes),  # RESHAPE∘RESHAPE left by layout conversions at flatten points
        (True, ShareDuplicates),  # the same reshape of one value for several readers
        (True, SkipReshapesIntoFC),  # FC flattens its input itself
        (True, BroadcastPastReshapes),  # a binary op broadcasts leading 1s itself
        (True, RemoveDeadOps),  # what fusion and merging orphaned
        (True, lambda: CopyAliasedOutputs(every_read=config.copy_read_outputs)),  # last
    ]
    return PassManager(
        [make() for enabled, make in steps if enabled],
        name="circle-steps",
        description="Circle-level fusion and cleanup on the lowered graph",
        graph_kind=CIRCLE,
        copy=False,
        dump_after=dump_after,
    )


__all__ = [
    "CIRCLE",
    "LOWERING_INVARIANTS",
    "BroadcastPastReshapes",
    "CopyAliasedOutputs",
    "FoldAffine",
    "FuseActivations",
    "MergeConcatenations",
    "MergeReshapes",
    "RemoveDeadOps",
    "ShareDuplicates",
    "SkipReshapesIntoFC",
    "aten_pipeline",
    "circle_pipeline",
]
