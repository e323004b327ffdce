"""detach-input-writes / restore-input-writes: AOTAutograd's buffer writes, set aside while
the compile backend plans a joint graph.

AOTAutograd's joint graph is functional but for a trailing epilogue of
``copy_(input, new_value)`` nodes (BatchNorm's running statistics). Taken out, alias
analysis sees a pure graph, so nothing is refused recomputation for reading an input
written later; each written input that something reads is read through a clone taken
before the forward writes it (so a value recomputed in the backward reads the old
statistics). Put back before partitioning, the copies are as AOTAutograd wrote them, and a
clone only the forward reads is dropped again:

    forward ── copy_(running_mean, new_mean) ── output
    clone(running_mean) ── forward (reads the clone) ── output      (while planning)

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.passes import PassManager
    >>> aten = torch.ops.aten
    >>> def joint(x, mean):
    ...     out = aten.mul.Tensor(x, mean)
    ...     aten.copy_.default(mean, aten.add.Tensor(mean, aten.mul.Tensor(x, 0.1)))
    ...     return (out,)
    >>> gm = fx.symbolic_trace(joint)
    >>> writes = InputWrites()
    >>> _ = PassManager([DetachInputWrites(writes)], copy=False).run(gm)
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'mean', 'clone_default', 'mul_tensor', 'mul_tensor_1', 'add_tensor', 'output']
    >>> _ = PassManager([RestoreInputWrites(writes)], copy=False).run(gm)
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'mean', 'mul_tensor', 'mul_tensor_1', 'add_tensor', 'copy__default_1', 'output']
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from fxopt.ir import ops
from fxopt.passes.base import Pass, PassResult, Plan
from fxopt.remat.tags import BACKWARD, MUST_SAVE, phase


@dataclass
class InputWrites:
    """The epilogue a :class:`DetachInputWrites` took out, for :class:`RestoreInputWrites`."""

    #: (written placeholder, new value, the copy's op, the copy's meta), in graph order.
    copies: list[tuple[fx.Node, fx.Node, object, dict]] = field(default_factory=list)
    #: Written placeholder -> the clone its readers read instead.
    clones: dict[fx.Node, fx.Node] = field(default_factory=dict)

    @property
    def sources(self) -> list[fx.Node]:
        """The new values: forward values, though no forward output depends on them."""
        return [source for _, source, _, _ in self.copies]


@dataclass(frozen=True)
class EpiloguePlan(Plan):
    copies: tuple[fx.Node, ...] = ()  # in graph order


class DetachInputWrites(Pass[EpiloguePlan]):
    """Take the ``copy_`` epilogue out of a joint graph into ``writes``; read each written
    input that something reads through a clone taken first (marked never to recompute)."""

    name = "detach-input-writes"
    description = "set AOTAutograd's buffer writes aside while a joint graph is planned"

    def __init__(self, writes: InputWrites):
        self.writes = writes

    def analyze(self, gm: fx.GraphModule) -> EpiloguePlan:
        epilogue = []
        node = gm.graph.output_node().prev
        while (
            ops.aten_name(node) == "copy_" and not node.users and node.args[0].op == "placeholder"
        ):
            epilogue.append(node)
            node = node.prev
        return EpiloguePlan(copies=tuple(reversed(epilogue)))

    def transform(self, gm: fx.GraphModule, plan: EpiloguePlan) -> PassResult:
        graph, writes = gm.graph, self.writes
        for copy in plan.copies:
            writes.copies.append((copy.args[0], copy.args[1], copy.target, dict(copy.meta)))
            graph.erase_node(copy)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for target in dict.fromkeys(t for t, _, _, _ in writes.copies):
            if not target.users:
                continue
            with graph.inserting_before(first):
                clone = ops.emit(graph, "clone", target)
            clone.meta.update({k: v for k, v in target.meta.items() if k in ("val", "tensor_meta")})
            clone.meta["partitioner_tag"] = "is_forward"
            clone.meta[MUST_SAVE] = (
                f"the value of '{target.name}' before the forward writes into it"
            )
            for user in [u for u in target.users if u is not clone]:
                user.replace_input_with(target, clone)
            writes.clones[target] = clone
        return PassResult(bool(plan.copies), {"writes": len(plan.copies)})

    def verify(self, gm: fx.GraphModule) -> None:
        assert not self.analyze(gm).copies, "a copy_ epilogue is left in the graph"


@dataclass(frozen=True)
class RestorePlan(Plan):
    dropped: tuple[tuple[fx.Node, fx.Node], ...] = ()  # (placeholder, its unneeded clone)


class RestoreInputWrites(Pass[RestorePlan]):
    """Put the copies ``writes`` holds back at the end; read the inputs directly where only
    the forward reads them (before the writes)."""

    name = "restore-input-writes"
    description = "put AOTAutograd's buffer writes back before a joint graph is partitioned"

    def __init__(self, writes: InputWrites):
        self.writes = writes

    def analyze(self, gm: fx.GraphModule) -> RestorePlan:
        dropped = tuple(
            (target, clone)
            for target, clone in self.writes.clones.items()
            if all(phase(user) != BACKWARD for user in clone.users)
        )
        return RestorePlan(dropped=dropped)

    def transform(self, gm: fx.GraphModule, plan: RestorePlan) -> PassResult:
        graph = gm.graph
        for target, clone in plan.dropped:
            clone.replace_all_uses_with(target)
            graph.erase_node(clone)
        output = graph.output_node()
        for target, source, op, meta in self.writes.copies:
            with graph.inserting_before(output):
                copy = graph.call_function(op, (target, source))
            copy.meta = meta
        changed = bool(plan.dropped or self.writes.copies)
        return PassResult(changed, {"writes": len(self.writes.copies)})
