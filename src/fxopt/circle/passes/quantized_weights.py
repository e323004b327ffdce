"""quantized-weights: a weight the graph stores as integers and dequantizes
(``dequantize_per_channel(w_int8, scales, zero_points, axis, qmin, qmax, dtype)``, as PT2E's
``convert_pt2e`` leaves every conv and linear weight), or fake-quantizes (as QAT leaves
it), becomes the float constant it stands for, and the integer grid it lies on is
remembered in ``gm.meta[WEIGHT_GRIDS_KEY]``.

The lowering then sees a constant weight, as in a float model: a CONV_2D filter is laid out
OHWI, a depthwise filter 1HWC, folded and shared like any constant. The grid travels with
the Circle tensor (:class:`~fxopt.circle.graph.Grid`, its per-channel axis moved with the
layout), and the Circle pass ``quantize-operators`` stores the weight back as integers when
the operator that reads it runs quantized. The float values are the exact dequantized
values, so the graph computes what it did before the pass.

Runs first: fold-constants would otherwise fold the dequantize into a float constant and
the grid would be lost. Skipped, with the reason: a dequantize whose integer operand or
parameters are computed (not constants).

    >>> import torch
    >>> import torch.ao.quantization.fx._decomposed  # registers quantized_decomposed.*
    >>> dq = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    >>> class M(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("w", torch.tensor([[-2, 1], [3, 4]], dtype=torch.int8))
    ...     def forward(self, x):
    ...         return x @ dq(self.w, 0.5, 0, -127, 127, torch.int8)
    >>> from fxopt.capture import plain_graph_module
    >>> gm = plain_graph_module(torch.export.export(M(), (torch.ones(1, 2),)).module())
    >>> QuantizedWeights()(gm).stats
    {'weights': 1}
    >>> grid = next(iter(gm.meta[WEIGHT_GRIDS_KEY].values()))
    >>> grid.quantization.scale, grid.qmin, grid.qmax
    ((0.5,), -127, 127)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from fxopt.circle.graph import Grid, Quantization
from fxopt.ir import attributes, ops
from fxopt.passes.base import Pass, PassResult, Plan, Skip

#: ``gm.meta`` key: attribute name of a dequantized weight → its :class:`Grid`.
WEIGHT_GRIDS_KEY = "circle_weight_grids"


@dataclass(frozen=True)
class WeightsPlan(Plan):
    weights: tuple[fx.Node, ...] = ()  # dequantize nodes whose operands are all constants


class QuantizedWeights(Pass[WeightsPlan]):
    name = "quantized-weights"
    description = "integer weights dequantized in the graph become float constants on a grid"
    idempotent = True

    def analyze(self, gm: fx.GraphModule) -> WeightsPlan:
        found, skipped = [], []
        for node in gm.graph.nodes:
            if not (ops.is_call(node, "dequantize", gm) or ops.is_call(node, "fake_quantize", gm)):
                continue
            operands = [a for a in node.args if isinstance(a, fx.Node)]
            if all(attributes.constant(gm, a) is not None for a in operands):
                found.append(node)
            elif attributes.constant(gm, node.args[0]) is not None:
                skipped.append(Skip(node.name, "its scale or zero point is computed"))
        return WeightsPlan(tuple(skipped), tuple(found))

    def transform(self, gm: fx.GraphModule, plan: WeightsPlan) -> PassResult:
        grids = gm.meta.setdefault(WEIGHT_GRIDS_KEY, {})
        for node in plan.weights:
            values, grid = _dequantized(gm, node)
            base = str(node.args[0].target).replace(".", "_")
            name = attributes.free_name(gm, f"{base}_dequantized")
            gm.register_buffer(name, values)
            grids[name] = grid
            with gm.graph.inserting_before(node):
                constant = gm.graph.get_attr(name)
            constant.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(constant)
            gm.graph.erase_node(node)
        if plan.weights:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return PassResult(bool(plan.weights), {"weights": len(plan.weights)}, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = self.analyze(gm).weights
        assert not left, f"{len(left)} constant weight dequantize(s) left"


def _dequantized(gm: fx.GraphModule, node: fx.Node) -> tuple[torch.Tensor, Grid]:
    """The float values ``node`` computes (by running it) and the grid they lie on."""
    call_args = [attributes.constant(gm, a) if isinstance(a, fx.Node) else a for a in node.args]
    call_kwargs = dict(node.kwargs)
    values = node.target(*call_args, **call_kwargs).detach()
    scale, zero_point = call_args[1], call_args[2]
    per_channel = "per_channel" in str(node.target)
    if per_channel:
        axis, qmin, qmax = call_args[3], call_args[4], call_args[5]
        scales = tuple(float(s) for s in torch.as_tensor(scale).flatten())
        zero_points = tuple(int(z) for z in torch.as_tensor(zero_point).flatten())
    else:
        axis, qmin, qmax = 0, call_args[3], call_args[4]
        scales = (float(torch.as_tensor(scale)),)
        zero_points = (int(torch.as_tensor(zero_point)),)
    return values, Grid(Quantization(scales, zero_points, int(axis)), int(qmin), int(qmax))


__all__ = ["WEIGHT_GRIDS_KEY", "QuantizedWeights"]
