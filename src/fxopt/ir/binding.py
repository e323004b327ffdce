"""Read a node's arguments by name, and build new nodes, at either capture level.

A conv's weight is ``node.args[1]`` for ``F.conv2d`` and ``aten.convolution``, a keyword for
``F.conv2d(x, weight=w)``, and an attribute for ``nn.Conv2d``; ``groups`` is at position 6
in ``F.conv2d`` and 8 in ``aten.convolution``. :func:`args` reads all of them by one
canonical name, with the defaults filled in; :func:`emit` builds a call in the spelling of
the graph it goes into; :func:`set_args` changes arguments by name in the node's own
spelling. Passes use these through :mod:`fxopt.ir.ops`:

    >>> import torch
    >>> from fxopt.ir import ops
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.leaky_relu(x, 0.2))
    >>> node = next(ops.calls(gm, "leaky_relu"))
    >>> ops.args(node)["negative_slope"], ops.args(node)["inplace"]
    (0.2, False)

Names come from the functional form (``torch.nn.functional``) and the ATen schema, which
agree except where :data:`~fxopt.ir.op_table.CANONICAL_ARGUMENT` renames (``self`` is
``input``).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from fxopt.ir.guard import GUARD_NAME
from fxopt.ir.op_table import (
    CANONICAL_ARGUMENT,
    CAST_METHOD_DTYPES,
    SPEC_BY_ATEN,
    SPEC_BY_NAME,
    Spec,
)

__all__ = ["args", "emit", "first_parameter", "level_of", "module_args", "set_args"]


@dataclass(frozen=True)
class _Parameter:
    name: str  # canonical
    spelled: str  # as the callable names it (a keyword argument uses this)
    keyword_only: bool
    default: object  # _REQUIRED when none
    kind: str  # what values it takes: "tensor", "list", "number", "dtype", ... (see _accepts)
    optional: bool = False


_REQUIRED = object()


@dataclass(frozen=True)
class _Signature:
    parameters: tuple[_Parameter, ...]
    # Methods like x.view(2, 3) take their list parameter as separate arguments.
    packs_varargs: bool = False


@dataclass(frozen=True)
class _Bound:
    values: dict[str, object]
    # canonical name -> position in node.args, or the keyword it was passed as
    where: dict[str, int | str]


def args(node: fx.Node) -> dict[str, object] | None:
    """``node``'s arguments by canonical name, defaults filled in; None when unknown (a
    ``call_module`` node's: :func:`module_args`, which needs the op's canonical spec)."""
    found = _bind(node)
    return None if found is None else found[1].values


def first_parameter(node: fx.Node) -> str | None:
    """The canonical name that every signature of ``node``'s target gives its first
    positional parameter (None when they differ, or for a module call): ``node.args[0]`` is
    then that argument, read without binding the call. A pattern's root is asked for its
    ``input`` this way on every candidate node.

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(lambda x: x.view(2, 3))
        >>> first_parameter(list(gm.graph.nodes)[1])
        'input'
    """
    if node.op not in ("call_function", "call_method"):
        return None
    key = (node.op, node.target)
    name = _FIRST_PARAMETER.get(key, _REQUIRED)
    if name is _REQUIRED:
        names = {_first_positional(signature) for signature in _signatures(node)}
        name = _FIRST_PARAMETER[key] = names.pop() if len(names) == 1 else None
    return name  # type: ignore[return-value]


_FIRST_PARAMETER: dict[object, str | None] = {}


def _first_positional(signature: _Signature) -> str | None:
    return next((p.name for p in signature.parameters if not p.keyword_only), None)


def set_args(node: fx.Node, **changes: object) -> None:
    """Change arguments of ``node`` by canonical name, in the node's own spelling.

    An argument given by position stays positional and one given by keyword stays a
    keyword; one left at its default is added as a keyword. Raises ValueError for a node
    or a name that cannot be bound.
    """
    found = _bind(node)
    if found is None:
        raise ValueError(f"cannot bind the arguments of {node.op} '{node.name}'")
    signature, bound = found
    if signature.packs_varargs and any(
        isinstance(bound.where.get(name), int) and bound.where[name] >= 1 for name in changes
    ):  # x.view(2, 3): the list is spread over the positions after the tensor
        raise ValueError(f"set_args: '{node.name}' spreads a list over its arguments")
    new_args, new_kwargs = list(node.args), dict(node.kwargs)
    by_name = {p.name: p for p in signature.parameters}
    for name, value in changes.items():
        if name not in by_name:
            raise ValueError(f"'{node.name}' has no argument '{name}'")
        where = bound.where.get(name)
        if isinstance(where, int):
            new_args[where] = value
        else:
            new_kwargs[where or by_name[name].spelled] = value
    node.args, node.kwargs = tuple(new_args), new_kwargs


def level_of(graph: fx.Graph) -> str:
    """``"aten"`` for a graph of ATen overloads (torch.export), else ``"torch"``."""
    for node in graph.nodes:
        if node.op == "call_module" and node.target == GUARD_NAME:
            continue
        if node.op in ("call_method", "call_module"):
            return "torch"
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            return "aten"
    return "torch"


def aten_name(node: fx.Node) -> str | None:
    """The ATen spelling a node calls (``"native_dropout"``), or None for other calls: for
    a pass that must tell apart the spellings one canonical op groups.

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(lambda x: torch.ops.aten.relu.default(x))
        >>> [aten_name(n) for n in gm.graph.nodes]
        [None, 'relu', None]
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    return target._schema.name.split("::")[-1]


def emit(
    graph: fx.Graph,
    name: str,
    *call_args: object,
    like: fx.Node | None = None,
    node_name: str | None = None,
    level: str | None = None,
    **call_kwargs: object,
) -> fx.Node:
    """A new call of canonical op ``name`` in ``graph``, spelled for the graph's level.

    ``name`` may also be one ATen spelling of a row that groups several (``"empty_like"``,
    ``"bernoulli"``), or the in-place form of a row's ATen spelling (``"relu_"``). With
    ``like``, the node goes just before ``like``, takes its level and its source metadata
    (stack trace, module stack); else it goes at the graph's insert point. ``level``
    (``"aten"`` or ``"torch"``) overrides the level: a kernel fxopt emits as an ATen
    overload into graphs of both levels. ``node_name`` names the node (fx makes it
    unique). When the inputs carry fake values (``meta["val"]``), the new node's is
    computed too.

        >>> import torch
        >>> from fxopt.ir import ops
        >>> gm = torch.fx.symbolic_trace(lambda x: x * 2)
        >>> mul = next(ops.calls(gm, "mul"))
        >>> x = ops.args(mul)["input"]
        >>> mul.replace_all_uses_with(ops.emit(gm.graph, "add", x, x, like=mul))
        [output]
        >>> gm.graph.erase_node(mul); _ = gm.recompile(); float(gm(torch.ones(1)))
        2.0
    """
    spec, spelling = _row_of(name)
    if level not in (None, "aten", "torch"):
        raise ValueError(f"emit: level must be 'aten' or 'torch', got {level!r}")
    if level is None:
        level = _level_of_node(like) if like is not None else level_of(graph)
    if level == "aten":
        target = _aten_overload(spec, call_args, call_kwargs, spelling)
        op, call_target = "call_function", target
    elif spec.functions:
        op, call_target = "call_function", _torch_function(spec, call_kwargs, spelling)
    elif spec.methods:
        op, call_target = "call_method", spec.methods[0]
    else:
        raise ValueError(f"emit: '{name}' has no function or method spelling to build")
    if like is not None:
        with graph.inserting_before(like):
            node = graph.create_node(op, call_target, call_args, call_kwargs, node_name)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    else:
        node = graph.create_node(op, call_target, call_args, call_kwargs, node_name)
    _fake_value(node)
    return node


def _row_of(name: str) -> tuple[Spec, str | None]:
    """The op-table row ``name`` builds, and the ATen spelling asked for (None: the row's
    first)."""
    spec = SPEC_BY_NAME.get(name)
    if spec is not None:
        return spec, None
    spec = SPEC_BY_ATEN.get(name)  # one spelling of a row that groups several ("empty_like")
    if spec is not None:
        return spec, name
    if name.endswith("_") and not name.endswith("__"):  # an in-place form: "relu_"
        base = name[:-1]
        spec = SPEC_BY_NAME.get(base)
        if spec is not None and spec.aten:
            return spec, spec.aten[0] + "_"
        spec = SPEC_BY_ATEN.get(base)
        if spec is not None:
            return spec, name
    raise ValueError(f"emit: '{name}' is not a canonical op name or an ATen spelling")


# --- binding ---------------------------------------------------------------------------


def _bind(node: fx.Node) -> tuple[_Signature, _Bound] | None:
    if node.op not in ("call_function", "call_method"):
        return None
    # Remembered on the node while its arguments are the same objects (fx replaces the
    # tuple when an argument changes): the passes of a pipeline ask for the same nodes.
    # (An attribute of the node, not a table: a table holding bound values would hold the
    # node itself through its inputs' users, and never let a graph go.)
    cached = node.__dict__.get(_BOUND)
    if cached is not None and cached[0] is node.args and cached[1] is node.kwargs:
        return cached[2]
    found = _bind_uncached(node)
    node.__dict__[_BOUND] = (node.args, node.kwargs, found)
    return found


_BOUND = "_fxopt_bound"


def _bind_uncached(node: fx.Node) -> tuple[_Signature, _Bound] | None:
    signatures = _signatures(node)
    # A Python number for a Tensor operand (`torch.add(x, 1)`) fits no overload exactly:
    # then the first whose names fit.
    for strict in (True, False):
        for signature in signatures:
            bound = _bind_to(signature, node.args, node.kwargs, strict=strict)
            if bound is not None:
                return signature, bound
    return None


def _bind_to(signature: _Signature, values: tuple, keywords: dict, *, strict: bool):
    """``values`` and ``keywords`` bound to ``signature``, or None when they do not fit."""
    parameters = signature.parameters
    positional = [p for p in parameters if not p.keyword_only]
    values = tuple(values)
    spread = signature.packs_varargs and len(positional) >= 2 and positional[1].kind == "list"
    if spread and len(values) > len(positional):
        values = (values[0], list(values[1:]))  # x.view(2, 3) is x.view([2, 3])
    if len(values) > len(positional):
        return None
    bound: dict[str, object] = {}
    where: dict[str, int | str] = {}
    for index, (parameter, value) in enumerate(zip(positional, values)):
        if strict and not _accepts(parameter, value):
            return None
        bound[parameter.name], where[parameter.name] = value, index
    if not _bind_keywords(parameters, keywords, bound, where, strict=strict):
        return None
    if not _fill_defaults(parameters, bound):
        return None
    return _Bound(bound, where)


def _bind_keywords(
    parameters: tuple[_Parameter, ...], keywords: dict, bound: dict, where: dict, *, strict: bool
) -> bool:
    """Add ``keywords`` to ``bound``; False when one names no parameter, names one already
    bound, or (``strict``) does not fit its parameter's type."""
    by_spelling = {p.spelled: p for p in parameters}
    for key, value in keywords.items():
        parameter = by_spelling.get(key) or by_spelling.get(_respelled(key))
        if parameter is None or parameter.name in bound:
            return False
        if strict and not _accepts(parameter, value):
            return False
        bound[parameter.name], where[parameter.name] = value, key
    return True


def _fill_defaults(parameters: tuple[_Parameter, ...], bound: dict) -> bool:
    """Give every unbound parameter its default and every int given for a list the list of
    that int; False when a required parameter is missing."""
    for parameter in parameters:
        if parameter.name not in bound:
            if parameter.default is _REQUIRED:
                return False
            bound[parameter.name] = parameter.default
    for parameter in parameters:  # sum(x, 1) and x.view(-1): an int for an int list
        value = bound[parameter.name]
        if parameter.kind == "list" and type(value) is int:
            bound[parameter.name] = [value]
    return True


def _respelled(key: str) -> str:
    return next((s for s, c in CANONICAL_ARGUMENT.items() if c == key), key)


_METADATA_KINDS = {
    torch.dtype: "dtype",
    torch.device: "device",
    torch.layout: "layout",
    torch.memory_format: "memory_format",
}


def _accepts(parameter: _Parameter, value: object) -> bool:
    """Whether ``value`` fits the parameter's type (Nodes fit any value parameter)."""
    kind = parameter.kind
    if value is None:
        return parameter.optional or kind == "any"
    if kind == "any":
        return True
    metadata = _METADATA_KINDS.get(type(value))
    if metadata is not None:
        return kind == metadata or (metadata == "device" and kind == "string")
    if isinstance(value, fx.Node):
        return kind not in ("dtype", "device", "layout", "memory_format", "string")
    if kind in ("dtype", "device", "layout", "memory_format"):
        return kind == "device" and isinstance(value, str)
    if isinstance(value, bool):
        return kind in ("bool", "number")
    if isinstance(value, (int, float, complex)):
        return kind in ("int", "float", "number", "list") and not (
            kind == "int" and isinstance(value, float)
        )
    if isinstance(value, str):
        return kind == "string"
    if isinstance(value, (list, tuple)):
        return kind in ("list", "tensor_list")
    return True


# --- signatures ------------------------------------------------------------------------

_SIGNATURES: dict[object, tuple[_Signature, ...]] = {}


def _signatures(node: fx.Node) -> tuple[_Signature, ...]:
    key = (node.op, node.target)
    found = _SIGNATURES.get(key)
    if found is None:
        found = _SIGNATURES[key] = _read_signatures(node.op, node.target)
    return found


def _read_signatures(op: str, target: object) -> tuple[_Signature, ...]:
    if op == "call_method":
        return _method_signatures(str(target))
    if isinstance(target, torch._ops.OpOverload):
        return (_from_schema(target._schema),)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return tuple(_from_schema(getattr(target, o)._schema) for o in target.overloads())
    if target is operator.getitem:
        return (_Signature((_plain("input"), _plain("index"))),)
    # operator.add names its operands (a, b): read the ATen op's names (input, other).
    python = None if getattr(target, "__module__", "") == "_operator" else _python_signature(target)
    if python is not None:
        return (python,)
    return _aten_signatures_named(_aten_names_of_function(target))


def _method_signatures(name: str) -> tuple[_Signature, ...]:
    if name in CAST_METHOD_DTYPES:  # x.float(): the dtype is the method's
        dtype = CAST_METHOD_DTYPES[name]
        return (
            _Signature(
                (
                    _plain("input"),
                    _Parameter("dtype", "dtype", True, dtype, "dtype"),
                    _Parameter(
                        "memory_format", "memory_format", True, None, "memory_format", optional=True
                    ),
                )
            ),
        )
    if name in ("cpu", "cuda"):
        return ()
    base = name.strip("_")
    names = [base]
    spec = _spec_of_method(name)
    if spec is not None:
        names += [spec.name, *spec.aten]
    found = _aten_signatures_named(names)
    return tuple(_Signature(s.parameters, packs_varargs=True) for s in found)


def _spec_of_method(name: str) -> Spec | None:
    return next((s for s in SPEC_BY_NAME.values() if name in s.methods), None)


def _aten_names_of_function(target: object) -> list[str]:
    names = [getattr(target, "__name__", "")]
    spec = next((s for s in SPEC_BY_NAME.values() if target in s.functions), None)
    if spec is not None:
        names += [spec.name, *spec.aten]
    return [n.strip("_") if n.startswith("__") else n for n in names if n]


def _aten_signatures_named(names: list[str]) -> tuple[_Signature, ...]:
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            return tuple(_from_schema(o._schema) for o in _tensor_overloads(packet))
    return ()


def _tensor_overloads(packet) -> list:
    """The packet's overloads, the usual ones first and the ``out=`` variants never.

    ``aten.add`` also has overloads on Python numbers (``add.default(a, b)``, ``add.int``)
    for the ops a graph computes on sizes; they are left out when any overload takes a
    tensor, so ``x + 1`` binds as ``add.Scalar(input, other)``.
    """
    names = packet.overloads()
    usual = [o for o in ("Tensor", "default", "Scalar", "int", "dim") if o in names]
    ordered = usual + [o for o in names if o not in usual and not o.endswith("out")]
    overloads = [getattr(packet, o) for o in ordered]
    with_tensors = [o for o in overloads if any(_takes_tensor(a) for a in o._schema.arguments)]
    return with_tensors or overloads


def _takes_tensor(argument) -> bool:
    jit_type = argument.type
    while jit_type.kind() in ("OptionalType", "ListType"):
        jit_type = jit_type.getElementType()
    return jit_type.kind() == "TensorType"


def _from_schema(schema) -> _Signature:
    parameters = []
    for argument in schema.arguments:
        kind, optional = _kind_of_schema_type(argument.name, argument.type)
        default = argument.default_value if argument.has_default_value() else _REQUIRED
        parameters.append(
            _Parameter(
                CANONICAL_ARGUMENT.get(argument.name, argument.name),
                argument.name,
                argument.kwarg_only,
                default,
                kind,
                optional,
            )
        )
    return _Signature(tuple(parameters))


_SCHEMA_KINDS = {
    "TensorType": "tensor",
    "IntType": "int",
    "SymIntType": "int",
    "FloatType": "float",
    "NumberType": "number",
    "BoolType": "bool",
    "StringType": "string",
    "DeviceObjType": "device",
    "ListType": "list",
    "GeneratorType": "any",
}


def _kind_of_schema_type(name: str, jit_type) -> tuple[str, bool]:
    optional = jit_type.kind() == "OptionalType"
    if optional:
        jit_type = jit_type.getElementType()
    kind = _SCHEMA_KINDS.get(jit_type.kind(), "any")
    # The schema types dtype, layout and memory format as int: the name says which.
    if kind == "int" and name in ("dtype", "layout", "memory_format"):
        kind = name
    if kind == "list" and jit_type.getElementType().kind() in ("TensorType", "OptionalType"):
        kind = "tensor_list"
    return kind, optional


def _python_signature(target: object) -> _Signature | None:
    """The signature of a Python function (most of torch.nn.functional)."""
    if not callable(target):
        return None
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None  # a builtin (torch.relu, F.conv2d): read its ATen schema instead
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            return None  # a dispatching wrapper (F.max_pool2d): read its ATen schema
        default = _REQUIRED if parameter.default is parameter.empty else parameter.default
        parameters.append(
            _Parameter(
                CANONICAL_ARGUMENT.get(parameter.name, parameter.name),
                parameter.name,
                parameter.kind == parameter.KEYWORD_ONLY,
                default,
                "any",
                optional=True,
            )
        )
    return _Signature(tuple(parameters))


def _plain(name: str) -> _Parameter:
    return _Parameter(name, name, False, _REQUIRED, "any", optional=True)


# --- modules ---------------------------------------------------------------------------


def module_args(node: fx.Node, spec: Spec | None, module: torch.nn.Module):
    """A ``call_module`` node's arguments by canonical name, as the functional form of its
    op (``spec``) takes them: the call's input, and the module's attributes (tensors, not
    nodes) for the rest; None when the call is not that one-input form."""
    if spec is None or len(node.args) != 1 or node.kwargs:
        return None
    if spec.name == "identity":  # nn.Identity has no functional form: its input is all
        return {"input": node.args[0]}
    if not spec.functions:
        return None
    functional = _functional_signature(spec)
    if functional is None:
        return None
    found: dict[str, object] = {"input": node.args[0]}
    state = (module.__dict__, module._parameters, module._buffers)
    for parameter in functional.parameters[1:]:
        if parameter.name == "training":
            found["training"] = module.training
            continue
        for registry in state:
            if parameter.spelled in registry:
                found[parameter.name] = registry[parameter.spelled]
                break
    return found


def _functional_signature(spec: Spec) -> _Signature | None:
    """The signature of ``spec``'s functional form (read once per spec: parsing it per node
    was most of what reading a module call's arguments cost)."""
    if spec.name not in _FUNCTIONAL:
        functions = spec.functions
        _FUNCTIONAL[spec.name] = next((_python_signature(f) or _first(f) for f in functions), None)
    return _FUNCTIONAL[spec.name]


_FUNCTIONAL: dict[str, _Signature | None] = {}


def _first(function: Callable) -> _Signature | None:
    signatures = _aten_signatures_named(_aten_names_of_function(function))
    return signatures[0] if signatures else None


# --- building --------------------------------------------------------------------------


def _level_of_node(node: fx.Node) -> str:
    """The level a node is spelled at; the graph's when the node does not say (getitem,
    Python arithmetic on sizes)."""
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return "aten"
    if node.op == "call_method":
        return "torch"
    return level_of(node.graph)


def _aten_overload(spec: Spec, call_args: tuple, call_kwargs: dict, spelling: str | None):
    if not spec.aten:
        raise ValueError(f"emit: '{spec.name}' has no ATen spelling")
    spelling = spelling or spec.aten[0]
    packet = getattr(torch.ops.aten, spelling, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise ValueError(f"emit: there is no ATen op aten.{spelling}")
    overloads = _tensor_overloads(packet)
    for strict in (True, False):
        for overload in overloads:
            if _bind_to(_from_schema(overload._schema), call_args, call_kwargs, strict=strict):
                return overload
    raise ValueError(f"emit: no overload of aten.{spelling} takes these arguments")


def _torch_function(spec: Spec, call_kwargs: dict, spelling: str | None) -> Callable:
    functions = spec.functions
    if spelling is not None:
        functions = tuple(f for f in functions if getattr(f, "__name__", "") == spelling)
        if not functions:
            raise ValueError(f"emit: '{spelling}' has no torch-level function to build")
    if call_kwargs:  # operator.add takes no keywords: torch.add(x, y, alpha=2)
        functions = tuple(f for f in functions if getattr(f, "__module__", "") != "_operator")
    if not functions:
        raise ValueError(f"emit: '{spec.name}' has no function taking keyword arguments")
    return functions[0]


def _fake_value(node: fx.Node) -> None:
    """Set ``meta["val"]`` when the inputs carry fake values (export graphs)."""
    from torch._guards import detect_fake_mode

    inputs = node.all_input_nodes
    values = [n.meta.get("val") for n in inputs]
    if not inputs or any(v is None for v in values):
        return
    mode = detect_fake_mode(values)
    if mode is None:
        return
    call_args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
    call_kwargs = fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
    target = node.target
    if node.op == "call_method":
        self_value, *rest = call_args
        target, call_args = getattr(self_value, str(node.target)), tuple(rest)
    try:
        with mode:
            node.meta["val"] = target(*call_args, **call_kwargs)
    except Exception:  # a value we cannot compute leaves the node without one, as before
        node.meta.pop("val", None)
