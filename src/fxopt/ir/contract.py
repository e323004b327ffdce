"""The input contract: what an optimized graph may assume about the inputs it is called with.

A rewrite that is right for the example can be wrong for another input: a reshape that is
an identity for ``[4, 8]`` is not one for ``[2, 5, 8]``, a cast to int64 is a no-op only on
int64 input. So every optimized module carries an :class:`InputContract` and checks each
call against it (an :class:`InputGuard` node right after the inputs). A call outside the
contract raises :class:`~fxopt.errors.InputMismatchError`; it never computes a wrong answer.

Per input, the contract fixes:

* its dtype and device (rewrites take dtypes from the graph's metadata);
* its rank, and each dimension either static (the example's size) or a *symbol* with a
  range; dims that must be equal share a symbol;
* relations the graph needs between symbols (``x.shape[0] != 1``, ``3*x.shape[0] % 4 == 0``):
  the guards torch's symbolic shapes recorded while the graph was captured and rewritten;
* its memory format, only when a rewrite relied on that input's layout (``layout_pinned``:
  any input pinned);
* for a non-tensor input (an int, a flag), its value;

and the state no input shows (:class:`ModuleState`): the module's training flag, autocast,
whether a call may need gradients its kernels lack, and whether inputs may share memory.

    >>> import torch, fxopt
    >>> model = torch.nn.Linear(8, 3)
    >>> result = fxopt.optimize(model, torch.randn(4, 8), benchmark_runs=0)
    >>> print(result.contract.describe())
    input: float32[s0 >= 1, 8] on cpu
    in training mode, autocast off
    >>> result.module(torch.randn(4, 8, dtype=torch.float64))
    Traceback (most recent call last):
    ...
    fxopt.errors.InputMismatchError: input 'input' has dtype float64, but the module ...
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxopt.errors import FxoptError, InputMismatchError, UserInputError
from fxopt.ir.guard import GUARD_NAME
from fxopt.ir.sampling import random_like
from fxopt.ir.shapes import DECLARED_RANGES_KEY
from fxopt.ir.weights import DERIVED_KEY, WeightWatch

_HINT = (
    "re-run fxopt.optimize with an example like this input, or with dynamic_shapes= "
    "(dynamic='batch' lets dim 0 vary, dynamic='all' every dim the model lets vary)"
)

_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor input: dtype, device, and each dim a static size or a symbolic expression."""

    dtype: torch.dtype
    device: torch.device
    dims: tuple[int | str, ...]
    memory_format: str | None = None

    def describe(self, ranges: dict[str, tuple[int, int | None]]) -> str:
        shown = []
        for dim in self.dims:
            if isinstance(dim, int):
                shown.append(str(dim))
            elif dim in ranges:
                low, high = ranges[dim]
                shown.append(f"{dim} >= {low}" if high is None else f"{low} <= {dim} <= {high}")
            else:
                shown.append(dim)
        layout = f", {self.memory_format}" if self.memory_format else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}[{', '.join(shown)}]{layout} on {self.device}"


@dataclass(frozen=True)
class ValueSpec:
    """A non-tensor input the graph was built for: its value is part of the graph."""

    value: object

    def describe(self, ranges) -> str:
        return f"the value {self.value!r}"


@dataclass(frozen=True)
class TreeSpec:
    """A nested input (a list or dict of tensors): its structure and a spec per leaf."""

    structure: pytree.TreeSpec
    leaves: tuple[TensorSpec | ValueSpec, ...]

    def describe(self, ranges) -> str:
        inner = ", ".join(leaf.describe(ranges) for leaf in self.leaves)
        return f"{self.structure.type.__name__ if self.structure.type else 'tree'}({inner})"


Spec = TensorSpec | ValueSpec | TreeSpec


def autocast_state(device_types: Sequence[str]) -> tuple[tuple[str, torch.dtype | None], ...]:
    """(device type, autocast dtype or None when autocast is off) for each device type."""
    return tuple(
        (kind, torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)
        for kind in device_types
    )


@dataclass(frozen=True)
class ModuleState:
    """The state of the module and of torch an optimized graph was verified in, which no
    input shows: the training flag (dropout and BatchNorm were rewritten for it), autocast
    (fused kernels and folded weights compute in float32 whatever autocast says), whether
    its kernels have gradients, and whether it writes an input (then two inputs that share
    memory would see the write where eager's do not)."""

    training: bool
    #: (device type, dtype) per device type the inputs are on; dtype None: autocast off.
    autocast: tuple[tuple[str, torch.dtype | None], ...] = ()
    #: False when some kernel has no autograd formula (fused oneDNN kernels): a call that
    #: needs gradients (grad mode on, an input requiring grad) is refused.
    gradients: bool = True
    #: True when the graph writes one of its inputs in place.
    writes_inputs: bool = False

    def describe(self) -> str:
        parts = ["training mode" if self.training else "eval mode"]
        parts.append(self._autocast_text(self.autocast))
        if not self.gradients:
            parts.append("no gradients (inference kernels)")
        if self.writes_inputs:
            parts.append("writes an input (inputs must not share memory)")
        return ", ".join(parts)

    def check(self, training: bool | None, names: Sequence[str], values: Sequence) -> None:
        """Raise InputMismatchError unless a call in this state, with ``values``, computes
        what the model computes (``training``: the module's flag now; None: not checked)."""
        if training is not None and training != self.training:
            was, now = ("training", "eval") if self.training else ("eval", "training")
            back = "train" if self.training else "eval"
            raise InputMismatchError(
                f"the module was optimized in {was} mode and is now in {now} mode: its graph "
                f"has {was}-mode dropout and BatchNorm built in; call .{back}() on it "
                f"again, or optimize the model in {now} mode"
            )
        now = autocast_state([kind for kind, _ in self.autocast])
        if now != self.autocast:
            raise InputMismatchError(
                f"the module was optimized with {self._autocast_text(self.autocast)} and is "
                f"called with {self._autocast_text(now)}: its rewritten graph and kernels keep "
                "the dtypes they were verified with; call it in the same autocast state, or "
                "optimize the model under this one"
            )
        if not self.gradients and torch.is_grad_enabled():
            for name, value in _leaves(names, values):
                if value.requires_grad:
                    raise InputMismatchError(
                        f"input '{name}' requires grad, but the module runs fused inference "
                        "kernels that have no gradient: call it under torch.no_grad(), or "
                        "optimize with layout='plain' (or autotune=False) for gradients"
                    )
        if self.writes_inputs:
            _check_no_shared_memory(names, values)

    @staticmethod
    def _autocast_text(state) -> str:
        on = [f"{kind} {str(dtype).removeprefix('torch.')}" for kind, dtype in state if dtype]
        return f"torch.autocast ({', '.join(on)})" if on else "autocast off"


def _leaves(names: Sequence[str], values: Sequence):
    """(name, tensor) of every tensor in ``values``, nested ones included."""
    for name, value in zip(names, values):
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, (list, tuple, dict)):
            for index, leaf in enumerate(pytree.tree_leaves(value)):
                if isinstance(leaf, torch.Tensor):
                    yield f"{name}[{index}]", leaf


def _check_no_shared_memory(names: Sequence[str], values: Sequence) -> None:
    seen: dict[int, str] = {}
    for name, value in _leaves(names, values):
        if value.layout != torch.strided:
            continue
        key = value.untyped_storage().data_ptr()
        if key == 0:
            continue
        if key in seen:
            raise InputMismatchError(
                f"inputs '{seen[key]}' and '{name}' share memory, and the module writes one "
                "of its inputs in place: its graph reads the other as it was before the "
                "write, where the model reads the write; pass separate tensors (e.g. .clone())"
            )
        seen[key] = name


@dataclass
class InputContract:
    """What an optimized graph assumes about its inputs (one spec per graph input)."""

    names: tuple[str, ...]
    specs: tuple[Spec, ...]
    #: symbol -> (min, max or None): the range each dynamic dim may take.
    ranges: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    #: Python expressions over the symbols that must hold (torch's shape guards).
    relations: tuple[str, ...] = ()
    #: symbol -> where it is read ("x.shape[0]"), for messages.
    sources: dict[str, str] = field(default_factory=dict)
    layout_pinned: bool = False
    notes: tuple[str, ...] = ()
    #: The module and torch state the graph was verified in (None: not checked).
    state: ModuleState | None = None
    _compiled: object = field(default=None, init=False, repr=False, compare=False)

    @property
    def dynamic(self) -> dict[str, str]:
        """{source: symbol} of every dynamic dim, e.g. {'x.shape[0]': 's0'}."""
        return {source: symbol for symbol, source in self.sources.items()}

    def describe(self) -> str:
        pairs = zip(self.names, self.specs)
        lines = [f"{name}: {spec.describe(self.ranges)}" for name, spec in pairs]
        lines += [f"and {self._readable(r)}" for r in self.relations]
        if self.state is not None:
            lines.append(f"in {self.state.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "inputs": {n: s.describe(self.ranges) for n, s in zip(self.names, self.specs)},
            "dynamic": {
                source: {"min": self.ranges[s][0], "max": self.ranges[s][1]}
                for s, source in self.sources.items()
                if s in self.ranges
            },
            "relations": [self._readable(r) for r in self.relations],
            "layout_pinned": self.layout_pinned,
            "notes": list(self.notes),
            "state": self.state.describe() if self.state is not None else None,
        }

    def _readable(self, relation: str) -> str:
        import re

        return re.sub(r"\b(s\d+)\b", lambda m: self.sources.get(m.group(1), m.group(1)), relation)

    # -- checking ---------------------------------------------------------------------------

    def check(self, values: Sequence, training: bool | None = None) -> None:
        """Raise InputMismatchError unless ``values`` (one per graph input) fit the contract,
        and the call's state its :class:`ModuleState` (``training``: the module's flag)."""
        if len(values) != len(self.specs):
            raise InputMismatchError(
                f"the module takes {len(self.specs)} inputs ({', '.join(self.names)}), "
                f"got {len(values)}"
            )
        bound: dict[str, int] = {}
        for name, spec, value in zip(self.names, self.specs, values):
            if type(spec) is TensorSpec:
                self._check_tensor(name, spec, value, bound)
            else:
                self._check_other(name, spec, value, bound)
        for symbol, (low, high) in self.ranges.items():
            size = bound.get(symbol)
            if size is not None and (size < low or (high is not None and size > high)):
                where = self.sources.get(symbol, symbol)
                span = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise InputMismatchError(
                    f"{where} is {size}, but the optimized graph is valid only for {where} "
                    f"{span}; {_HINT}"
                )
        if self.relations:
            self._check_relations(bound)
        if self.state is not None:
            self.state.check(training, self.names, values)

    def _check_tensor(self, name: str, spec: TensorSpec, value, bound: dict) -> None:
        if not isinstance(value, torch.Tensor):
            raise InputMismatchError(
                f"input '{name}' is a {type(value).__name__}, but the module was optimized "
                f"for a tensor {spec.describe(self.ranges)}"
            )
        if value.dtype != spec.dtype:
            raise InputMismatchError(
                f"input '{name}' has dtype {str(value.dtype).removeprefix('torch.')}, but the "
                f"module was optimized for {str(spec.dtype).removeprefix('torch.')}: cast the "
                f"input, or {_HINT}"
            )
        if value.device != spec.device:
            raise InputMismatchError(
                f"input '{name}' is on {value.device}, but the module was optimized for "
                f"{spec.device}: move the input, or optimize the model on that device"
            )
        shape = value.shape
        if len(shape) != len(spec.dims):
            raise InputMismatchError(
                f"input '{name}' has shape {list(shape)} ({len(shape)} dims), but the module "
                f"was optimized for {spec.describe(self.ranges)}; {_HINT}"
            )
        for index, (size, dim) in enumerate(zip(shape, spec.dims)):
            if type(dim) is int:
                if size != dim:
                    raise InputMismatchError(
                        f"input '{name}' has shape {list(shape)}, but the module was optimized "
                        f"for {spec.describe(self.ranges)} (dim {index} is static); {_HINT}"
                    )
            elif dim in self.ranges:  # a plain symbol: binds it, or must equal its binding
                first = bound.setdefault(dim, size)
                if first != size:
                    raise InputMismatchError(
                        f"{name}.shape[{index}] is {size} but {self.sources.get(dim, dim)} is "
                        f"{first}: the optimized graph needs them equal"
                    )
        if spec.memory_format is not None and not _has_layout(value, spec.memory_format):
            raise InputMismatchError(
                f"input '{name}' is not {spec.memory_format}: the optimized graph relies on "
                "the example's memory format (a rewrite removed a copy); pass the input in "
                "that layout (e.g. x.contiguous()) or re-run optimize with an example in "
                "this layout"
            )

    def _check_other(self, name: str, spec: Spec, value, bound: dict) -> None:
        if type(spec) is ValueSpec:
            if not _same_value(value, spec.value):
                raise InputMismatchError(
                    f"input '{name}' is {value!r}, but the module was optimized for "
                    f"{spec.value!r}: non-tensor inputs are part of the graph; {_HINT}"
                )
            return
        assert type(spec) is TreeSpec
        leaves, structure = pytree.tree_flatten(value)
        if structure != spec.structure:
            raise InputMismatchError(
                f"input '{name}' has structure {structure}, but the module was optimized for "
                f"{spec.structure}"
            )
        for index, (leaf_spec, leaf) in enumerate(zip(spec.leaves, leaves)):
            if type(leaf_spec) is TensorSpec:
                self._check_tensor(f"{name}[{index}]", leaf_spec, leaf, bound)
            else:
                self._check_other(f"{name}[{index}]", leaf_spec, leaf, bound)

    def _check_relations(self, bound: dict[str, int]) -> None:
        if self._compiled is None:
            self._compiled = [
                (relation, compile(relation, "<fxopt input contract>", "eval"))
                for relation in self.relations
            ]
        namespace = _namespace()
        for relation, code in self._compiled:  # type: ignore[union-attr]
            try:
                holds = bool(eval(code, namespace, bound))
            except Exception:  # a symbol this call did not bind: the check cannot pass
                holds = False
            if not holds:
                raise InputMismatchError(
                    f"the inputs break a condition the optimized graph relies on: "
                    f"{self._readable(relation)} (with "
                    f"{', '.join(f'{self.sources.get(s, s)} = {v}' for s, v in bound.items())}); "
                    f"{_HINT}"
                )

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_compiled"] = None  # code objects do not pickle; recompiled on first use
        return state

    # -- sampling ------------------------------------------------------------------------------

    def other_sizes(self, example: Sequence) -> dict[str, int] | None:
        """A value for every dynamic symbol that differs from the example's and that the
        contract accepts, or None when there is no dynamic dim (or no such value)."""
        if not self.ranges:
            return None
        bound: dict[str, int] = {}
        for spec, value in zip(self.specs, example):
            _bind(spec, value, bound)
        choices: dict[str, int] = {}
        for symbol, (low, high) in self.ranges.items():
            hint = bound.get(symbol)
            if hint is None:
                continue
            # Size 1 first: the size where broadcasting and squeezing behave differently.
            candidates = [1, hint + 1, hint + 3, hint * 2, max(low, hint - 1)]
            for candidate in candidates:
                if candidate != hint and candidate >= low and (high is None or candidate <= high):
                    trial = {**bound, **choices, symbol: candidate}
                    if self._relations_hold(trial):
                        choices[symbol] = candidate
                        break
        return {**bound, **choices} if choices else None

    def _relations_hold(self, bound: dict[str, int]) -> bool:
        namespace = _namespace()
        try:
            return all(bool(eval(r, namespace, dict(bound))) for r in self.relations)
        except Exception:
            return False

    def resize(self, example: Sequence, sizes: dict[str, int], seed: int = 0) -> tuple:
        """Inputs like ``example`` but with the dynamic dims set to ``sizes`` (random values
        drawn like :func:`fxopt.ir.sampling.random_inputs_like`)."""

        generator = torch.Generator().manual_seed(seed)
        out = []
        for spec, value in zip(self.specs, example):
            if type(spec) is TensorSpec:
                shape = [_size(dim, sizes) for dim in spec.dims]
                new = random_like(value, shape, generator)
                if spec.memory_format in _FORMATS:
                    new = new.contiguous(memory_format=_FORMATS[spec.memory_format])
                elif spec.memory_format is not None:  # exact strides: the example's own
                    new = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
                    new.copy_(random_like(value, list(value.shape), generator))
                out.append(new)
            else:
                out.append(value)
        return tuple(out)


def _size(dim: int | str, sizes: dict[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    return int(eval(dim, _namespace(), dict(sizes)))


def _bind(spec: Spec, value, bound: dict) -> None:
    if type(spec) is TensorSpec and isinstance(value, torch.Tensor):
        for size, dim in zip(value.shape, spec.dims):
            if isinstance(dim, str) and dim.isidentifier():
                bound.setdefault(dim, int(size))
    elif type(spec) is TreeSpec:
        for leaf_spec, leaf in zip(spec.leaves, pytree.tree_leaves(value)):
            _bind(leaf_spec, leaf, bound)


def _has_layout(value: torch.Tensor, layout: str) -> bool:
    fmt = _FORMATS.get(layout)
    if fmt is not None:
        return value.is_contiguous(memory_format=fmt)
    return layout == f"strides={tuple(value.stride())}"


def _same_value(value: object, expected: object) -> bool:
    if type(value) is not type(expected):
        return False
    if isinstance(expected, float) and math.isnan(expected):
        return math.isnan(value)  # type: ignore[arg-type]
    try:
        return bool(value is expected or value == expected)
    except Exception:
        return False


_NAMESPACE: dict | None = None


def _namespace() -> dict:
    """Names the printed sympy expressions use (FloorDiv, Mod, Max...), as torch evaluates
    its own shape guards."""
    global _NAMESPACE
    if _NAMESPACE is None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        _NAMESPACE = {**SYMPY_INTERP, "math": math, "__builtins__": __builtins__}
    return _NAMESPACE


class NotCompilableError(FxoptError):
    """Raised inside Dynamo's trace of a module it must not compile (it falls back to
    running the frame eagerly); never seen by a caller."""


class ExportGuards(nn.Module):
    """torch.export's guard function (``_guards_fn``), made safe to copy and pickle.

    The function is a closure, which does not pickle: a pickled module loses it and keeps
    the contract, which holds the same shape guards (both come from one ShapeEnv).
    """

    def __init__(self, guards: nn.Module):
        super().__init__()
        self.guards = guards

    def forward(self, *values) -> None:
        if self.guards is not None:
            self.guards(*values)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_modules"] = {**state["_modules"], "guards": None}
        return state


class InputGuard(nn.Module):
    """Checks each call of an optimized graph against its :class:`InputContract`.

    ``export_guards`` (:class:`ExportGuards`) are torch.export's own guards for graphs
    captured with ``mode="export"``: they run after the contract, and their failures become
    the same InputMismatchError.
    """

    def __init__(
        self,
        contract: InputContract,
        export_guards: ExportGuards | None = None,
        weights: WeightWatch | None = None,
    ):
        super().__init__()
        self.contract = contract
        self.export_guards = export_guards
        #: The model tensors this module derived weights from (fxopt.ir.weights).
        self.weights = weights
        #: The passes that derived weights of this module from the model's (fold-bn,
        #: fuse-kernels, ...): a checkpoint of the model does not fit them.
        self.derived_by: tuple[str, ...] = ()
        #: The dtype of the module's floating-point weights (what .double() would change).
        self.float_dtype = torch.float32
        #: Inputs a call may pass in another memory format, copied (conformable_inputs).
        self.conformable: frozenset[int] = frozenset()

    def forward(self, *values) -> None:
        state = self.contract.state
        if state is not None and not state.gradients and torch.jit.is_tracing():
            raise UserInputError(
                "torch.jit.trace cannot trace the fused oneDNN kernels of this optimized "
                "module: optimize with layout='plain' for a module to trace, or trace the model"
            )
        if state is not None and not state.gradients and torch.compiler.is_compiling():
            # Inference kernels (packed oneDNN weights) cannot be traced by Dynamo: raised
            # while it traces, this makes it run the module's frame eagerly, as it is.
            raise NotCompilableError(
                "this optimized module runs fused oneDNN kernels, which torch.compile cannot "
                "trace: it runs eagerly; optimize with layout='plain' for a module to compile"
            )
        # The guard is a submodule: .train()/.eval() on the optimized module set its flag.
        self.contract.check(values, training=self.training)
        if self.weights is not None:
            self.weights.check()
        if self.export_guards is not None:
            try:
                self.export_guards(*values)
            except AssertionError as error:
                raise InputMismatchError(
                    f"torch.export's shape guard fails for these inputs ({error}); {_HINT}"
                ) from None

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.double()``, ``.half()`` and ``.cuda()`` of the optimized module reach
        the guard first (its first submodule): a conversion that would change the dtype or
        device of its tensors is refused here, before any weight is converted."""
        probe = torch.zeros((), dtype=self.float_dtype, device=self._device())
        converted = fn(probe)
        if isinstance(converted, torch.Tensor) and (
            converted.dtype != probe.dtype or converted.device != probe.device
        ):
            raise UserInputError(
                "an optimized module keeps the dtype and device it was verified for ("
                f"{_dtype_name(probe.dtype)} on {probe.device}); it cannot be converted to "
                f"{_dtype_name(converted.dtype)} on {converted.device}: convert the model "
                "(model.double(), model.to(device)) and optimize it again"
            )
        return super()._apply(fn, recurse)

    def _device(self) -> torch.device:
        for spec in self.contract.specs:
            if isinstance(spec, TensorSpec):
                return spec.device
        return torch.device("cpu")

    def extra_repr(self) -> str:
        return self.contract.describe().replace("\n", "; ")


def conform_layouts_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of an optimized module whose graph relies on the memory format of
    some inputs: a tensor argument laid out otherwise (positions sliced from a cumulative
    mask, a transposed view) is passed on as a copy in that format, the same values,
    instead of being refused by the guard. The caller's tensor is not changed. Tensors
    nested in an argument (a cache, a list) and keyword arguments are left to the guard."""
    guard = guard_of(module)
    if guard is None:
        return None
    specs, changed = guard.contract.specs, None
    for flat, index in _argument_positions(module, args).items():
        spec, value = specs[flat] if flat < len(specs) else None, args[index]
        if (
            flat in getattr(guard, "conformable", ())
            and type(spec) is TensorSpec
            and spec.memory_format in _FORMATS
            and value.layout == torch.strided
            and value.dim() == len(spec.dims)
            and not _has_layout(value, spec.memory_format)
        ):
            changed = changed or list(args)
            changed[index] = value.contiguous(memory_format=_FORMATS[spec.memory_format])
    return None if changed is None else (tuple(changed), kwargs)


def conformable_inputs(gm: fx.GraphModule) -> frozenset[int]:
    """Positions of the graph inputs :func:`conform_layouts_hook` may pass on as a copy:
    those no output may alias. An output that is an input, or a view of one, would be the
    copy (or a view of it) where eager returns the caller's tensor, or a copy of its own
    when the layout forbids a view: storage shared otherwise than eager's."""
    from fxopt.ir import facts, ops

    placeholders = gm.graph.find_nodes(op="placeholder")
    aliased = facts.inputs_reached(
        gm.graph.find_nodes(op="output")[0].all_input_nodes,
        through=lambda node: ops.is_compute(node) and ops.info(node, gm).view,
    )
    return frozenset(i for i, node in enumerate(placeholders) if node not in aliased)


def _argument_positions(module: nn.Module, args: tuple) -> dict[int, int]:
    """Graph input position → position in ``args``, for the tensor arguments: an export
    graph takes its inputs flattened (``_in_spec``), a module-level graph as they are."""
    if getattr(module, "_in_spec", None) is None:
        return {i: i for i, value in enumerate(args) if isinstance(value, torch.Tensor)}
    positions, offset = {}, 0
    for index, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            positions[offset] = index
        offset += len(pytree.tree_leaves(value))
    return positions


def pins_a_memory_format(contract: InputContract) -> bool:
    return any(type(s) is TensorSpec and s.memory_format in _FORMATS for s in contract.specs)


def guard_of(module: nn.Module) -> InputGuard | None:
    guard = getattr(module, GUARD_NAME, None)
    return guard if isinstance(guard, InputGuard) else None


def install(
    gm: fx.GraphModule,
    contract: InputContract,
    export_guards=None,
    weights: WeightWatch | None = None,
) -> fx.GraphModule:
    """Put an InputGuard for ``contract`` first in ``gm`` (in place; replaces an old one);
    ``weights`` also checks the sources of its derived weights on every call."""
    remove(gm)
    guard = InputGuard(contract, export_guards, weights)
    if contract.state is not None:  # from here on, the module's .train() / .eval() set it
        guard.train(contract.state.training)
    guard.derived_by = tuple(dict.fromkeys((gm.meta.get(DERIVED_KEY) or {}).values()))
    guard.float_dtype = _float_dtype(gm, contract)
    gm.add_submodule(GUARD_NAME, guard)
    # First among the submodules: .to() / .double() reach it before any weight is converted.
    others = [(name, module) for name, module in gm._modules.items() if name != GUARD_NAME]
    gm._modules.clear()
    gm._modules.update([(GUARD_NAME, guard), *others])
    if _refuse_derived_checkpoint not in gm._load_state_dict_pre_hooks.values():
        gm.register_load_state_dict_pre_hook(_refuse_derived_checkpoint)
    placeholders = gm.graph.find_nodes(op="placeholder")
    anchor = placeholders[-1] if placeholders else None
    if anchor is None:
        return gm
    with gm.graph.inserting_after(anchor):
        gm.graph.call_module(GUARD_NAME, tuple(placeholders))
    gm.recompile()
    return gm


def _float_dtype(gm: fx.GraphModule, contract: InputContract) -> torch.dtype:
    """The dtype of ``gm``'s first floating-point weight, else of its first float input."""
    for tensor in (*gm.parameters(), *gm.buffers()):
        if tensor.is_floating_point() and tensor.layout == torch.strided:
            return tensor.dtype
    for spec in contract.specs:
        if isinstance(spec, TensorSpec) and spec.dtype.is_floating_point:
            return spec.dtype
    return torch.float32


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _refuse_derived_checkpoint(module: nn.Module, state_dict, prefix: str, *_) -> None:
    """``load_state_dict`` pre-hook of an optimized module: a module holding weights a pass
    derived from the model's (a conv with a BatchNorm folded in, packed weights) cannot take
    a checkpoint (of the model, keys and all): the checkpoint's conv weight is not the folded
    one. Raised before anything is copied."""
    guard = guard_of(module)
    if guard is None or not guard.derived_by:
        return
    raise UserInputError(
        f"cannot load a state dict into this optimized module: {', '.join(guard.derived_by)} "
        "derived some of its weights from the model's (a checkpoint holds the weights before "
        "that rewrite). Load the checkpoint into the model (model.load_state_dict(...)) and "
        "optimize it again"
    )


def remove(gm: fx.GraphModule) -> fx.GraphModule:
    """Take the guard out of ``gm`` (in place), e.g. to run passes on the graph alone."""
    for node in gm.graph.find_nodes(op="call_module", target=GUARD_NAME):
        gm.graph.erase_node(node)
    if hasattr(gm, GUARD_NAME):
        delattr(gm, GUARD_NAME)
        gm.recompile()
    return gm


# -- building a contract from a captured graph ------------------------------------------------


def build(
    gm: fx.GraphModule,
    values: Sequence,
    *,
    layout_pinned: bool | Collection[str] = False,
    notes: Sequence[str] = (),
) -> InputContract:
    """The contract of ``gm``: placeholder metadata (symbolic dims) + the shape guards.
    ``layout_pinned``: the inputs whose memory format is fixed to the example's, by name,
    or True for every input (:func:`fxopt.ir.facts.pinned_inputs`)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    names = tuple(str(n.target) for n in placeholders)
    env = shape_env_of(gm)
    if env is None:
        return build_static(gm, values, layout_pinned=layout_pinned, notes=notes)
    # First the dims that are a symbol of their own: they bind the symbols (s0, s1, ... in
    # the order of the inputs), then the dims that are expressions of them.
    symbols: dict[object, str] = {}
    sources: dict[str, str] = {}
    ranges: dict[str, tuple[int, int | None]] = {}
    declared = gm.meta.get(DECLARED_RANGES_KEY) or {}
    for node, name, value in zip(placeholders, names, values):
        for index, size in enumerate(_symbolic_sizes(node, value)):
            expr = env.replace(size.node.expr) if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol and expr not in symbols:
                symbols[expr] = symbol = f"s{len(symbols)}"
                source = sources[symbol] = f"{name}.shape[{index}]"
                ranges[symbol] = declared.get(source) or _range(env, expr)
    specs: list[Spec] = []
    for node, name, value in zip(placeholders, names, values):
        pinned = _pins(layout_pinned, name)
        if isinstance(value, torch.Tensor):
            dims = tuple(
                _dim(env, size, example, symbols)
                for size, example in zip(_symbolic_sizes(node, value), value.shape)
            )
            specs.append(_tensor_spec(value, dims, pinned))
        else:
            specs.append(_other_spec(value, pinned))
    relations = _relations(env, symbols)
    contract = InputContract(
        names, tuple(specs), ranges, relations, sources, bool(layout_pinned), tuple(notes)
    )
    try:
        contract.check(values)
    except InputMismatchError:
        # The example must pass its own contract; if a guard was misread, fall back to the
        # example's shapes: stricter, never wrong.
        return build_static(gm, values, layout_pinned=layout_pinned, notes=notes)
    return contract


def build_static(gm, values, *, layout_pinned=False, notes=()) -> InputContract:
    """A contract that fixes every dim to the example's size (``layout_pinned``: as for
    :func:`build`)."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    names = tuple(str(n.target) for n in placeholders)
    specs = [
        _tensor_spec(v, tuple(int(d) for d in v.shape), _pins(layout_pinned, name))
        if isinstance(v, torch.Tensor)
        else _other_spec(v, _pins(layout_pinned, name))
        for name, v in zip(names, values)
    ]
    return InputContract(names, tuple(specs), layout_pinned=bool(layout_pinned), notes=tuple(notes))


def _pins(layout_pinned: bool | Collection[str], name: str) -> bool:
    if isinstance(layout_pinned, bool):
        return layout_pinned
    return name in layout_pinned


def _symbolic_sizes(node: fx.Node, value: object) -> tuple:
    val = node.meta.get("val")
    same_rank = isinstance(val, torch.Tensor) and isinstance(value, torch.Tensor)
    if same_rank and val.dim() == value.dim():
        return tuple(val.shape)
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _dim(env, size, example: int, symbols: dict) -> int | str:
    if not isinstance(size, torch.SymInt):
        return int(example)
    expr = env.replace(size.node.expr)
    if expr.is_number:
        return int(expr)
    printed = _print(expr, symbols)
    return printed if printed is not None else int(example)  # unbound symbol: static


def _tensor_spec(value: torch.Tensor, dims: tuple, layout_pinned: bool) -> TensorSpec:
    layout = None
    if layout_pinned and value.dim() >= 2:
        layout = memory_format(value)
        if layout is None:  # an unusual layout: its exact strides, for its exact shape
            layout = f"strides={tuple(value.stride())}"
            dims = tuple(int(d) for d in value.shape)
    return TensorSpec(value.dtype, value.device, dims, layout)


def _other_spec(value: object, layout_pinned: bool) -> Spec:
    if isinstance(value, (list, tuple, dict)) and any(
        isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value)
    ):
        leaves, structure = pytree.tree_flatten(value)
        return TreeSpec(
            structure,
            tuple(
                _tensor_spec(leaf, tuple(int(d) for d in leaf.shape), layout_pinned)
                if isinstance(leaf, torch.Tensor)
                else ValueSpec(leaf)
                for leaf in leaves
            ),
        )
    return ValueSpec(value)


def memory_format(value: torch.Tensor) -> str | None:
    """The standard memory format ``value`` is in ("contiguous", "channels_last",
    "channels_last_3d"), or None for any other layout (a strided view)."""
    if value.is_contiguous():
        return "contiguous"
    if value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if value.dim() == 5 and value.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return None


def _range(env, symbol) -> tuple[int, int | None]:
    bounds = env.var_to_range.get(symbol)
    low = _finite(bounds.lower) if bounds is not None else None
    high = _finite(bounds.upper) if bounds is not None else None
    # An empty dim is never run by verification: refused rather than assumed.
    return max(low or 1, 1), high if high is not None and high < 2**62 else None


def _finite(bound) -> int | None:
    """A sympy bound as an int; None for torch's int_oo and sympy's infinities."""
    return int(bound) if getattr(bound, "is_Integer", False) else None


def _print(expr, symbol_names: dict) -> str | None:
    from torch.utils._sympy.printers import PythonPrinter

    if not expr.free_symbols <= set(symbol_names):
        return None
    renamed = expr.xreplace({s: _symbol(symbol_names[s]) for s in expr.free_symbols})
    return PythonPrinter().doprint(renamed)


def _symbol(name: str):
    import sympy

    return sympy.Symbol(name, integer=True, positive=True)


def _relations(env, symbols: dict) -> tuple[str, ...]:
    found: list[str] = []
    for guard in env.guards:
        if _is_backend_heuristic(guard):
            continue
        expr = env.simplify(guard.expr)
        if expr.is_Boolean and expr.is_Atom:  # sympy.true / sympy.false after replacements
            continue
        printed = _print(expr, symbols)
        if printed is None:
            continue  # about sizes no input dim carries (unbacked): checked in the graph
        if printed not in found:
            found.append(printed)
    return tuple(found)


def _is_backend_heuristic(guard) -> bool:
    """The fake convolution asks torch which backend it would pick (a batch-size heuristic,
    e.g. ``s0 < 16``) only to choose the output's memory format. For the same input
    layout every backend returns the same format (checked here for batch 1-32, contiguous
    and channels-last), and a rewrite that relies on a layout pins it in the contract, so
    the heuristic is no fact about the graph's values."""
    location = getattr(guard.sloc, "framework_loc", None)
    filename = getattr(location, "filename", "") or ""
    return filename.endswith("fake_impls.py") and getattr(location, "name", "") == "conv"


def shape_env_of(gm: fx.GraphModule):
    """The ShapeEnv of ``gm``'s symbolic metadata, or None when every shape is static."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None
