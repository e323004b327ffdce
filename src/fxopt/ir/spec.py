"""Named graph invariants: what a legal graph is at each stage, as data.

An invariant is a name and a check that returns the list of problems it found (empty when
the graph is legal). Passes declare the invariants they need (``Pass.requires``); the
:class:`~fxopt.passes.PassManager` checks them between passes and raises
:class:`~fxopt.errors.InvariantError` naming the invariant and the offending nodes.

    >>> import torch
    >>> from fxopt.ir import spec
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> spec.check(gm, "well-formed")   # raises InvariantError when broken
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import fx

from fxopt.errors import InvariantError
from fxopt.ir import ops
from fxopt.ir.guard import GUARD_NAME


@dataclass(frozen=True)
class Invariant:
    name: str
    description: str
    find_problems: Callable[[fx.GraphModule], list[str]]


_OPCODES = frozenset(
    ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")
)
_MAX_PROBLEMS = 10


# One pass over the nodes checks every rule: split by rule, it would walk a 100k-node
# graph several times.
def _well_formed(gm: fx.GraphModule) -> list[str]:  # noqa: C901
    """What ``Graph.lint`` checks, in one loop, listing problems instead of raising.

    The pipeline checks this after every pass that changed the graph, so on 100k nodes
    lint's cost counted: it resolves every attribute target from the root through
    ``nn.Module.__getattr__`` and builds an input list per node. Here module lookups are
    remembered per prefix, the common case costs a few dict lookups per node, and the walk
    stops after ten problems.
    """
    graph = gm.graph
    defined: set[fx.Node] = set()
    problems: list[str] = []
    resolved: dict[str, object] = {"": gm}
    top_modules = gm._modules  # most call_module targets are top-level names
    names: set[str] = set()
    define, name_seen = defined.add, names.add
    count = 0
    for node in graph.nodes:
        count += 1
        name_seen(node.name)
        op, target = node.op, node.target
        if node.graph is not graph:
            problems.append(f"{node.name} belongs to another graph")
        for arg in ops.input_nodes(node):
            if arg not in defined:
                where = "another graph" if arg.graph is not graph else "a later position"
                problems.append(f"{node.name} uses '{arg.name}' before it is defined ({where})")
        define(node)
        if op == "call_function":
            if not callable(target):
                problems.append(f"{node.name}: target {target!r} is not callable")
        elif op not in _OPCODES:
            problems.append(f"{node.name} has unknown opcode '{op}'")
        elif not isinstance(target, str):
            problems.append(f"{node.name}: target {target!r} is not a string")
        elif op == "call_module" and top_modules.get(target) is None:
            # (A top-level name found is a module: add_module admits nothing else.)
            value = _attribute(resolved, target)
            if value is None:
                problems.append(f"{node.name}: '{target}' does not exist on the module")
            elif not isinstance(value, torch.nn.Module):
                problems.append(f"{node.name}: '{target}' is not a submodule")
        elif op == "get_attr" and _attribute(resolved, target) is None:
            problems.append(f"{node.name}: '{target}' does not exist on the module")
        if len(problems) >= _MAX_PROBLEMS:
            return problems[:_MAX_PROBLEMS]
    if len(names) != count:  # rare: find which names repeat
        seen: set[str] = set()
        for node in graph.nodes:
            if node.name in seen:
                problems.append(f"the name '{node.name}' is used twice")
            seen.add(node.name)
    return problems[:_MAX_PROBLEMS]


def _attribute(resolved: dict[str, object], target: str) -> object | None:
    """``root.<target>`` or None, remembering every prefix resolved on the way."""
    value = resolved.get(target)
    if value is not None:
        return value
    prefix, _, last = target.rpartition(".")
    owner = _attribute(resolved, prefix) if prefix else resolved[""]
    if owner is None:
        return None
    if isinstance(owner, torch.nn.Module):
        # The three registries first: nn.Module.__getattr__ searches them the slow way.
        for registry in (owner._modules, owner._parameters, owner._buffers):
            value = registry.get(last)
            if value is not None:
                break
    if value is None:
        value = getattr(owner, last, None)
    if value is not None:
        resolved[target] = value
    return value


def _has_shapes(gm: fx.GraphModule) -> list[str]:
    return [
        f"{node.name} has no shape metadata"
        for node in gm.graph.nodes
        if ops.is_compute(node) and "val" not in node.meta and "tensor_meta" not in node.meta
    ]


def _functional(gm: fx.GraphModule) -> list[str]:
    return [
        f"{node.name} ({ops.info(node, gm).name}) writes into its input"
        for node in gm.graph.nodes
        if ops.is_compute(node) and ops.info(node, gm).inplace
    ]


def _single_output(gm: fx.GraphModule) -> list[str]:
    outputs = [n.name for n in gm.graph.nodes if n.op == "output"]
    return [] if len(outputs) == 1 else [f"{len(outputs)} output nodes: {outputs}"]


def _core_aten(gm: fx.GraphModule) -> list[str]:
    # Circle lowering reads ATen schemas: only ATen overloads and tuple access (getitem).
    import operator

    return [
        f"{node.name} ({node.op} {node.target}) is not an ATen op"
        for node in gm.graph.nodes
        if ops.is_compute(node)
        and not (
            node.op == "call_function"
            and (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem)
        )
    ]


_ATEN_TARGETS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
_RUNTIME_HELPER = "_fxopt_runtime_helper"


def runtime_helper(function: Callable) -> Callable:
    """Mark ``function`` as one of fxopt's runtime helpers (an RNG snapshot, a replay): a
    pass may call it in an ATen graph on purpose, so ``aten-level`` allows it."""
    setattr(function, _RUNTIME_HELPER, True)
    return function


def _aten_level(gm: fx.GraphModule) -> list[str]:
    # A graph torch.export captured stays one of ATen ops: a torch-level call on tensors
    # (operator.add, x.relu(), a module) in it is a pass that spelled a rewrite for the other
    # level. Python arithmetic on symbolic sizes (values that are not tensors) is allowed.
    import operator

    problems = []
    for node in gm.graph.nodes:
        if not ops.is_compute(node) or (node.op == "call_module" and node.target == GUARD_NAME):
            continue
        target = node.target
        if node.op == "call_function" and (
            isinstance(target, _ATEN_TARGETS)
            or target is operator.getitem
            or getattr(target, _RUNTIME_HELPER, False)
            or not _is_tensor_value(node.meta.get("val", node))
        ):
            continue
        spelled = getattr(target, "__name__", target)
        problems.append(f"{node.name} ({node.op} {spelled}) is a torch-level call in an ATen graph")
    return problems


def _is_tensor_value(value: object) -> bool:
    """True for a tensor, and for a node without a value (nothing says it is a size)."""
    return isinstance(value, (torch.Tensor, fx.Node))


def _inference_only(gm: fx.GraphModule) -> list[str]:
    # A Circle file is an inference graph: nothing random, stateful or writing in place.
    problems = []
    for node in gm.graph.nodes:
        if not ops.is_compute(node):
            continue
        op = ops.info(node, gm)
        if op.random or op.stateful or op.inplace:
            kind = "random" if op.random else "stateful" if op.stateful else "in-place"
            problems.append(f"{node.name} ({op.name}) is {kind}")
    return problems


INVARIANTS: dict[str, Invariant] = {
    inv.name: inv
    for inv in (
        Invariant("well-formed", "lint passes: topological order, no dangling uses", _well_formed),
        Invariant("single-output", "exactly one output node", _single_output),
        Invariant("has-shapes", "every compute node carries shape/dtype metadata", _has_shapes),
        Invariant("functional", "no node writes into an input (no in-place ops)", _functional),
        Invariant("core-aten", "every compute node is an ATen overload or getitem", _core_aten),
        Invariant(
            "aten-level", "no torch-level call on tensors (an export graph stays ATen)", _aten_level
        ),
        Invariant(
            "inference-only", "no random, stateful or in-place op (Circle stage)", _inference_only
        ),
    )
}


def check(gm: fx.GraphModule, *names: str) -> None:
    """Raise InvariantError for the first named invariant that ``gm`` breaks."""
    for name in names:
        invariant = get(name)
        problems = invariant.find_problems(gm)
        if problems:
            raise InvariantError(name, problems)


def get(name: str) -> Invariant:
    """The invariant called ``name``; KeyError lists the known ones."""
    try:
        return INVARIANTS[name]
    except KeyError:
        raise KeyError(f"unknown invariant '{name}'; known: {', '.join(INVARIANTS)}") from None


def names() -> Iterable[str]:
    return INVARIANTS.keys()
