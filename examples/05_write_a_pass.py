"""Write a pass: replace `x * 2` by `x + x`, with a reason for every site left alone.

The same rule works on both capture levels: `ops.args` reads the operands of `x * 2`,
`torch.mul(x, 2)`, `x.mul(2)` and `aten.mul.Tensor(x, 2)` by name, and `ops.emit` builds
the `add` in the spelling of the graph it goes into.
"""

import torch

from fxopt import GraphOptimizer
from fxopt.ir import ops
from fxopt.passes import Rewrite


class MulByTwoToAdd(Rewrite):
    """x -- mul(·, 2) -- y      →      x -- add(x, x) -- y"""

    name, op = "mul2-to-add", "mul"
    description = "rewrite x * 2 as x + x"

    def check(self, node, args):
        return None if args.get("other") == 2 else "not a multiplication by 2"

    def rewrite(self, graph, node, args):
        return ops.emit(graph, "add", args["input"], args["input"], like=node)


if __name__ == "__main__":
    x = torch.randn(3, 4)

    class Doubler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x) * 2 + x.mul(3)

    for mode in ("fx", "export"):  # verified against the original on both levels
        optimizer = GraphOptimizer(Doubler(), x, mode=mode)
        gm = optimizer.optimize(passes=[MulByTwoToAdd(), "dce"])
        record = optimizer.pipeline.records[0]
        print(f"[{mode}]", "stats:", record.stats, "skipped:", [str(s) for s in record.skipped])
    print(gm.code.strip())
