"""joint-cse: merge a joint graph's repeated computations before it is planned, as torch's
min-cut partitioner does first (AOTAutograd's ``cse`` option, on by default).

The backward AOTAutograd traces repeats work: BatchNorm's decomposed backward computes
``x - mean`` twice per layer. Partitioned without this, both copies ran in the backward,
and a recomputed op could repeat once more what the backward computed anyway. Random ops
are never merged (torch's ``fx_graph_cse`` leaves them); dead code goes first.

    a = sub(x, mean) ── mul(a, 2) ─┐            a = sub(x, mean) ── mul(a, 2) ─┐
    b = sub(x, mean) ── mul(b, 3) ─┴ add   →                  └─── mul(a, 3) ─┴ add

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.passes import PassManager
    >>> aten = torch.ops.aten
    >>> def joint(x, mean):
    ...     a = aten.mul.Tensor(aten.sub.Tensor(x, mean), 2.0)
    ...     return aten.add.Tensor(a, aten.mul.Tensor(aten.sub.Tensor(x, mean), 3.0))
    >>> gm = fx.symbolic_trace(joint)
    >>> PassManager([JointCSE()], copy=False).run(gm).records[0].stats
    {'merged': 1}
"""

from __future__ import annotations

from torch import fx

from fxopt.passes.base import Pass, PassResult, Plan


class JointCSE(Pass[Plan]):
    """torch's ``fx_graph_cse`` (when ``torch._functorch.config.cse``) after dead code
    elimination. torch's function searches and rebuilds the graph at once, so the plan is
    empty and the transform replaces ``gm.graph``."""

    name = "joint-cse"
    description = "merge a joint graph's repeated computations, as torch's min-cut does"

    def analyze(self, gm: fx.GraphModule) -> Plan:
        return Plan()

    def transform(self, gm: fx.GraphModule, plan: Plan) -> PassResult:
        from torch._functorch import config as functorch_config
        from torch._functorch.compile_utils import fx_graph_cse

        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        dead = before - len(gm.graph.nodes)
        if functorch_config.cse:
            gm.graph = fx_graph_cse(gm.graph)
        merged = before - dead - len(gm.graph.nodes)
        stats = {"merged": merged, **({"dead": dead} if dead else {})}
        return PassResult(bool(dead or merged), stats)
