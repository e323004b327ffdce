"""The pass registry: stable names (and two spellings of the seed API) to pass classes.

Registration is this explicit table, not an import side effect: adding a pass means adding
a line here, where reviewers see it.

    >>> from fxopt.passes.registry import resolve
    >>> resolve("redundant_ops").name
    'cse'
"""

from __future__ import annotations

from fxopt.errors import UnknownPassError
from fxopt.passes.base import Pass
from fxopt.passes.bmm_to_matmul import BmmToMatmul
from fxopt.passes.cse import CommonSubexpressionElimination
from fxopt.passes.dce import DeadCodeElimination
from fxopt.passes.fold_bn import FoldBatchNorm
from fxopt.passes.fold_constants import FoldConstants
from fxopt.passes.fuse_kernels import FuseKernels
from fxopt.passes.gqa_attention import GqaAttention
from fxopt.passes.merge_linears import MergeLinears
from fxopt.passes.remove_nops import RemoveNops

PASSES: dict[str, type[Pass]] = {
    cls.name: cls
    for cls in (
        BmmToMatmul,
        CommonSubexpressionElimination,
        DeadCodeElimination,
        FoldBatchNorm,
        FoldConstants,
        FuseKernels,
        GqaAttention,
        MergeLinears,
        RemoveNops,
    )
}

# The seed API's spellings that the README and tests use.
ALIASES: dict[str, str] = {
    "redundant_ops": "cse",
    "dead_code": "dce",
}

PassLike = str | Pass


def available() -> list[str]:
    """Registered pass names, sorted."""
    return sorted(PASSES)


def resolve(pass_or_name: PassLike, *, fast_math: bool = False) -> Pass:
    """A Pass instance for a name (or alias), or the instance itself. ``fast_math`` builds
    a pass that has inexact rewrites (``Pass.inexact_rewrites``) with them allowed."""
    if isinstance(pass_or_name, Pass):
        return pass_or_name
    if isinstance(pass_or_name, type) and issubclass(pass_or_name, Pass):
        return _build(pass_or_name, fast_math)
    if not isinstance(pass_or_name, str):
        raise TypeError(f"expected a pass name or a Pass instance, got {pass_or_name!r}")
    name = ALIASES.get(pass_or_name, pass_or_name)
    cls = PASSES.get(name)
    if cls is None:
        raise UnknownPassError(
            f"unknown pass '{pass_or_name}'; available passes: {', '.join(available())}"
        )
    return _build(cls, fast_math)


def _build(cls: type[Pass], fast_math: bool) -> Pass:
    return cls(fast_math=fast_math) if cls.inexact_rewrites else cls()  # type: ignore[call-arg]
