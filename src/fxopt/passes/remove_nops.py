"""Remove operations that return their input unchanged.

    y = identity(x)        y = x * 1           y = x.view(x.shape)       y = x.permute(1, 0)
                                                                         z = y.permute(1, 0)
    → uses of y read x     → uses of y read x  → uses of y read x        → uses of z read x

Removed when the metadata proves it (both capture levels):

* ``nn.Identity``, ``aten.alias``; dropout that is inactive (eval-mode module,
  ``F.dropout(..., training=False)``, ``p=0``);
* ``x * 1``, ``x / 1``, ``x - 0``, ``x + (-0.0)`` when the result has the input's dtype,
  shape and strides (``x * 1.0`` on an int tensor promotes; ``x + zeros(4)`` on a ``[1]``
  tensor broadcasts); ``x + 0`` and ``x - (-0.0)`` on a float result only with
  ``fast_math=True``: ``-0.0 + 0`` is ``+0.0``, and ``1 / (x + 0)`` is then ``+inf`` where
  ``1 / x`` is ``-inf`` (on integer results they are identities, and removed);
* ``.to()`` / ``.float()`` / ``aten._to_copy`` to the same dtype (and device, when known);
* ``.contiguous()`` and ``clone`` of a value known to be contiguous (at ATen level,
  ``.contiguous()`` and eval-mode dropout are spelled ``clone``);
* ``view`` / ``reshape`` to the input's own shape;
* consecutive reshapes (``x.reshape(a).reshape(b)`` → ``x.reshape(b)``, a chain one step
  at a time) when ``x`` is known contiguous: from any other ``x`` an intermediate reshape
  may copy, and the collapsed one could return a strided view that a later ``.view`` cannot
  take;
* ``permute`` / ``transpose`` / ``t`` pairs that cancel;
* a ``slice`` over the whole dim (``x[:, 0:]``, ATen's spelling of ``x[:, :, None]``'s
  ``:``): a view of all of ``x``;
* a ``cat`` of one tensor and tensors with no elements (a ``DynamicCache`` layer starts
  from an empty tensor and concatenates the cache it is given onto it), when the one
  left is known contiguous and sets the result's dtype: the cat is then a copy of it.

Never removed: a ``.contiguous()`` or ``clone`` whose input is not *known* contiguous (a
later ``.view`` may need the layout), ``x.view(dtype)`` that changes the dtype, and what the
rule engine refuses for every rule (:mod:`fxopt.passes.rules`): a copy that protects a value
from an in-place write, a copying op whose result is returned while its input is an input,
an attribute or another output.
"""

from __future__ import annotations

import math

import torch
from torch import fx

from fxopt.ir import facts, meta, ops
from fxopt.ir.op_table import Group
from fxopt.ir.pattern import ABSENT, Given, Match, Op, Var
from fxopt.passes.rules import Rewire, Rule, RulePass

X = Var("x")


class _NoOp(Rule):
    """A rule whose match is its input ``x``: the root's readers read ``x``."""

    stat = "removed"

    def replace_with(self, match: Match) -> fx.Node:
        return match["x"]


class Identity(_NoOp):
    name = "identity or inactive dropout"
    # A dropout the engine lets through is not random: inactive (eval, p=0).
    pattern = Op("identity", input=X) | Op("dropout", input=X)

    def applies(self, match: Match) -> bool:
        # A dropout in training is what it should be; aten.native_dropout: (output, mask)
        return not ops.info(match.root).random and not _returns_tuple(match.root)


def _arithmetic(name: str, identity: int, commutative: bool = False) -> Op:
    # (a literal 0 or 1 is an int or a float, never a bool: pattern literals)
    return Op(
        name,
        input=X,
        other=Given(identity),  # (in the call: most adds and muls have none)
        alpha=ABSENT | 1,
        rounding_mode=ABSENT,
        commutative=commutative,
    )


class ArithmeticIdentity(_NoOp):
    """x * 1, 1 * x, x / 1, x - 0, x + (-0.0); x + 0 and x - (-0.0) too on integer results,
    and on floats with fast_math (they turn -0.0 into +0.0)."""

    name = "x * 1 → x"
    inexact_name = "x + 0 → x on floats"
    inexact = "not an identity for -0.0 (-0.0 + 0 is +0.0)"
    pattern = (
        _arithmetic("mul", 1, commutative=True)
        | _arithmetic("div", 1)
        | _arithmetic("add", 0, commutative=True)
        | _arithmetic("sub", 0)
    )

    def is_inexact(self, match: Match) -> bool:
        return _flips_zero_sign(match.root)

    def check(self, match: Match) -> str | None:
        return _same_copy(match.root, match["x"])

    def relies_on(self, match: Match) -> tuple[fx.Node, ...]:
        return (match["x"],)


class SameTypeCast(_NoOp):
    """``.to()`` / ``.float()`` that keeps the dtype, and the device where it may move it."""

    name = "cast to its own type"
    pattern = Op("to", input=X, copy=ABSENT | False)

    def applies(self, match: Match) -> bool:
        node, x = match.root, match["x"]
        args = ops.args(node)
        if args.get("memory_format") not in (None, torch.preserve_format):
            return False
        if args.get("layout") not in (None, torch.strided) or meta.dtype(node) is None:
            return False
        if meta.dtype(node) != meta.dtype(x):
            return False
        moves = node.op == "call_function" or any(
            args.get(key) is not None for key in ("device", "other")
        )
        return not moves or (meta.device(node) is not None and meta.device(node) == meta.device(x))


# memory_format arguments that keep a contiguous value's layout (0: contiguous_format's
# number, the default the schema gives ``contiguous``).
_KEEPS_CONTIGUOUS = ABSENT | 0 | torch.contiguous_format | torch.preserve_format


class CopyOfContiguous(_NoOp):
    """``.contiguous()`` or ``clone`` of a value known to be contiguous (whether either copy
    is written in place, the engine asks)."""

    name = "copy of a contiguous value"
    pattern = Op(("contiguous", "clone"), input=X, memory_format=_KEEPS_CONTIGUOUS)

    def check(self, match: Match) -> str | None:
        if not facts.is_contiguous(match["x"]):
            return "input not known to be contiguous (the copy sets the layout a view needs)"
        return None

    def relies_on(self, match: Match) -> tuple[fx.Node, ...]:
        return (match["x"],)


class SameShapeReshape(_NoOp):
    """``view`` / ``reshape`` to the input's own shape; ``view(dtype)`` to its own dtype."""

    name = "reshape to its own shape"
    pattern = Op(Group.RESHAPES, input=X)

    def applies(self, match: Match) -> bool:
        # (a view to another dtype of the same size reinterprets the bits: other dtype)
        node, x = match.root, match["x"]
        return facts.same_shape(node, x) and meta.dtype(node) == meta.dtype(x)

    def check(self, match: Match) -> str | None:
        return None if facts.same_dtype(match.root, match["x"]) else "dtype unknown"


def _to_dtype(node: fx.Node) -> bool:
    """``x.view(torch.int32)``: reinterprets the bits (its shape follows its input's)."""
    return isinstance((ops.args(node) or {}).get("dtype"), torch.dtype)


class ReshapeChain(Rule):
    """``x.reshape(a).reshape(b)`` → ``x.reshape(b)`` when ``x`` is known contiguous: every
    step is then a view, and so is the collapsed one. (A chain goes one step at a time: each
    match sees the step before it already rewired.)"""

    name, stat = "reshape of a reshape", "collapsed"
    pattern = Op(Group.RESHAPES, input=Op(Group.FLATTENS, input=Var("source")))

    def applies(self, match: Match) -> bool:
        return not _to_dtype(match.root)

    def check(self, match: Match) -> str | None:
        node, source = match.root, match["source"]
        if meta.dtype(source) is None or meta.dtype(source) != meta.dtype(node):
            return "the chain reinterprets the dtype (a view(dtype) in it)"
        # From any other source an intermediate reshape may copy: the collapsed one may
        # then return a strided view that a later .view() cannot take.
        if not facts.is_contiguous(source):
            return "input not known to be contiguous"
        return None

    def replace_with(self, match: Match) -> fx.Node | Rewire:
        if facts.same_shape(match.root, match["source"]):  # x.flatten(0, 1).reshape_as(x)
            return match["source"]
        return Rewire({"input": match["source"]})

    def relies_on(self, match: Match) -> tuple[fx.Node, ...]:
        return (match["source"],)

    def counter(self, replacement: object) -> str:
        return "collapsed" if isinstance(replacement, Rewire) else "removed"


class CancellingPermutes(_NoOp):
    """``y = x.permute(p); z = y.permute(q)`` with ``q`` undoing ``p``: ``z`` is ``x``."""

    name = "permutes that cancel"
    keeps_inputs = True  # the first permute stays for its other readers
    pattern = Op(Group.PERMUTES, input=Op(Group.PERMUTES, input=X, bind="first"))

    def applies(self, match: Match) -> bool:
        first, second = _permutation(match["first"]), _permutation(match.root)
        if first is None or second is None or len(first) != len(second):
            return False
        return [first[i] for i in second] == list(range(len(second)))


class WholeSlice(_NoOp):
    """``slice(x, dim, 0, end)`` with ``end`` past every size the dim can have, step 1."""

    name = "slice over the whole dim"
    pattern = Op("slice", input=X)

    def applies(self, match: Match) -> bool:
        args = ops.args(match.root)
        if "end" not in args:  # narrow(x, dim, start, length) shares the row
            return False
        if args.get("start") not in (None, 0) or args.get("step") not in (None, 1):
            return False
        end = args.get("end")
        if end is None or (isinstance(end, int) and end >= _PAST_ANY_SIZE):
            return True
        sizes, dim = meta.sizes(match["x"]), args.get("dim", 0)
        if sizes is None or not isinstance(dim, int) or not isinstance(end, int):
            return False
        size = sizes[dim]
        return isinstance(size, int) and end >= size

    def check(self, match: Match) -> str | None:
        return None if facts.same_shape(match.root, match["x"]) else "shape unknown"


# ``x[a:]`` ends at sys.maxsize at the ATen level: past any size a tensor can have.
_PAST_ANY_SIZE = 2**62


class CatOfOneTensor(Rule):
    """``cat([empty, x])`` → ``x``: the operands with no elements add nothing, and a cat of
    one contiguous tensor is a copy of it (whether either is written, the engine asks)."""

    name = "cat of one tensor and empty ones"
    stat = "removed"
    pattern = Op("cat")

    def applies(self, match: Match) -> bool:
        return self._kept(match.root) is not None

    def check(self, match: Match) -> str | None:
        node, kept = match.root, self._kept(match.root)
        if not facts.is_contiguous(kept):
            return "input not known to be contiguous (the copy sets the layout a view needs)"
        return _same_copy(node, kept)

    def replace_with(self, match: Match) -> fx.Node:
        return self._kept(match.root)

    def relies_on(self, match: Match) -> tuple[fx.Node, ...]:
        return (self._kept(match.root),)

    @staticmethod
    def _kept(node: fx.Node) -> fx.Node | None:
        """The one operand with elements when every other has none, for every input."""
        tensors = ops.args(node).get("tensors")
        if not isinstance(tensors, (list, tuple)) or len(tensors) < 2:
            return None
        if not all(isinstance(t, fx.Node) for t in tensors):
            return None
        kept = [t for t in tensors if not _has_no_elements(t)]
        return kept[0] if len(kept) == 1 else None


def _has_no_elements(node: fx.Node) -> bool:
    sizes = meta.sizes(node)
    return sizes is not None and any(isinstance(d, int) and d == 0 for d in sizes)


class RemoveNops(RulePass):
    name = "remove-nops"
    description = (
        "remove identities, inactive dropout, x*1, x-0, no-op casts/reshapes/permutes/slices"
    )
    counters = ("removed", "collapsed")
    leftovers = "no-ops"
    rules = (
        Identity(),
        ArithmeticIdentity(),
        SameTypeCast(),
        CopyOfContiguous(),
        SameShapeReshape(),
        ReshapeChain(),
        CancellingPermutes(),
        WholeSlice(),
        CatOfOneTensor(),
    )


def _returns_tuple(node: fx.Node) -> bool:
    # aten.native_dropout returns (output, mask); ShapeProp leaves no meta["val"] for a tuple.
    if isinstance(node.target, torch._ops.OpOverload):
        return len(node.target._schema.returns) != 1
    # (tensor_meta of one tensor is a TensorMetadata, itself a NamedTuple: compare types.)
    return isinstance(node.meta.get("val"), (tuple, list)) or type(
        node.meta.get("tensor_meta")
    ) in (tuple, list)


def _same_value_type(node: fx.Node, x: fx.Node) -> str | None:
    """None when node's result has x's dtype and shape for every allowed input, else the
    reason it may not."""
    if meta.sizes(node) is None or meta.sizes(x) is None:
        return "shape unknown"
    if not facts.same_shape(node, x):
        shown = [str(d) for d in meta.sizes(x)], [str(d) for d in meta.sizes(node)]
        return f"may broadcast {shown[0]} to {shown[1]}"
    if not facts.same_dtype(node, x):
        return f"promotes {meta.dtype(x)} to {meta.dtype(node)}"
    return None


def _same_copy(node: fx.Node, x: fx.Node) -> str | None:
    """None when the copy ``node`` makes of ``x`` (x * 1, x + 0) is x in value, dtype, shape
    and strides; a copy that materializes a broadcast or a strided view is kept."""
    reason = _same_value_type(node, x)
    if reason is None and not facts.same_strides(node, x):
        reason = "the copy has other strides (it materializes a broadcast or a strided view)"
    return reason


def _flips_zero_sign(node: fx.Node) -> bool:
    """True for ``x + 0`` / ``x - (-0.0)`` with a floating result: an identity except that
    it turns -0.0 into +0.0 (``x + (-0.0)`` and ``x - 0`` keep every sign)."""
    dtype = meta.dtype(node)
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return False  # integers have one zero
    args = ops.args(node) or {}
    zero = next((args[k] for k in ("other", "input") if type(args.get(k)) in (int, float)), 1)
    negative = math.copysign(1.0, zero) < 0
    name = ops.info(node).name
    return name in ("add", "sub") and (negative if name == "sub" else not negative)


def _permutation(node: fx.Node) -> list[int] | None:
    args = ops.args(node)
    rank = meta.rank(args["input"]) if args and isinstance(args.get("input"), fx.Node) else None
    if not rank:
        return None
    name = ops.info(node).name
    if name == "permute":
        dims = args["dims"]
        if len(dims) != rank or not all(isinstance(d, int) for d in dims):
            return None
        return [d % rank for d in dims]
    perm = list(range(rank))
    if name == "t":
        if rank >= 2:
            perm[0], perm[1] = 1, 0
        return perm
    a, b = args["dim0"], args["dim1"]
    if not (isinstance(a, int) and isinstance(b, int)):
        return None
    a, b = a % rank, b % rank
    perm[a], perm[b] = perm[b], perm[a]
    return perm
