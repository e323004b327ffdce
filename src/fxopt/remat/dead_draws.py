"""remove-dead-draws: the random ops nothing in a partitioned backward reads, and what only
they read, removed.

``default_partition`` copies into the backward every forward op its inputs allow and then
drops what nothing reads, but a random op counts as impure (kept) unless a Dynamo compile
is running (``TracingContext``, with Inductor's ``fallback_random`` off). A chain's graph
compiled again at its first real call runs outside one: the backward then drew each
replayed dropout's original mask a second time, recomputed all the forward before it to do
so (a BERT layer's six matmuls twice), and moved the generator, so later steps' masks were
not the job's without remat. Ops with other effects (``copy_``) stay.

    mul(x, 2) ── bernoulli(·, 0.5)   (read by nothing)       →   (gone)

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.passes import PassManager
    >>> aten = torch.ops.aten
    >>> def backward(x, grad):
    ...     aten.bernoulli.p(aten.mul.Tensor(x, 2.0), 0.5)
    ...     return aten.add.Tensor(grad, 1.0)
    >>> gm = fx.symbolic_trace(backward)
    >>> PassManager([RemoveDeadDraws()], copy=False).run(gm).records[0].stats
    {'removed': 2}
"""

from __future__ import annotations

from torch import fx

from fxopt.passes.base import Pass, PassResult, Plan


class RemoveDeadDraws(Pass[Plan]):
    """fx's dead code elimination with random ops counted as pure (torch's function finds
    and erases at once: the plan is empty)."""

    name = "remove-dead-draws"
    description = "remove the random ops nothing in a partitioned backward reads"

    def analyze(self, gm: fx.GraphModule) -> Plan:
        return Plan()

    def transform(self, gm: fx.GraphModule, plan: Plan) -> PassResult:
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code(
            is_impure_node=lambda node: node.is_impure(impure_random=False)
        )
        removed = before - len(gm.graph.nodes)
        return PassResult(bool(removed), {"removed": removed})
