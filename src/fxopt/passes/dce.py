"""Dead-code elimination: remove computations whose results nobody uses.

    a = relu(x)
    b = sigmoid(x)   ← unused      a = relu(x)
    return a                  →    return a

Only nodes the op table calls removable go: known, pure, not random, not stateful. Kept even
when unused, with the reason in the plan: in-place and ``out=`` calls (``x.mul_(2)``,
``F.relu(x, inplace=True)``, ``torch.add(a, b, out=buf)``), training-mode BatchNorm (its
running-stat update is the point), random ops (removing one shifts the random numbers every
later random op draws), and unknown ops. Placeholders stay (the signature must not change);
unused ``get_attr`` nodes go, but the attributes stay on the module so ``state_dict`` keys
are unchanged.

Unlike ``torch.fx.Graph.eliminate_dead_code``, which trusts ``Node.is_impure`` and deletes
an unused ``x.mul_(2)`` or a training-mode BatchNorm call, this pass asks ``fxopt.ir.ops``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.passes.base import Pass, PassResult, Plan, Skip


@dataclass(frozen=True)
class DcePlan(Plan):
    #: Nodes to erase, users before producers (reverse graph order).
    dead: tuple[fx.Node, ...] = ()


class DeadCodeElimination(Pass[DcePlan]):
    name = "dce"
    description = "remove unused pure computations (keeps in-place, random and stateful ops)"
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing

    def analyze(self, gm: fx.GraphModule) -> DcePlan:
        dead: dict[fx.Node, None] = {}
        skipped: list[Skip] = []
        table = AliasAnalysis.of(gm).info  # the op table's answers, shared with other passes
        dead_nodes = dead.keys()
        for node in reversed(gm.graph.nodes):
            if node.op in ("placeholder", "output"):
                continue
            if not node.users.keys() <= dead_nodes:  # a live user (a set test in C)
                continue
            op = table[node]
            if node.op == "get_attr" or op.removable:
                dead[node] = None
            else:
                skipped.append(Skip(node.name, f"unused but kept: {_reason_to_keep(op)}"))
        skipped.reverse()
        return DcePlan(skipped=tuple(skipped), dead=tuple(dead))

    def transform(self, gm: fx.GraphModule, plan: DcePlan) -> PassResult:
        for node in plan.dead:
            gm.graph.erase_node(node)
        # Erasing unused pure nodes keeps the alias analysis sound for the nodes that
        # remain: no writer goes, positions keep their order, and a class can only be
        # larger than a fresh analysis would make it (conservative).
        return PassResult(
            changed=bool(plan.dead),
            stats={"removed": len(plan.dead)},
            skipped=plan.skipped,
            keeps=("alias",),
        )

    def verify(self, gm: fx.GraphModule) -> None:
        left = [n.name for n in self.analyze(gm).dead]
        assert not left, f"unused removable nodes left after dce: {left[:8]}"


def _reason_to_keep(op: ops.OpInfo) -> str:
    if not op.known:  # first: an unknown op is also marked as writing all its inputs
        return f"unknown op '{op.name}' (assumed to have side effects)"
    if op.inplace:
        return f"'{op.name}' writes into its input"
    if op.stateful:
        return f"'{op.name}' updates module state (e.g. BatchNorm running statistics)"
    if op.random:
        return f"'{op.name}' is random: removing it would shift later random numbers"
    return f"'{op.name}' has side effects"
