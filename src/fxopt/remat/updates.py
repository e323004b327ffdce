"""Apply the optimizer's update to each parameter inside the backward, as soon as its
gradient exists, and drop the gradient (pass ``apply-updates``).

Eager training keeps every parameter gradient until ``optimizer.step()`` runs after the
backward: at the end of the backward, a full model's worth of gradients is alive on top
of whatever the backward still holds. Here each gradient lives from the node that makes it
to its update, so at most the gradients in flight are alive.

A parameter may be updated only when nothing later in the graph reads it: the gradient of
a linear layer's input (``mm(grad_out, weight)``) can come after its weight's gradient, and
a recomputed forward value reads its layer's weight. So the update goes after the last node
that reads the parameter or a view of it (``t(weight)``), or after the gradient, whichever
is later.

    >>> import torch
    >>> from torch import fx
    >>> def step(w, x):
    ...     y = torch.mm(x, w)
    ...     grad_w = torch.mm(x.t(), torch.ones_like(y))
    ...     grad_x = torch.mm(torch.ones_like(y), w.t())   # reads w after grad_w exists
    ...     return y.sum(), grad_w, grad_x
    >>> gm = fx.symbolic_trace(step)
    >>> seen = []
    >>> def record(grad):
    ...     seen.append(grad.shape)
    >>> result = apply_updates(gm, {1: ("w", record)})
    >>> [n.name for n in gm.graph.nodes][-4:]
    ['mm_2', 'record', 'sum_1', 'output']
    >>> _ = gm(torch.ones(3, 2), torch.ones(4, 3)); seen
    [torch.Size([3, 2])]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from fxopt.errors import PassError
from fxopt.ir import ops
from fxopt.ir.spec import runtime_helper
from fxopt.passes.base import Pass, PassResult, Plan
from fxopt.passes.manager import PipelineResult
from fxopt.remat.tags import BACKWARD, PHASE


def parameter_update(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Callable:
    """A graph helper: ``optimizer.step()`` for ``param`` alone, with ``grad`` as its
    gradient, which is dropped afterwards.

    While it steps, the optimizer's groups hold only ``param`` (its own group) and nothing
    (the others): a step loops over its groups' parameters, and over all of them per
    update the updates of a model would cost O(parameters²).
    """
    own = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)

    def apply_update(grad: torch.Tensor) -> None:
        groups = optimizer.param_groups
        kept = [group["params"] for group in groups]
        for group in groups:
            group["params"] = [param] if group is own else []
        param.grad = grad
        try:
            optimizer.step()
        finally:
            param.grad = None
            for group, params in zip(groups, kept):
                group["params"] = params

    return runtime_helper(apply_update)


def apply_updates(
    gm: fx.GraphModule, updates: Mapping[int, tuple[str, Callable]], *, dump_after=()
) -> PipelineResult:
    """Rewrite ``gm`` in place: for ``updates[i] = (parameter, update)``, output position
    ``i`` (the gradient of the placeholder named ``parameter``) is passed to ``update``
    inside the graph and returned as None (:class:`ApplyUpdates`)."""
    from fxopt.passes import PassManager

    return PassManager(
        [ApplyUpdates(updates)], copy=False, name="remat", dump_after=dump_after
    ).run(gm)


@dataclass(frozen=True)
class UpdatesPlan(Plan):
    # (output position, gradient node, the node the update goes after)
    sites: tuple[tuple[int, fx.Node, fx.Node], ...] = ()


class ApplyUpdates(Pass[UpdatesPlan]):
    """Call each gradient's update right after its parameter's last reader; return None
    for the gradient. Refuses (PassError) an output position that is not a node and a
    parameter name that is not a placeholder."""

    name = "apply-updates"
    description = "apply each parameter's optimizer update in the backward, then free its gradient"

    def __init__(self, updates: Mapping[int, tuple[str, Callable]]):
        self.updates = dict(updates)

    def analyze(self, gm: fx.GraphModule) -> UpdatesPlan:
        graph = gm.graph
        outs = list(graph.output_node().args[0])
        position = {node: i for i, node in enumerate(graph.nodes)}
        placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
        sites = []
        for index, (name, _) in sorted(self.updates.items()):
            grad = outs[index] if index < len(outs) else None
            if not isinstance(grad, fx.Node):
                raise PassError(self.name, f"output {index} is not a gradient node ({grad!r})")
            param = placeholders.get(name)
            if param is None:
                raise PassError(self.name, f"no parameter placeholder named '{name}'")
            anchor = max(_readers(gm, param) | {grad}, key=position.__getitem__)
            sites.append((index, grad, anchor))
        return UpdatesPlan((), tuple(sites))

    def transform(self, gm: fx.GraphModule, plan: UpdatesPlan) -> PassResult:
        graph = gm.graph
        output = graph.output_node()
        outs = list(output.args[0])
        for index, grad, anchor in plan.sites:
            with graph.inserting_after(anchor):
                node = graph.call_function(self.updates[index][1], (grad,))
            node.meta[PHASE] = BACKWARD
            outs[index] = None
        output.args = (tuple(outs),)
        return PassResult(bool(plan.sites), {"updates": len(plan.sites)})


def _readers(gm: fx.GraphModule, param: fx.Node) -> set[fx.Node]:
    """Every node that reads ``param`` or a view of it."""
    table = ops.table(gm)
    storage, readers = {param}, set()
    for node in gm.graph.nodes:
        inputs = set(node.all_input_nodes)
        if node.op == "output" or not inputs & storage:
            continue
        readers.add(node)
        if table.info[node].view:
            storage.add(node)
    return readers
