"""Write a pass: replace `x * 2` by `x + x`, with a reason for every site left alone."""

import operator
from dataclasses import dataclass

import torch
from torch import fx

from fxopt import GraphOptimizer
from fxopt.ir import ops
from fxopt.passes import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class DoublePlan(Plan):
    sites: tuple[fx.Node, ...] = ()


class MulByTwoToAdd(Pass[DoublePlan]):
    """Rewrite ``mul(x, 2)`` as ``add(x, x)``.

    x -- mul(·, 2) -- y      →      x -- add(x, x) -- y
    """

    name = "mul2-to-add"
    description = "rewrite x * 2 as x + x"

    def analyze(self, gm):
        sites, skipped = [], []
        for node in ops.calls(gm, "mul"):
            if node.op == "call_function" and len(node.args) == 2 and node.args[1] == 2:
                sites.append(node)
            else:
                skipped.append(Skip(node.name, "not a call_function multiplying by 2"))
        return DoublePlan(skipped=tuple(skipped), sites=tuple(sites))

    def transform(self, gm, plan):
        for node in plan.sites:
            node.target, node.args = operator.add, (node.args[0], node.args[0])
        return PassResult(changed=bool(plan.sites), stats={"rewritten": len(plan.sites)})

    def verify(self, gm):
        assert not self.analyze(gm).sites, "a mul by 2 survived"


if __name__ == "__main__":
    x = torch.randn(3, 4)

    class Doubler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) * 2 + x.mul(3)

    optimizer = GraphOptimizer(Doubler(), x)
    gm = optimizer.optimize(passes=[MulByTwoToAdd(), "dce"])  # verified against the original
    record = optimizer.pipeline.records[0]
    print(gm.code.strip())
    print("stats:", record.stats, "skipped:", [str(s) for s in record.skipped])
