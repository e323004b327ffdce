"""Write a rule over three nodes: a transpose, an elementwise op, the transpose back.

    y = x.transpose(a, b); z = relu(y); out = z.transpose(a, b)      →      out = relu(x)

An elementwise op commutes with any permutation of its input, so the two transposes cancel.
The rule says what it matches (a pattern), when not (``check``) and what replaces the match
(``build``). The rule engine does the rest, the same for every rule: it leaves a match whose
inner nodes are read elsewhere or returned (the transposed value would be computed twice),
refuses nodes that are more than their value (in place, random), and records why.
"""

import torch

from fxopt import GraphOptimizer
from fxopt.ir import meta, ops
from fxopt.ir.pattern import Op, Var
from fxopt.passes.rules import Rule, RulePass


class CancelTransposesAroundElementwise(Rule):
    """transpose(f(transpose(x))) → f(x) for an elementwise f, when the two cancel."""

    name, stat = "transposes around an elementwise op", "cancelled"
    transpose = ("transpose", "permute")  # torch.export spells x.transpose(0, 1) as permute
    pattern = Op(
        transpose,
        input=Op(
            ("relu", "sigmoid", "tanh"), input=Op(transpose, input=Var("x"), bind="inner"), bind="f"
        ),
    )

    def check(self, match):
        rank = meta.rank(match["x"])
        if rank is None:
            return "the rank is not known"
        inner, outer = _order(match["inner"], rank), _order(match.root, rank)
        cancel = [inner[i] for i in outer] == list(range(rank))
        return None if cancel else "the transposes do not cancel"

    def build(self, graph, match):
        return ops.emit(graph, ops.info(match["f"]).name, match["x"], like=match.root)


def _order(node, rank):
    """The dimension order a transpose or permute node gives its input."""
    args = ops.args(node)
    if "dims" in args:
        return [d % rank for d in args["dims"]]
    order, a, b = list(range(rank)), args["dim0"] % rank, args["dim1"] % rank
    order[a], order[b] = order[b], order[a]
    return order


class CancelTransposes(RulePass):
    name = "cancel-transposes"
    description = "transpose(f(transpose(x))) → f(x) for an elementwise f"
    counters = ("cancelled",)
    rules = (CancelTransposesAroundElementwise(),)


if __name__ == "__main__":

    class Block(torch.nn.Module):
        def forward(self, x):
            kept = x.transpose(0, 1).relu().transpose(0, 1)  # rewritten
            t = x.transpose(0, 1)
            shared = t.sigmoid()  # its transposed input is also returned: left alone
            return kept, shared.transpose(0, 1), t

    x = torch.randn(3, 4)
    for mode in ("fx", "export"):  # verified against the original on both levels
        optimizer = GraphOptimizer(Block(), x, mode=mode)
        gm = optimizer.optimize(passes=[CancelTransposes(), "dce"])
        record = optimizer.pipeline.records[0]
        print(f"[{mode}]", "stats:", record.stats, "skipped:", [str(s) for s in record.skipped])
