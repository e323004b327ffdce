"""split-dropouts: write each CPU ``native_dropout`` in training mode as the ops it runs,
so a plan can recompute its output from the kept mask without drawing again.

``native_dropout(x, p, True)`` on CPU draws a bool mask and returns
``(x.mul(mask).mul_(1 / (1 - p)), mask)``. As one node, recomputing the output means
replaying the draw (the Bernoulli draw is most of the op's time). Split, the graph reads

    mask = bernoulli(empty_like(x, dtype=bool), 1 - p)     (random: replayed if chosen)
    out  = apply_dropout_mask(x, mask, 1 / (1 - p))          (pure: cheap to recompute)

with the same values bit for bit and the same draws from the generator, and the planners
choose per value: recompute ``out`` from ``x`` and the mask (``x.mul(mask).mul_(scale)`` as
the kernel does, in one op ``fxopt::apply_dropout_mask`` so no second buffer is live; the
mask, a quarter of ``out``'s bytes for float32, stays saved as the dropout's backward needs
it anyway), or replay the mask too. CUDA's fused kernel draws differently, so only CPU
dropouts of contiguous inputs are split.

    >>> import torch
    >>> from torch import fx
    >>> from torch._subclasses import FakeTensorMode
    >>> aten = torch.ops.aten
    >>> def f(x):
    ...     d = aten.native_dropout.default(x, 0.5, True)
    ...     return aten.mul.Tensor(d[0], d[1])
    >>> gm = fx.symbolic_trace(f)
    >>> with FakeTensorMode() as mode:
    ...     x = torch.empty(4)
    >>> for n in gm.graph.nodes:
    ...     n.meta["val"] = (x, x.bool()) if n.name == "native_dropout_default" else x
    >>> SplitDropouts()(gm).stats
    {'split': 1}
    >>> [str(n.target) for n in gm.graph.nodes][1:4]
    ['aten.empty_like.default', 'aten.bernoulli.p', 'fxopt.apply_dropout_mask.default']
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass

import torch
from torch import fx

from fxopt.ir import ops
from fxopt.passes.base import Pass, PassResult, Plan, Skip

# ``x.mul(mask).mul_(scale)``: native_dropout's output from its mask, as one pure ATen op
# (a schema the op table reads: known, pure, not random), one buffer like the kernel's.
_LIB = torch.library.Library("fxopt", "FRAGMENT")
try:  # defined once per process, even if this file is imported under two names
    _DEFINED = torch.ops.fxopt.apply_dropout_mask is not None
except (AttributeError, RuntimeError):
    _LIB.define("apply_dropout_mask(Tensor x, Tensor mask, float scale) -> Tensor")
    _DEFINED = False


def _apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return x.mul(mask).mul_(scale)


def _apply_dropout_mask_meta(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


if not _DEFINED:
    _LIB.impl("apply_dropout_mask", _apply_dropout_mask, "CompositeExplicitAutograd")
    _LIB.impl("apply_dropout_mask", _apply_dropout_mask_meta, "Meta")


@dataclass(frozen=True)
class SplitPlan(Plan):
    dropouts: tuple[fx.Node, ...] = ()


class SplitDropouts(Pass[SplitPlan]):
    name = "split-dropouts"
    description = "a training-mode CPU dropout as its mask draw and a pure masking op"
    idempotent = True

    def analyze(self, gm: fx.GraphModule) -> SplitPlan:
        found, skipped = [], []
        for node in gm.graph.nodes:
            if ops.aten_name(node) != "native_dropout":
                continue
            reason = _why_not_split(node)
            if reason is None:
                found.append(node)
            elif reason:
                skipped.append(Skip(node.name, reason))
        return SplitPlan(tuple(skipped), tuple(found))

    def transform(self, gm: fx.GraphModule, plan: SplitPlan) -> PassResult:
        for node in plan.dropouts:
            _split(gm.graph, node)
        return PassResult(bool(plan.dropouts), {"split": len(plan.dropouts)})

    def verify(self, gm: fx.GraphModule) -> None:
        left = self.analyze(gm).dropouts
        assert not left, f"{len(left)} dropout(s) left unsplit"


def _why_not_split(node: fx.Node) -> str | None:
    """None when ``node`` can be split; "" when it is no candidate (eval mode); else why."""
    bound = ops.args(node)
    if bound is None or bound.get("training") is not True:
        return ""  # not in training mode: it draws nothing
    x_val = bound["input"].meta.get("val") if isinstance(bound["input"], fx.Node) else None
    if not isinstance(bound.get("p"), (int, float)):
        return "its probability is not a constant"
    if not isinstance(x_val, torch.Tensor) or not isinstance(node.meta.get("val"), (tuple, list)):
        return "its values carry no shapes (capture sets them)"
    if x_val.device.type != "cpu":
        return f"it runs on {x_val.device.type}, whose fused kernel draws differently"
    if not x_val.is_contiguous():  # bernoulli draws into a contiguous mask; the kernel's
        return "its input is not contiguous (the kernel's mask would have its strides)"
    if any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
        return "its result is used as a whole, not as (output, mask)"
    return None


def _split(graph: fx.Graph, node: fx.Node) -> None:
    bound = ops.args(node)
    x, p = bound["input"], bound["p"]
    out_val, mask_val = node.meta["val"]
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    empty = ops.emit(
        graph,
        "empty_like",
        x,
        dtype=torch.bool,
        memory_format=torch.contiguous_format,
        like=node,
        node_name=f"{node.name}_empty",
    )
    mask = ops.emit(graph, "bernoulli", empty, 1.0 - p, like=node, node_name=f"{node.name}_mask")
    with graph.inserting_before(node):
        out = graph.create_node(
            "call_function",
            torch.ops.fxopt.apply_dropout_mask.default,
            (x, mask, scale),
            name=f"{node.name}_out",
        )
    for new in (empty, mask, out):  # phase, partitioner tag: the dropout's
        new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    fake_mode = getattr(out_val, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        empty.meta["val"] = torch.empty_like(
            out_val, dtype=torch.bool, memory_format=torch.contiguous_format
        )
    mask.meta["val"], out.meta["val"] = mask_val, out_val
    for user in list(node.users):
        user.replace_all_uses_with(out if user.args[1] == 0 else mask)
        graph.erase_node(user)
    graph.erase_node(node)
