"""The canonical op table: one place that knows every spelling of an operator.

A graph captured at module level spells ReLU as ``call_module`` (``nn.ReLU``),
``call_function`` (``F.relu``, ``torch.relu``), ``call_method`` (``x.relu()``); one captured
with ``torch.export`` spells it ``aten.relu.default``. Every pass, the tiler and the Circle
lowering ask this module what a node *is* instead of keeping their own lists:

    >>> import torch, torch.nn.functional as F
    >>> from fxopt.ir import ops
    >>> gm = torch.fx.symbolic_trace(lambda x: F.relu(x) + x.relu())
    >>> [ops.info(n, gm).name for n in gm.graph.nodes if ops.is_compute(n)]
    ['relu', 'relu', 'add']

Traits (:class:`OpInfo`):

* ``pure``: the output depends only on the inputs and nothing else is touched. Only pure,
  known ops may be merged (CSE) or removed when unused (DCE).
* ``random``: draws from the RNG. Never merged; never removed (that would shift the random
  stream seen by later random ops).
* ``mutates``: the argument positions / keyword names written in place (``x.add_``,
  ``F.relu(x, inplace=True)``, ``torch.add(a, b, out=buf)``, ``aten.copy_``).
* ``stateful``: updates module state (BatchNorm in training mode with running stats).
* ``view``: the output *may* share storage with an input (``view``, ``reshape``,
  ``contiguous``, ``to``...): alias analysis joins them.
* ``commutative``: the first two tensor inputs may be swapped.
* ``known``: the op is in the table (or, for ATen, described by its schema). An unknown op
  is treated as impure and as possibly mutating and aliasing all of its inputs.

ATen overloads carry a schema, so their mutation, aliasing and randomness traits come from
``torch`` itself (``Tensor(a!)`` arguments, ``nondeterministic_seeded`` tag); the table only
adds a canonical name and commutativity.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch._library.utils import is_impure as node_is_impure

from fxopt.ir import binding, shared
from fxopt.ir.binding import aten_name, emit, level_of, set_args
from fxopt.ir.guard import GUARD_NAME
from fxopt.ir.op_table import INPLACE_OPERATORS, SPEC_BY_NAME, SPECS, Group, Spec

# Ops that fix the layout of their result (see Group.CONTIGUOUS_RESULT).
CONTIGUOUS_RESULT = Group.CONTIGUOUS_RESULT

__all__ = [
    "Group",
    "OpInfo",
    "OpTable",
    "args",
    "aten_name",
    "aten_overloads",
    "calls",
    "canonical_names",
    "emit",
    "info",
    "is_call",
    "is_compute",
    "level_of",
    "set_args",
    "table",
]


@dataclass(frozen=True)
class OpInfo:
    """What a node is: its canonical name and the traits that passes must respect."""

    name: str
    pure: bool = True
    random: bool = False
    stateful: bool = False
    view: bool = False
    commutative: bool = False
    known: bool = True
    compute: bool = True
    mutates: tuple[int | str, ...] = ()
    #: Why an unknown op is unknown, when there is more to say than its name.
    unknown_because: str = ""

    @property
    def inplace(self) -> bool:
        """True when the op writes into one of its arguments."""
        return bool(self.mutates)

    @property
    def removable(self) -> bool:
        """Safe to delete when its result is unused."""
        return self.known and self.pure and not self.random and not self.stateful

    @property
    def mergeable(self) -> bool:
        """Safe to merge with an identical call on the same inputs (CSE)."""
        return self.removable and self.compute


def _build_tables():
    by_function: dict[object, Spec] = {}
    by_method: dict[str, Spec] = {}
    by_module: dict[type, Spec] = {}
    by_aten: dict[str, Spec] = {}
    for spec in SPECS:
        for fn in spec.functions:
            by_function.setdefault(fn, spec)
        for name in spec.methods:
            by_method.setdefault(name, spec)
        for cls in spec.modules:
            by_module.setdefault(cls, spec)
        for name in spec.aten:
            by_aten.setdefault(name, spec)
    return by_function, by_method, by_module, by_aten


_BY_FUNCTION, _BY_METHOD, _BY_MODULE, _BY_ATEN = _build_tables()
_NON_COMPUTE = {"placeholder", "get_attr", "output"}


def canonical_names() -> list[str]:
    """Every canonical op name the table knows, sorted."""
    return sorted(SPEC_BY_NAME)


def aten_overloads(name: str) -> list[torch._ops.OpOverload]:
    """The ATen overloads of canonical op ``name`` (every ATen spelling of its row).

    >>> [str(op) for op in aten_overloads("relu")]
    ['aten.relu.default', 'aten.relu.out']
    """
    found = []
    for spelling in SPEC_BY_NAME[name].aten:
        packet = getattr(torch.ops.aten, spelling, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            found += [getattr(packet, overload) for overload in packet.overloads()]
    return found


def commutative_names() -> frozenset[str]:
    """Canonical names of the ops whose first two operands commute (``add``, ``mul``...)."""
    return frozenset(spec.name for spec in SPECS if spec.commutative)


def is_compute(node: fx.Node) -> bool:
    """True for call_function / call_method / call_module nodes."""
    return node.op not in _NON_COMPUTE


def is_pointwise(node: fx.Node) -> bool:
    """True for an ATen op torch tags pointwise (``torch.Tag.pointwise``: each output
    element from the same element of each input), which a fusing compiler folds into the
    kernel that reads its result."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags


def is_call(node: object, name: str, gm: fx.GraphModule | None = None) -> bool:
    """True when ``node`` is a compute node whose canonical name is ``name``."""
    return isinstance(node, fx.Node) and is_compute(node) and info(node, gm).name == name


def any_call(gm: fx.GraphModule, test: Callable[[OpInfo], bool]) -> bool:
    """Whether some compute node of ``gm`` has an :class:`OpInfo` for which ``test`` holds.

    >>> gm = fx.symbolic_trace(torch.nn.Dropout(0.5).eval())
    >>> any_call(gm, lambda op: op.random), any_call(gm, lambda op: not op.known)
    (False, False)
    """
    return any(is_compute(n) and test(info(n, gm)) for n in gm.graph.nodes)


def calls(gm: fx.GraphModule, name: str) -> Iterator[fx.Node]:
    """The nodes of ``gm`` whose canonical name is ``name``, in graph order."""
    return (n for n in gm.graph.nodes if is_call(n, name, gm))


def info(node: fx.Node, gm: fx.GraphModule | None = None) -> OpInfo:
    """Describe ``node``. A ``call_module`` target is looked up in ``gm`` (default: the
    module that owns the node's graph)."""
    if node.op in _NON_COMPUTE:
        return OpInfo(node.op, compute=False)
    if node.op == "call_module":
        return _module_info(node, gm)
    if node.op == "call_method":
        return _method_info(node)
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return _aten_info(node, target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _unknown(str(target))
    return _function_info(node, target)


class OpTable(dict):
    """The op table's answer for every node of one graph (``table[node]``, a plain dict
    lookup: passes ask it per node), and each node's position (``table.position``).

    Shared by the passes of a pipeline while the graph is unchanged (:func:`table`); a
    pass reads ``table[node]`` instead of asking :func:`info` again.
    """

    def __init__(self, gm: fx.GraphModule):
        super().__init__()
        self.position: dict[fx.Node, int] = {}
        known = shared.memo(gm.graph, "ops.info")
        position = self.position  # a local: this loop runs once per node
        for index, node in enumerate(gm.graph.nodes):
            position[node] = index
            self[node] = _remembered_info(node, gm, known)

    @property
    def info(self) -> dict[fx.Node, OpInfo]:
        """Node → OpInfo (the table itself)."""
        return self

    def __hash__(self) -> int:  # one table per graph state: identity, as before
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def table(gm: fx.GraphModule) -> OpTable:
    """The :class:`OpTable` of ``gm``, shared across a pipeline while the graph is unchanged.

    >>> import torch
    >>> from fxopt.ir import ops
    >>> gm = torch.fx.symbolic_trace(lambda x: x.relu())
    >>> [ops.table(gm)[n].name for n in gm.graph.nodes]
    ['placeholder', 'relu', 'output']
    """
    return shared.get(gm, "ops", OpTable)


def _remembered_info(node: fx.Node, gm: fx.GraphModule, known: dict | None) -> OpInfo:
    """info(node), remembered across the passes of a pipeline.

    A remembered answer is reused only while the node's target, args and kwargs are the
    same objects: fx replaces the argument tuples whenever an input changes. Module calls
    are not remembered (a pass may swap the module under the same name).
    """
    if known is None or node.op == "call_module":
        return info(node, gm)
    entry = known.get(node)
    node_args, kwargs, target = node.args, node.kwargs, node.target
    if entry is not None and entry[0] is node_args and entry[1] is kwargs and entry[2] is target:
        return entry[3]
    op = info(node, gm)
    known[node] = (node_args, kwargs, target, op)
    return op


def _unknown(name: str, because: str = "") -> OpInfo:
    # Unknown: assume it may do anything to its inputs (mutate, alias) and keep it.
    return OpInfo(name, pure=False, known=False, view=True, mutates=("*",), unknown_because=because)


# Traits of calls whose arguments cannot change them (no keyword arguments, no inplace
# or training flag passed, no running stats): computed once per spec (and commutativity).
# ops.info runs for every node in every pass, so this is most of what a pass costs on a
# large graph.
_PLAIN_INFO: dict[tuple[str, bool], OpInfo] = {}


def _with_call_traits(spec: Spec, node: fx.Node, *, method: bool) -> OpInfo:
    """Traits of a functional or method call, given its spec and actual arguments."""
    plain = (
        not node.kwargs
        and spec.training_flag is None
        and spec.name != "batch_norm"
        and (spec.inplace_flag is None or len(node.args) <= spec.inplace_flag)
    )
    if plain:
        args = node.args
        commutative = spec.commutative and not (
            (len(args) > 0 and _may_be_sequence(args[0]))
            or (len(args) > 1 and _may_be_sequence(args[1]))
        )
        cached = _PLAIN_INFO.get((spec.name, commutative))
        if cached is None:
            cached = _PLAIN_INFO[(spec.name, commutative)] = OpInfo(
                spec.name,
                random=spec.random,
                pure=not spec.random,
                view=spec.view,
                commutative=commutative,
            )
        return cached
    mutates: list[int | str] = []
    if "out" in node.kwargs and node.kwargs["out"] is not None:
        mutates.append("out")
    # F.batch_norm(input, running_mean, running_var, ...) and torch.batch_norm(input, weight,
    # bias, running_mean, running_var, ...) update the running stats in place when training.
    stats_written = (
        _running_stats_written(node, 1 if node.target is F.batch_norm else 3)
        if spec.name == "batch_norm" and not method
        else ()
    )
    mutates.extend(stats_written)
    # x.relu() has self at args[0], like F.relu(x), so flag positions agree.
    flag = spec.inplace_flag
    if flag is not None and (
        node.kwargs.get("inplace") is True or (len(node.args) > flag and node.args[flag] is True)
    ):
        mutates.append(0)
    random = spec.random
    if spec.training_flag is not None:
        training = node.kwargs.get("training", node.kwargs.get("train"))
        if training is None and len(node.args) > spec.training_flag:
            training = node.args[spec.training_flag]
        p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
        # F.dropout defaults to training=True; torch.dropout has no default.
        random = training is not False and p != 0
    return OpInfo(
        spec.name,
        pure=not mutates and not random,
        random=random,
        stateful=bool(stats_written),
        view=spec.view or bool(mutates),
        commutative=spec.commutative
        and "alpha" not in node.kwargs
        and not any(_may_be_sequence(a) for a in node.args[:2]),
        mutates=tuple(mutates),
    )


def _running_stats_written(node: fx.Node, first: int) -> tuple:
    """Positions (or keyword names) of the running stats a training batch norm updates.

    ``first`` is the position of ``running_mean``; ``running_var`` follows it, and the
    training flag is at position 5 in every spelling (F.batch_norm, torch.batch_norm, ATen).
    """
    training = node.args[5] if len(node.args) > 5 else node.kwargs.get("training", False)
    if training is False:
        return ()
    written: list[int | str] = []
    for index, name in ((first, "running_mean"), (first + 1, "running_var")):
        value = node.args[index] if len(node.args) > index else node.kwargs.get(name)
        if value is not None:
            written.append(index if len(node.args) > index else name)
    return tuple(written)


# Whether a metadata-less node may produce a sequence, remembered in the node's meta (a
# dict lookup; copies of the node compute the same kind of value): passes ask in graph
# order, so each answer reuses its inputs' answers and costs O(1). A rewrite never turns a
# tensor-producing node into a sequence-producing one, so answers do not go stale.
_SEQUENCE_KEY = "fxopt.may_be_sequence"


# Called per node: one flat ladder of cheap checks is faster than helper calls and reads
# as the list of cases.
def _may_be_sequence(value: object, limit: int = 64) -> bool:  # noqa: C901
    """True when ``value`` may be a tuple, list or str, which ``+`` concatenates (so
    ``s + (1,)`` and ``(1,) + s`` differ: not commutative).

    Without metadata this follows ``+``/``*`` back through at most ``limit`` unremembered
    nodes and answers True (not commutative: the safe side) beyond that.
    """
    if not isinstance(value, fx.Node):
        return isinstance(value, (tuple, list, str))
    known = value.meta.get(_SEQUENCE_KEY)
    if known is not None:
        return known
    stack, seen, answer = [value], 0, False
    while stack and not answer:
        current = stack.pop()
        if isinstance(current, (tuple, list, str)):
            answer = True
            break
        if not isinstance(current, fx.Node):
            continue
        remembered = current.meta.get(_SEQUENCE_KEY)
        if remembered is not None:
            answer = remembered
            continue
        seen += 1
        if seen > limit:
            answer = True
        elif "tensor_meta" in current.meta:
            continue  # ShapeProp describes tensors only
        elif "val" in current.meta or "type" in current.meta:
            kind = current.meta.get("type")
            answer = isinstance(current.meta.get("val"), (tuple, list, str)) or (
                isinstance(kind, type) and issubclass(kind, (tuple, list, str))
            )
        elif current.op == "call_method" and current.target == "size":
            answer = True  # no metadata: shape queries, and arithmetic on them
        elif current.op == "call_function" and current.target is getattr:
            answer = True
        elif current.op == "call_function" and current.target in (operator.add, operator.mul):
            stack.extend(current.args[:2])
    value.meta[_SEQUENCE_KEY] = answer
    return answer


def _function_info(node: fx.Node, target: object) -> OpInfo:
    if target in INPLACE_OPERATORS:
        return OpInfo(INPLACE_OPERATORS[target], pure=False, view=True, mutates=(0,))
    spec = _BY_FUNCTION.get(target)
    if spec is None:
        name = getattr(target, "__name__", None)
        # torch.relu_ / F.relu_: the in-place twin of a known function.
        if name and name.endswith("_") and not name.endswith("__"):
            base = _BY_FUNCTION.get(getattr(torch, name[:-1], None)) or _BY_FUNCTION.get(
                getattr(F, name[:-1], None)
            )
            if base is not None:
                return OpInfo(base.name, pure=False, view=True, mutates=(0,))
        return _unknown(str(name or target))
    return _with_call_traits(spec, node, method=False)


def _method_info(node: fx.Node) -> OpInfo:
    name = str(node.target)
    spec = _BY_METHOD.get(name)
    if spec is not None:
        return _with_call_traits(spec, node, method=True)
    if name.endswith("_") and not name.endswith("__"):
        base = _BY_METHOD.get(name[:-1])
        # x.uniform_(), x.normal_(), x.bernoulli_(): random and in place.
        random = name[:-1] in ("uniform", "normal", "bernoulli", "exponential", "random")
        canonical = base.name if base is not None else name[:-1]
        return OpInfo(canonical, pure=False, random=random, view=True, mutates=(0,), known=True)
    return _unknown(name)


# ATen dropouts, all (input, p, train): random only when train is not False and p != 0.
_DROPOUTS = (
    "native_dropout",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
)


@dataclass(frozen=True)
class _Schema:
    """What an ATen overload's schema and tags say, read once per overload."""

    packet: str
    mutates: tuple[int | str, ...]
    returns_alias: bool
    random: bool
    side_effect: bool
    # Where a `dropout_p` argument sits (attention ops): position, or name if kwarg-only.
    dropout_p: int | str | None = None
    dropout_p_default: object = None


_SCHEMAS: dict[torch._ops.OpOverload, _Schema] = {}


def _schema_of(op: torch._ops.OpOverload) -> _Schema:
    found = _SCHEMAS.get(op)
    if found is None:
        schema = op._schema
        mutates = tuple(
            arg.name if arg.kwarg_only else i
            for i, arg in enumerate(schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        returns_alias = any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        # torch's own judgement (asserts, profiler ranges, registered effects); for an
        # overload it depends on the op alone, so it is cached with the schema.
        side_effect = node_is_impure(op, impure_random=False) and not mutates
        dropout_p = next(
            (
                (a.name if a.kwarg_only else i, a.default_value)
                for i, a in enumerate(schema.arguments)
                if a.name == "dropout_p"
            ),
            (None, None),
        )
        found = _SCHEMAS[op] = _Schema(
            op.overloadpacket.__name__,
            mutates,
            returns_alias,
            torch.Tag.nondeterministic_seeded in op.tags,
            side_effect,
            *dropout_p,
        )
    return found


def _aten_info(node: fx.Node, op: torch._ops.OpOverload) -> OpInfo:
    static = _schema_of(op)
    packet, mutates, returns_alias = static.packet, static.mutates, static.returns_alias
    random = static.random
    if packet in _DROPOUTS:
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
        random = train is not False and (node.args[1] if len(node.args) > 1 else 0.5) != 0
    elif random and static.dropout_p is not None:
        # Attention is tagged random for its dropout; with a literal dropout_p of 0 it
        # draws nothing (CPU SDPA in a training graph of a model without attention dropout).
        where = static.dropout_p
        if isinstance(where, int) and where < len(node.args):
            p = node.args[where]
        else:
            p = node.kwargs.get("dropout_p", static.dropout_p_default)
        random = not (type(p) in (int, float) and p == 0)
    side_effect = static.side_effect
    # The composite aten.batch_norm's schema does not mark the running stats it updates.
    stats_written = _running_stats_written(node, 3) if packet == "batch_norm" else ()
    mutates += tuple(m for m in stats_written if m not in mutates)
    spec = _BY_ATEN.get(packet) or _BY_ATEN.get(packet.rstrip("_"))
    name = spec.name if spec is not None else packet.rstrip("_") or packet
    stateful = bool(stats_written) or (
        packet in ("_native_batch_norm_legit", "native_batch_norm")
        and len(node.args) > 5
        and node.args[5] is True
        and node.args[3] is not None
    )
    return OpInfo(
        name,
        pure=not mutates and not random and not side_effect and not stateful,
        random=random,
        stateful=stateful,
        view=returns_alias or bool(mutates),
        commutative=bool(spec and spec.commutative) and "alpha" not in node.kwargs,
        mutates=mutates,
    )


def _module_info(node: fx.Node, gm: fx.GraphModule | None) -> OpInfo:
    gm = gm if gm is not None else node.graph.owning_module
    if gm is None:
        raise ValueError(f"ops.info needs the GraphModule to describe call_module '{node}'")
    if node.target == GUARD_NAME:
        return _INPUT_GUARD
    module = submodule(gm, str(node.target))
    spec = _module_spec(type(module))
    if spec is None:
        return _unknown(type(module).__name__)
    if module._forward_hooks or module._forward_pre_hooks:
        return _unknown(spec.name, "it has forward hooks, which can do anything")
    # Plain attributes sit in the instance __dict__; getattr with a default would go
    # through nn.Module.__getattr__ and an AttributeError for every module without them.
    state = module.__dict__
    inplace = state.get("inplace", False) is True
    random = spec.random and module.training and state.get("p", 0.5) > 0
    stateful = (
        spec.name == "batch_norm"
        and module.training
        and state.get("track_running_stats", False) is True
    )
    key = (spec.name, spec.view, inplace, random, stateful)
    cached = _MODULE_INFO.get(key)
    if cached is None:
        cached = _MODULE_INFO[key] = OpInfo(
            spec.name,
            pure=not (inplace or random or stateful),
            random=random,
            stateful=stateful,
            view=spec.view or inplace,
            mutates=(0,) if inplace else (),
        )
    return cached


# An optimized graph's input check (fxopt.ir.contract): it reads the inputs, writes and
# returns nothing, and must stay (it raises on inputs the graph was not verified for).
_INPUT_GUARD = OpInfo("input_guard", pure=False, compute=False)

# A module call's OpInfo depends only on its spec and these flags: one object per combination.
_MODULE_INFO: dict[tuple, OpInfo] = {}


def _module_spec(cls: type) -> Spec | None:
    """The spec of the nearest class in ``cls``'s MRO that the table knows."""
    spec = _SPEC_OF_CLASS.get(cls, _MISSING)
    if spec is _MISSING:
        spec = next((_BY_MODULE[c] for c in cls.__mro__ if c in _BY_MODULE), None)
        _SPEC_OF_CLASS[cls] = spec
    return spec  # type: ignore[return-value]


_MISSING = object()
_SPEC_OF_CLASS: dict[type, object] = {}


def args(node: fx.Node, gm: fx.GraphModule | None = None) -> dict[str, object] | None:
    """``node``'s arguments by canonical name, defaults filled in; None when unknown.

    For a ``call_module`` node (looked up in ``gm``, default the graph's owning module) the
    values are the module's attributes (tensors, not nodes) and the call's input.
    """
    if node.op != "call_module":
        return binding.args(node)
    gm = gm if gm is not None else node.graph.owning_module
    if gm is None:
        raise ValueError(f"ops.args needs the GraphModule to read call_module '{node}'")
    spec = SPEC_BY_NAME.get(info(node, gm).name)
    return binding.module_args(node, spec, submodule(gm, str(node.target)))


def submodule(root: torch.nn.Module, target: str) -> torch.nn.Module:
    """``root.get_submodule(target)``, several times faster on the common path.

    Passes look up the module of every ``call_module`` node in every analysis; walking
    ``_modules`` directly skips ``nn.Module.__getattr__``. Anything unusual (a missing
    name, a non-module attribute) goes to ``get_submodule`` for its error message.
    """
    module = root._modules.get(target)  # a top-level name (names never contain a dot)
    if module is not None:
        return module
    module = root
    for part in target.split("."):
        child = module._modules.get(part)
        if child is None:
            return root.get_submodule(target)
        module = child
    return module


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's direct fx.Node inputs, in argument order, without duplicates."""
    return list(input_nodes(node))


def input_nodes(node: fx.Node) -> Collection[fx.Node]:
    """The node's input nodes in argument order, each once, without copying them.

    fx keeps them as the keys of ``Node._input_nodes``; ``all_input_nodes`` copies that
    into a new list per call, and the analyses ask for every node several times per
    pipeline run (700k lists on a 100k-node speed run). Do not change the graph while
    iterating.
    """
    return node._input_nodes


def aliased_nodes(node: fx.Node) -> Collection[fx.Node]:
    """The input nodes whose storage ``node``'s value may share (for a node whose op has
    the ``view`` trait): for an ATen overload, the arguments its schema gives the alias set
    of a return (``addmm_(Tensor(a!) self, mat1, mat2) -> Tensor(a!)``: ``self`` alone);
    for anything else, every input."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return input_nodes(node)
    keys = _ALIASED_ARGUMENTS.get(target)
    if keys is None:
        keys = _ALIASED_ARGUMENTS[target] = _aliased_arguments(target._schema)
    if not keys:
        return input_nodes(node)
    found: list[fx.Node] = []
    for position, name in keys:
        value = node.args[position] if position < len(node.args) else node.kwargs.get(name)
        found.extend(_nodes_in(value))
    return found


def _nodes_in(value: object) -> list[fx.Node]:
    """The nodes an argument holds: itself, or those of a list or tuple."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


#: OpOverload → ((position, name) of each argument a return may alias), from the schema.
_ALIASED_ARGUMENTS: dict = {}


def _aliased_arguments(schema) -> tuple[tuple[int, str], ...]:
    sets: set[str] = set()
    for returned in schema.returns:
        if returned.alias_info is not None:
            sets |= set(returned.alias_info.before_set) | set(returned.alias_info.after_set)
    if not sets or "*" in sets:
        return ()
    return tuple(
        (position, argument.name)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None
        and sets & (set(argument.alias_info.before_set) | set(argument.alias_info.after_set))
    )


def mutated_nodes(node: fx.Node, op: OpInfo) -> Iterable[fx.Node]:
    """The input nodes that ``node`` writes into (all inputs for an unknown op)."""
    if "*" in op.mutates:
        return tensor_args(node)
    found = []
    for key in op.mutates:
        if isinstance(key, str):
            value = node.kwargs.get(key)
        else:
            value = node.args[key] if key < len(node.args) else None
        found.extend(_nodes_in(value))
    return found
