"""Remove operations that return their input unchanged.

    y = identity(x)        y = x * 1           y = x.view(x.shape)       y = x.permute(1, 0)
                                                                         z = y.permute(1, 0)
    → uses of y read x     → uses of y read x  → uses of y read x        → uses of z read x

Removed when the metadata proves it (both capture levels):

* ``nn.Identity``, ``aten.alias``; dropout that is inactive (eval-mode module,
  ``F.dropout(..., training=False)``, ``p=0``);
* ``x * 1``, ``x / 1``, ``x - 0``, ``x + (-0.0)`` when the result has the input's dtype
  *and* shape (``x * 1.0`` on an int tensor promotes; ``x + zeros(4)`` on a ``[1]`` tensor
  broadcasts); ``x + 0`` and ``x - (-0.0)`` on a float result only with ``fast_math=True``:
  ``-0.0 + 0`` is ``+0.0``, and ``1 / (x + 0)`` is then ``+inf`` where ``1 / x`` is ``-inf``
  (on integer results they are identities, and removed);
* ``.to()`` / ``.float()`` / ``aten._to_copy`` to the same dtype (and device, when known);
* ``.contiguous()`` on a value known to be contiguous;
* ``view`` / ``reshape`` to the input's own shape;
* consecutive reshapes (``x.reshape(a).reshape(b)`` → ``x.reshape(b)``, a whole chain at
  once) when ``x`` is known contiguous: from any other ``x`` an intermediate reshape may copy,
  and the collapsed one could return a strided view that a later ``.view`` cannot take;
* ``permute`` / ``transpose`` / ``t`` pairs that cancel.

* ``clone`` of a contiguous value when neither the value nor the copy is ever written
  (at ATen level, ``.contiguous()`` and eval-mode dropout are spelled ``clone``).

Never removed: a ``.contiguous()`` or ``clone`` whose input is not *known* contiguous (a
later ``.view`` may need the layout), a ``clone`` that protects a value from an in-place
write, any rewrite whose input or result is written in place somewhere in the graph
(removing the op would make the two names share storage), ``x.view(dtype)`` (it
reinterprets the bits), and a copying op (``x * 1``, ``clone``) whose result is returned
while its input is a graph input, an attribute or another output (the caller would get
back a tensor it already holds, and could write through it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import fx

from fxopt.ir import facts, meta, ops
from fxopt.ir.op_table import Group
from fxopt.ir.safety import Safety
from fxopt.passes.base import Pass, PassResult, Plan, Skip

_ARITHMETIC_IDENTITY = {"mul": 1, "div": 1, "add": 0, "sub": 0}
# Every op name _find looks at: the others are skipped without a call.
_CANDIDATES = (
    frozenset(("identity", "dropout", "contiguous", "clone"))
    | Group.ARITHMETIC
    | Group.CASTS
    | Group.RESHAPES
    | Group.PERMUTES
)


@dataclass(frozen=True)
class NopPlan(Plan):
    #: (node, value that replaces it) in graph order; values already resolved.
    replace: tuple[tuple[fx.Node, fx.Node], ...] = ()
    #: (reshape node, new input): the intermediate reshape is then dead (left for dce).
    rewire: tuple[tuple[fx.Node, fx.Node], ...] = ()
    #: values whose layout (contiguity, strides) a planned rewrite relies on.
    layouts: tuple[fx.Node, ...] = ()
    #: the planned removals that are exact for finite inputs only (fast_math).
    inexact: tuple[fx.Node, ...] = ()


_ADD_ZERO = "x + 0 → x on floats"


class RemoveNops(Pass[NopPlan]):
    name = "remove-nops"
    description = "remove identities, inactive dropout, x*1, x-0, no-op casts/reshapes/permutes"
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing
    inexact_rewrites: ClassVar[dict[str, str]] = {
        _ADD_ZERO: "-0.0 + 0 is +0.0: the sign of a zero changes"
    }

    def __init__(self, fast_math: bool = False):
        self.fast_math = fast_math

    def analyze(self, gm: fx.GraphModule) -> NopPlan:
        safety = Safety(gm)
        replaced: dict[fx.Node, fx.Node] = {}
        replace, rewire, layouts, skipped, inexact = [], [], [], [], []
        for node in gm.graph.nodes:
            op = safety.table[node]
            if op.name not in _CANDIDATES or not op.compute or not op.known:
                continue
            finding = _find(gm, node, op, replaced)
            if finding is None:
                continue
            kind, value, reason, relies_on_layout = finding
            if reason is None and _flips_zero_sign(node, op.name) and not self.fast_math:
                reason = "not an identity for -0.0 (-0.0 + 0 is +0.0); fast_math removes it"
            value = replaced.get(value, value)
            reason = reason or safety.why_not_replace(node, value)
            if reason is not None:
                skipped.append(Skip(node.name, f"{op.name} kept: {reason}"))
                continue
            if _flips_zero_sign(node, op.name):
                inexact.append(node)
            if kind == "replace":
                replaced[node] = value
                replace.append((node, value))
                safety.planned(node, value)
            else:
                rewire.append((node, value))
            if relies_on_layout:
                layouts.append(value)
        return NopPlan(
            skipped=tuple(skipped),
            replace=tuple(replace),
            rewire=tuple(rewire),
            layouts=tuple(layouts),
            inexact=tuple(inexact),
        )

    def transform(self, gm: fx.GraphModule, plan: NopPlan) -> PassResult:
        if plan.layouts:  # before the rewrite: the facts read the values' producers
            facts.rely_on_layout(gm, *plan.layouts)
        for node, value in plan.replace:
            node.replace_all_uses_with(value)
            gm.graph.erase_node(node)
        for node, new_input in plan.rewire:
            node.replace_input_with(node.args[0], new_input)
        changed = bool(plan.replace or plan.rewire)
        stats = {"removed": len(plan.replace), "collapsed": len(plan.rewire)}
        inexact = {_ADD_ZERO: len(plan.inexact)} if plan.inexact else {}
        return PassResult(changed, stats, plan.skipped, inexact=inexact)

    def verify(self, gm: fx.GraphModule) -> None:
        plan = self.analyze(gm)
        left = [n.name for n, _ in plan.replace]
        assert not left, f"no-ops left after remove-nops: {left[:8]}"


def _input(node: fx.Node) -> fx.Node | None:
    first = node.args[0] if node.args else node.kwargs.get("input")
    return first if isinstance(first, fx.Node) else None


class _Finding(NamedTuple):
    """A candidate: replace the node by ``value`` (or rewire it to read ``value``), unless
    ``reason`` says why not. ``relies_on_layout``: the rewrite is right only for inputs laid
    out like the example (fxopt.ir.facts)."""

    kind: str  # "replace" | "rewire"
    value: fx.Node
    reason: str | None
    relies_on_layout: bool = False


def _find(gm, node: fx.Node, op: ops.OpInfo, replaced: dict) -> _Finding | None:
    """What to do with a candidate node, or None when it is not one. ``replaced``: what
    this analysis already replaces, so ``t(a)`` with ``a = t(x) + 0`` going is a pair."""
    name = op.name
    if name in Group.ARITHMETIC:  # first: most candidates are adds and muls
        found = _arithmetic(node, name)  # (None for most: no literal 0 / 1 operand)
        return None if found is None or op.inplace or op.random else found
    if op.inplace or op.random:
        return None
    x = _input(node)
    x = replaced.get(x, x)
    if name == "identity" and x is not None:
        return _Finding("replace", x, None)
    if name == "dropout" and x is not None and not _returns_tuple(node):
        return _Finding("replace", x, None)  # not random, so inactive (eval or p=0)
    if x is None:
        return None
    if name == "to":
        return _cast(node, x)
    if name == "contiguous":
        return _contiguous(node, x)
    if name == "clone":
        return _clone(node, x)
    if name in Group.RESHAPES:
        return _reshape(gm, node, x)
    if name in Group.PERMUTES:
        return _permute_pair(gm, node, x)
    return None


def _contiguous(node: fx.Node, x: fx.Node):
    """``.contiguous()`` is a no-op on a value known to be contiguous already."""
    if node.kwargs.get("memory_format", torch.contiguous_format) != torch.contiguous_format:
        return None
    if facts.is_contiguous(x):
        return _Finding("replace", x, None, relies_on_layout=True)
    return _Finding("replace", x, "input not known to be contiguous (a later view needs it)")


def _clone(node: fx.Node, x: fx.Node):
    """A clone matters when someone writes into either copy (checked by the caller) or
    when it changes the layout a later view relies on."""
    if node.kwargs.get("memory_format") not in (
        None,
        torch.preserve_format,
        torch.contiguous_format,
    ):
        return None
    if facts.is_contiguous(x):
        return _Finding("replace", x, None, relies_on_layout=True)
    return _Finding("replace", x, "input not known to be contiguous (the copy sets the layout)")


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


# A literal 0 or 1 operand is exactly an int or a float, never a bool (although True == 1).
_NUMBERS = (int, float)


def _arithmetic(node: fx.Node, name: str):
    # The operands first: most adds and muls have no literal 0 / 1 and stop here.
    args = node.args
    if len(args) != 2:
        return None
    left, right = args
    identity = _ARITHMETIC_IDENTITY[name]
    if type(right) in _NUMBERS and right == identity and isinstance(left, fx.Node):
        x = left
    elif type(left) in _NUMBERS and left == identity and name in ("mul", "add"):
        x = right  # 0 + x, 1 * x (commutative only)
        if not isinstance(x, fx.Node):
            return None
    else:
        return None
    kwargs = node.kwargs
    if kwargs.get("alpha", 1) != 1 or kwargs.get("rounding_mode") is not None or "out" in kwargs:
        return None
    return _Finding("replace", x, _same_copy(node, x), relies_on_layout=True)


def _flips_zero_sign(node: fx.Node, name: str) -> bool:
    """True for ``x + 0`` / ``x - (-0.0)`` with a floating result: an identity except that
    it turns -0.0 into +0.0 (``x + (-0.0)`` and ``x - 0`` keep every sign)."""
    if name not in ("add", "sub") or len(node.args) != 2:
        return False
    dtype = meta.dtype(node)
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return False  # integers have one zero
    zero = next(a for a in node.args if type(a) in _NUMBERS)
    negative = math.copysign(1.0, zero) < 0
    return negative if name == "sub" else not negative


def _cast(node: fx.Node, x: fx.Node):
    """A cast is a no-op when it keeps the dtype, and the device where it may move it."""
    args = ops.args(node)  # None for .cpu() / .cuda(): never removed
    if args is None or args.get("copy") is True:
        return None
    if args.get("memory_format") not in (None, torch.preserve_format):
        return None
    if args.get("layout") not in (None, torch.strided):
        return None
    if meta.dtype(node) is None or meta.dtype(node) != meta.dtype(x):
        return None
    moves = node.op == "call_function" or any(
        args.get(key) is not None for key in ("device", "other")
    )
    if moves and (meta.device(node) is None or meta.device(node) != meta.device(x)):
        return None
    return _Finding("replace", x, None)


def _reshape(gm, node: fx.Node, x: fx.Node):
    if any(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        # x.view(torch.int32) reinterprets the bits; its shape follows its input's.
        if _same_value_type(node, x) is None:
            return _Finding("replace", x, None)
        return None
    if facts.same_shape(node, x):
        return _Finding("replace", x, _same_value_type(node, x))
    if not _is_single_use_reshape(gm, x):
        return None
    source = _input(x)
    while _is_single_use_reshape(gm, source):  # collapse a whole chain in one run
        source = _input(source)
    if source is None:
        return None
    if meta.dtype(source) is None or meta.dtype(source) != meta.dtype(node):
        return _Finding("rewire", source, "the chain reinterprets the dtype (a view(dtype) in it)")
    # From a contiguous source every step is a view and so is the collapsed reshape. From
    # any other, an intermediate reshape may copy: the collapsed one may then return a
    # strided view that a later .view() cannot take, or a view(...) chain may not be one view.
    if not facts.is_contiguous(source):
        return _Finding("rewire", source, "input not known to be contiguous")
    if facts.same_shape(node, source):  # the whole chain is an identity: y.flatten(0, 1)...
        return _Finding("replace", source, None, relies_on_layout=True)  # .reshape_as(y)
    return _Finding("rewire", source, None, relies_on_layout=True)


def _is_single_use_reshape(gm, node: fx.Node | None) -> bool:
    if node is None or not ops.is_compute(node) or len(node.users) != 1:
        return False
    return ops.info(node, gm).name in Group.FLATTENS and _input(node) is not None


def _permutation(gm, node: fx.Node) -> list[int] | None:
    rank = (meta.rank(_input(node)) or 0) if _input(node) is not None else 0
    args = ops.args(node)
    if rank == 0 or args is None:
        return None
    name = ops.info(node, gm).name
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


def _permute_pair(gm, node: fx.Node, x: fx.Node):
    if not ops.is_compute(x) or ops.info(x, gm).name not in Group.PERMUTES:
        return None
    first, second = _permutation(gm, x), _permutation(gm, node)
    source = _input(x)
    if first is None or second is None or source is None or len(first) != len(second):
        return None
    combined = [first[i] for i in second]
    if combined != list(range(len(combined))):
        return None
    return _Finding("replace", source, None)
