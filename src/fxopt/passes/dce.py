"""Dead-code elimination: remove computations whose results nobody uses.

    a = relu(x)
    b = sigmoid(x)   ← unused      a = relu(x)
    return a                  →    return a

Only nodes the op table calls removable go: known, pure, not random, not stateful. Kept even
when unused, with the reason in the plan: in-place and ``out=`` calls (``x.mul_(2)``,
``F.relu(x, inplace=True)``, ``torch.add(a, b, out=buf)``) unless what they write is a
fresh result of the graph's own that nothing else reads (torch.export's
``detach_(lift_fresh_copy(constant))``), training-mode BatchNorm (its
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

from fxopt.ir.safety import Safety
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
        safety = Safety(gm)
        dead: dict[fx.Node, None] = {}
        while True:  # again while a sweep finds more: a dead reader after an in-place
            # write into a fresh value is found only after that write was visited
            skipped = self._sweep(gm, safety, dead)
            if not any(self._removable(n, safety, dead) for n in gm.graph.nodes):
                break
        ordered = tuple(n for n in reversed(gm.graph.nodes) if n in dead)
        return DcePlan(skipped=tuple(skipped), dead=ordered)

    @staticmethod
    def _removable(node: fx.Node, safety: Safety, dead: dict) -> bool:
        return (
            node not in dead
            and node.op not in ("placeholder", "output")
            and node.users.keys() <= dead.keys()
            and safety.why_not_remove(node, dead) is None
        )

    @staticmethod
    def _sweep(gm: fx.GraphModule, safety: Safety, dead: dict) -> list[Skip]:
        """One pass over the graph, users before producers, adding to ``dead``; returns
        the unused nodes kept, with the reason."""
        skipped: list[Skip] = []
        for node in reversed(gm.graph.nodes):
            if node in dead:
                continue
            if node.op in ("placeholder", "output") or not node.users.keys() <= dead.keys():
                continue  # the signature stays; or a live user (a set test in C)
            reason = safety.why_not_remove(node, dead)
            if reason is None:
                dead[node] = None
            else:
                skipped.append(Skip(node.name, f"unused but kept: {reason}"))
        skipped.reverse()
        return skipped

    def transform(self, gm: fx.GraphModule, plan: DcePlan) -> PassResult:
        for node in plan.dead:
            gm.graph.erase_node(node)
        # Erasing unused pure nodes keeps the shared analyses sound for the nodes that
        # remain: no writer goes, positions keep their order, and a storage class can only
        # be larger than a fresh analysis would make it (conservative).
        return PassResult(
            changed=bool(plan.dead),
            stats={"removed": len(plan.dead)},
            skipped=plan.skipped,
            keeps=("ops", "alias"),
        )

    def verify(self, gm: fx.GraphModule) -> None:
        left = [n.name for n in self.analyze(gm).dead]
        assert not left, f"unused removable nodes left after dce: {left[:8]}"
