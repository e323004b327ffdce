"""Fold computations that depend only on constants: compute them once, store the result.

    W -- t() -- reshape(...) -- matmul(x, ·)          W' -- matmul(x, ·)
                                               →      (W' = W.t().reshape(...), a buffer)

A node is constant when it is a known, pure, non-random call whose every input is a
constant: an attribute (``get_attr``: buffers, tensor constants, and parameters when
``include_parameters=True``), or a call with no tensor inputs at all (``torch.ones(3)``).
The pass evaluates each *frontier* constant (one whose value is used by a non-constant
node or returned) once, stores it as a buffer ``_fxopt_const_N`` and reads it with a
``get_attr``; the constant subgraph behind it is erased, and attributes nothing reads any
more are deleted from the module.

Parameters count as constants only for inference: after folding, a gradient no longer
reaches a parameter through the folded path. Inference pipelines (``speed``) fold them;
``FoldConstants(include_parameters=False)`` folds only buffers and literals.

Never constant: a value whose storage is written in place anywhere in the graph (per
:class:`~fxopt.ir.alias.AliasAnalysis`: ``self.buf.add_(1)``, or export's ``copy_`` back into
a mutated buffer), and anything computed from it: folding would freeze the value of one call.

Skipped, with the reason: new tensors over ``max_bytes`` (default 16 MiB, so a constant
``repeat`` is not materialized into a huge buffer; a view of an attribute has no cap),
results returned by the graph (the caller would get the module's buffer itself, and could
write into it), non-tensor results, and evaluation failures. A folded view of an
attribute (``W.t()``) is stored as that view: it reads the model's weight, and costs no
memory. ``state_dict`` changes: new
``_fxopt_const_N`` buffers appear, and parameters/buffers read only by folded code disappear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from fxopt.ir import attributes, ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.ir.weights import note_derived, storage_key
from fxopt.passes.base import Pass, PassResult, Plan, Skip

DEFAULT_MAX_BYTES = 16 * 2**20  # large enough for any folded weight transpose we have seen


@dataclass(frozen=True)
class ConstantFoldPlan(Plan):
    #: (frontier node, its value) in graph order.
    folds: tuple[tuple[fx.Node, torch.Tensor], ...] = ()


class FoldConstants(Pass[ConstantFoldPlan]):
    name = "fold-constants"
    description = "compute constant-only subgraphs once and store them as buffers"
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing
    # Neither gives a node new constant inputs or a new non-constant user: dce erases only
    # unused pure nodes, and cse merges a node into one with the same inputs (so the same
    # constness, value and skip reason).
    not_enabled_by = ("cse", "dce")

    def __init__(self, include_parameters: bool = True, max_bytes: int = DEFAULT_MAX_BYTES):
        self.include_parameters = include_parameters
        self.freezes_parameters = include_parameters
        self.max_bytes = max_bytes

    def analyze(self, gm: fx.GraphModule) -> ConstantFoldPlan:
        constant = self._constant_nodes(gm)
        frontier = [
            n
            for n in gm.graph.nodes
            if n in constant and n.op != "get_attr" and any(u not in constant for u in n.users)
        ]
        if not frontier:
            return ConstantFoldPlan()
        values = _evaluate(gm, constant, frontier)
        folds: list[tuple[fx.Node, torch.Tensor]] = []
        skipped: list[Skip] = []
        for node in frontier:
            value = values.get(node)
            if _is_returned(gm, node):
                skipped.append(
                    Skip(
                        node.name,
                        "returned: the caller would get the folded "
                        "buffer itself, and could write into it",
                    )
                )
            elif isinstance(value, BaseException):
                skipped.append(Skip(node.name, f"evaluation failed: {value}"))
            elif not isinstance(value, torch.Tensor):
                skipped.append(Skip(node.name, f"result is a {type(value).__name__}, not a tensor"))
            elif self._over_cap(gm, node, value):
                size = _describe_bytes(value.numel() * value.element_size())
                skipped.append(
                    Skip(
                        node.name,
                        f"result is {size}, over the {_describe_bytes(self.max_bytes)} cap",
                    )
                )
            else:
                folds.append((node, value))
        return ConstantFoldPlan(skipped=tuple(skipped), folds=tuple(folds))

    def _over_cap(self, gm: fx.GraphModule, node: fx.Node, value: torch.Tensor) -> bool:
        # A view of an attribute (an LM head's W.t(), 62.5 MiB for Llama's vocabulary)
        # costs no memory, so no cap: left unfolded, the kernel passes would not know it
        # for a weight, and it would run as a plain mm against a transposed weight.
        too_big = value.numel() * value.element_size() > self.max_bytes
        return too_big and not _is_view_of_attribute(gm, node, value)

    def _constant_nodes(self, gm: fx.GraphModule) -> set[fx.Node]:
        constant: set[fx.Node] = set()
        alias = AliasAnalysis.of(gm)
        info = alias.info
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = attributes.get(gm, str(node.target), None)
                is_parameter = isinstance(value, nn.Parameter)
                if not isinstance(value, torch.Tensor) or (
                    is_parameter and not self.include_parameters
                ):
                    continue
            else:
                op = info[node]
                if not (op.compute and op.removable) or node.op == "call_module":
                    continue
                if op.name in ("size", "getattr"):
                    continue  # metadata queries: folding saves nothing
                if not constant.issuperset(ops.input_nodes(node)):
                    continue
            if not alias.is_written(node):
                # (Written: self.buf.add_(1), or export's copy_ into a buffer. The value
                # changes from call to call; folding would freeze the one seen now.)
                constant.add(node)
        return constant

    def transform(self, gm: fx.GraphModule, plan: ConstantFoldPlan) -> PassResult:
        touched_attributes: set[str] = set()
        sources: list[torch.Tensor | None] = []
        for node, value in plan.folds:
            name = attributes.free_name(gm, "_fxopt_const", numbered=True)
            # Stored as computed: a fresh tensor, or a view of the attribute it was computed
            # from (W.t()), which then costs no memory (a copy would hold the weight twice
            # beside the model). Never written: written values are not constant.
            gm.register_buffer(name, value.detach())
            if not _is_view_of_attribute(gm, node, value):
                # A new tensor: it does not follow its sources any more (fxopt.ir.weights).
                sources += [
                    attributes.get(gm, str(n.target), None)
                    for n in _constant_ancestors(node)
                    if n.op == "get_attr"
                ]
            with gm.graph.inserting_before(node):
                replacement = gm.graph.get_attr(name)
            replacement.meta.update(node.meta)
            for source in _constant_ancestors(node):
                if source.op == "get_attr":
                    touched_attributes.add(str(source.target))
            node.replace_all_uses_with(replacement)
        note_derived(gm, sources, by=self.name)
        erased = _erase_dead_constants(gm, [n for n, _ in plan.folds])
        deleted = _delete_unread_attributes(gm, touched_attributes)
        stats = {"folded": len(plan.folds), "erased": erased, "attributes_deleted": deleted}
        return PassResult(bool(plan.folds), stats, plan.skipped)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [n.name for n, _ in self.analyze(gm).folds]
        assert not left, f"foldable constants left: {left[:8]}"


def _is_view_of_attribute(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor) -> bool:
    """``value`` (``node``'s folded value) reads the memory of one of the attributes it was
    computed from: a view, which follows that attribute's changes."""
    key = storage_key(value)
    return key is not None and any(
        storage_key(attribute) == key
        for n in _constant_ancestors(node)
        if n.op == "get_attr"
        and isinstance(attribute := attributes.get(gm, str(n.target), None), torch.Tensor)
    )


def _is_returned(gm: fx.GraphModule, node: fx.Node) -> bool:
    """True when ``node``'s value, or a view of it, is an output of the graph."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                return True
            if ops.is_compute(user) and ops.info(user, gm).view:
                stack.append(user)
    return False


def _describe_bytes(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count} bytes"


def _evaluate(gm: fx.GraphModule, constant: set[fx.Node], wanted: list[fx.Node]) -> dict:
    """Values of the ``wanted`` constant nodes (an exception object where one fails)."""
    needed: set[fx.Node] = set()
    stack = list(wanted)
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    env: dict[fx.Node, object] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node not in needed:
                continue
            if any(isinstance(env.get(a), BaseException) for a in node.all_input_nodes):
                env[node] = RuntimeError("an input failed")
                continue
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            try:
                if node.op == "get_attr":
                    env[node] = attributes.get(gm, str(node.target), None)
                elif node.op == "call_function":
                    env[node] = node.target(*args, **kwargs)
                elif node.op == "call_method":
                    self_value, *rest = args
                    env[node] = getattr(self_value, str(node.target))(*rest, **kwargs)
            except Exception as error:  # report it as a skip, don't fail the pipeline
                env[node] = error
    return {node: env.get(node) for node in wanted}


def _constant_ancestors(node: fx.Node) -> list[fx.Node]:
    seen: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen[current] = None
            stack.extend(current.all_input_nodes)
    return list(seen)


def _erase_dead_constants(gm: fx.GraphModule, roots: list[fx.Node]) -> int:
    """Erase the folded nodes and the constant nodes that only fed them."""
    erased = 0
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        # A constant feeding two folded nodes is pushed twice: erase it once.
        gone = node.graph is not gm.graph or getattr(node, "_erased", False)
        if gone or node.users or node.op in ("placeholder", "output"):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        erased += 1
        stack.extend(inputs)
    return erased


def _delete_unread_attributes(gm: fx.GraphModule, targets: set[str]) -> int:
    if not targets:
        return 0  # nothing was folded: no need to walk the graph
    read = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    called = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    deleted = 0
    for target in sorted(targets - read):
        owner_path, _, attribute = target.rpartition(".")
        if any(c == owner_path or owner_path.startswith(c + ".") for c in called if owner_path):
            continue  # the owning module still runs and may read it
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if hasattr(owner, attribute):
            delattr(owner, attribute)
            deleted += 1
    return deleted
