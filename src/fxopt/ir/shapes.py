"""Dynamic dimensions and shape propagation: what every node's value looks like, for every
input the graph may be called with.

A captured graph is called later with inputs that are not the example. Which dimensions may
vary is the caller's choice (``dynamic="batch"``: dim 0 of every input; or torch.export's
``dynamic_shapes`` spec); every other fact of the example (dtype, rank, the other sizes) is
fixed. :func:`propagate` runs the graph on fake tensors whose varying dimensions are
*symbols*, so ``node.meta["val"]`` says ``[s0, 3, 224, 224]``, not ``[8, 3, 224, 224]``, and a
pass can only prove what holds for every ``s0`` (see :mod:`fxopt.ir.facts`).

    >>> import torch
    >>> from fxopt.ir.shapes import propagate, resolve_dynamic
    >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(8, 3))
    >>> x = torch.randn(4, 8)
    >>> _ = propagate(gm, (x,), resolve_dynamic("batch", None, (x,), ["x"]))
    >>> linear = list(gm.graph.nodes)[-2]
    >>> batch, features = linear.meta["val"].shape
    >>> isinstance(batch, torch.SymInt), features
    (True, 3)

Sizes are reasoned about *size-obliviously* (torch's ``backed_size_oblivious``): a symbol
is not assumed to differ from 1 just because the example's size did, so batch 1 stays in
range unless an op really treats size 1 differently (broadcasting), which then shows up as
a guard in the contract (:mod:`fxopt.ir.contract`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils import _pytree as pytree

from fxopt.errors import CaptureError, UserInputError

# torch's symbolic shapes take a finite upper bound; this one means "no bound".
_UNBOUNDED = 2**62

#: The values of ``dynamic=``: which dims may vary when no ``dynamic_shapes`` is given.
DYNAMIC_CHOICES = ("batch", "all", "none")


@dataclass(frozen=True)
class DynamicDim:
    """One input dimension that may vary. Dims with the same ``name`` are equal."""

    name: str | None = None
    min: int = 1
    max: int | None = None


#: Per graph input (placeholder), the dims that may vary: {dim index: DynamicDim}.
DynamicDims = tuple[dict[int, DynamicDim], ...]

#: gm.meta key: {"x.shape[0]": (min, max or None)}, the ranges the dynamic dims were given.
#: The shape environment narrows a symbol's range with every guard, including guards the
#: contract drops as no fact about values (fxopt.ir.contract._is_backend_heuristic); the
#: guards it keeps are checked as relations.
DECLARED_RANGES_KEY = "fxopt.declared_ranges"


def declared_ranges(dims: DynamicDims, names) -> dict[str, tuple[int, int | None]]:
    """``{"x.shape[0]": (min, max)}`` for every dynamic dim in ``dims``."""
    return {
        f"{name}.shape[{index}]": (dim.min, dim.max)
        for name, entry in zip(names, dims)
        for index, dim in entry.items()
    }


def resolve_dynamic(
    dynamic: str | bool | None,
    dynamic_shapes: object,
    values: Sequence,
    names: Sequence[str],
) -> DynamicDims:
    """Normalize ``dynamic=`` / ``dynamic_shapes=`` to one dict of dynamic dims per input.

    ``dynamic_shapes`` follows torch.export: a tuple (or a dict by argument name) with, per
    input, None or ``{dim: Dim | Dim.AUTO | Dim.DYNAMIC | Dim.STATIC}`` (or a list per dim).
    """
    if dynamic_shapes is not None:
        if dynamic not in (None, False, "none"):
            raise UserInputError("give either dynamic= or dynamic_shapes=, not both")
        return _from_export_spec(dynamic_shapes, values, names)
    if dynamic in (None, False, "none", "static"):
        return tuple({} for _ in values)
    if dynamic is True or dynamic == "batch":
        return tuple(
            {0: DynamicDim()} if isinstance(v, torch.Tensor) and v.dim() >= 1 else {}
            for v in values
        )
    if dynamic == "all":  # (a dim of size 1 beyond the batch is structure: a decode token)
        return tuple(
            {d: DynamicDim() for d, n in enumerate(v.shape) if d == 0 or n != 1}
            if isinstance(v, torch.Tensor)
            else {}
            for v in values
        )
    raise UserInputError(
        f"unknown dynamic={dynamic!r}; use 'batch' (dim 0 of every input may vary), 'all' "
        "(every dim the model lets vary: sequence and cache lengths), 'none', or "
        "dynamic_shapes= with torch.export's Dim spec"
    )


def _from_export_spec(spec: object, values: Sequence, names: Sequence[str]) -> DynamicDims:
    per_input = _spec_per_input(spec, values, names)
    return tuple(
        {} if entry is None else _input_dims(name, value, entry)
        for name, value, entry in zip(names, values, per_input)
    )


def _spec_per_input(spec: object, values: Sequence, names: Sequence[str]) -> list:
    """One entry of ``dynamic_shapes`` per input, in input order (None: all dims static)."""
    if isinstance(spec, dict):
        unknown = sorted(set(spec) - set(names))
        if unknown:
            raise UserInputError(
                f"dynamic_shapes names {', '.join(map(repr, unknown))}, which are not inputs "
                f"of the model (inputs: {', '.join(names)})"
            )
        return [spec.get(name) for name in names]
    if isinstance(spec, (tuple, list)):
        if len(spec) != len(values):
            raise UserInputError(f"dynamic_shapes has {len(spec)} entries for {len(values)} inputs")
        return list(spec)
    raise UserInputError(
        f"dynamic_shapes must be a tuple or a dict by input name, got {type(spec).__name__}"
    )


def _input_dims(name: str, value: object, entry: object) -> dict[int, DynamicDim]:
    """The dynamic dims one input's ``dynamic_shapes`` entry (a dict or list per dim) gives."""
    if not isinstance(value, torch.Tensor):
        raise UserInputError(
            f"dynamic_shapes gives dims for '{name}', which is not a tensor (with "
            "mode='fx' only top-level tensor inputs can have dynamic dims; "
            "mode='export' takes nested specs)"
        )
    dims: dict[int, DynamicDim] = {}
    items = entry.items() if isinstance(entry, dict) else enumerate(entry)
    for index, dim in items:
        if not isinstance(index, int) or not -value.dim() <= index < value.dim():
            raise UserInputError(
                f"dynamic_shapes: '{name}' has {value.dim()} dims, no dim {index!r}"
            )
        index %= value.dim()
        dynamic = _dynamic_dim(name, index, dim)
        if dynamic is not None:
            dims[index] = dynamic
    return dims


def _dynamic_dim(name: str, index: int, dim: object) -> DynamicDim | None:
    """What one dim of the spec says: None when static, else how the dim may vary."""
    from torch.export import Dim

    if dim is None or dim == Dim.STATIC:
        return None
    if dim in (Dim.AUTO, Dim.DYNAMIC):
        return DynamicDim()
    if isinstance(dim, Dim) and type(dim) is Dim:
        low = max(int(dim.min), 1) if dim.min is not None else 1
        high = int(dim.max) if dim.max is not None and dim.max < _UNBOUNDED else None
        return DynamicDim(dim.__name__, low, high)
    raise UserInputError(
        f"dynamic_shapes: '{name}' dim {index} is {dim!r}; with mode='fx' fxopt "
        "takes Dim('name', min=, max=), Dim.AUTO, Dim.DYNAMIC and Dim.STATIC "
        "(derived dims need mode='export')"
    )


@contextlib.contextmanager
def size_oblivious():
    """Reason about sizes without assuming a symbol differs from 0 or 1 (see module doc)."""
    import torch.fx.experimental._config as symbolic_config

    with symbolic_config.patch(backed_size_oblivious=True):
        yield


def fake_inputs(values: Sequence, dims: DynamicDims, names: Sequence[str]):
    """(fake mode, fake values): each dynamic dim a fresh symbol, equal names made equal."""
    from torch._dynamo.source import LocalSource
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    env = ShapeEnv(specialize_zero_one=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    fakes: list = []
    by_name: dict[str, tuple[str, torch.SymInt]] = {}
    for value, entry, name in zip(values, dims, names):
        if not isinstance(value, torch.Tensor):
            fakes.append(value)
            continue
        sizes = [
            DimDynamic.DYNAMIC if index in entry else DimDynamic.STATIC
            for index in range(value.dim())
        ]
        context = StatelessSymbolicContext(dynamic_sizes=sizes)
        fake = mode.from_tensor(value, symbolic_context=context, source=LocalSource(name))
        for index, dim in entry.items():
            size = fake.shape[index]
            where = f"{name}.shape[{index}]"
            example = value.shape[index]
            if example < dim.min or (dim.max is not None and example > dim.max):
                raise UserInputError(
                    f"{where} is {example} in the example, outside its dynamic range "
                    f"[{dim.min}, {dim.max if dim.max is not None else 'inf'}]"
                )
            if not isinstance(size, torch.SymInt):
                continue
            symbol = size.node.expr
            env.constrain_symbol_range(
                symbol, compiler_min=dim.min, compiler_max=dim.max or _UNBOUNDED
            )
            if dim.name is not None:
                if dim.name in by_name:
                    first_where, first = by_name[dim.name]
                    if int(first.node.hint) != example:
                        raise UserInputError(
                            f"{first_where} and {where} share Dim '{dim.name}' but the example "
                            f"sizes differ ({int(first.node.hint)} and {example})"
                        )
                    with mode:
                        torch._check(first == size)
                else:
                    by_name[dim.name] = (where, size)
        fakes.append(fake)
    return mode, fakes


class NodeFailure(Exception):
    """A node raised while its graph ran on example (or fake) inputs."""

    def __init__(self, node: fx.Node, error: BaseException, inputs: list[str]):
        self.node = node
        self.error = error
        self.inputs = inputs
        # Kept apart from args: fx's Interpreter appends "While executing ..." to those.
        self.message = describe_failure(node, error, inputs)
        super().__init__(self.message)


def describe_failure(node: fx.Node, error: BaseException, inputs: list[str]) -> str:
    target = node.target if node.op != "call_function" else getattr(node.target, "__name__", "")
    shapes = f" on inputs {', '.join(inputs)}" if inputs else ""
    line = _user_line(node)
    where = f" ({line})" if line else ""
    text = str(error).strip().splitlines()
    message = text[0] if text else type(error).__name__
    return f"node '{node.name}' ({node.op} {target}){where} fails{shapes}: {message}"


def _user_line(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [line.strip() for line in trace.strip().splitlines()]
    files = [line for line in lines if line.startswith("File ")]
    return files[-1].replace("File ", "", 1) if files else None


def _describe_value(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__ if not isinstance(value, (int, float, bool)) else repr(value)


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, storing each value's metadata; names a failing node.

    With a fake mode every parameter and buffer the graph reads is read as a fake copy
    (made once per tensor), and a submodule is called with its fakes swapped into its
    parameter and buffer tables: a graph that writes into a buffer
    (``self.count.add_(1)``) changes the fake, never the real one. (torch's ShapeProp
    deep-copies the whole module to fake tensors instead: graph, code and all, which was
    most of capturing a 100k-node model.)
    """

    def __init__(self, gm: fx.GraphModule, store: bool, values: dict | None = None, fake_mode=None):
        super().__init__(gm, garbage_collect_values=values is None)
        self.store = store
        self.values = values
        self.fake_mode = fake_mode
        self._fakes: dict[int, torch.Tensor] = {}  # id(real tensor) -> its fake
        # Calls by signature (_call_key) -> their output's layout
        self._outputs: dict[tuple, torch.Tensor] = {}
        self._tensor_metas: dict[tuple, object] = {}  # layout -> tensor_meta (record)

    def _fake(self, value: object) -> object:
        if not isinstance(value, torch.Tensor) or self.fake_mode is None:
            return value
        fake = self._fakes.get(id(value))
        if fake is None:
            # Static: a weight's sizes are facts, only the inputs' dims may be symbolic.
            fake = self._fakes[id(value)] = self.fake_mode.from_tensor(value, static_shapes=True)
        return fake

    def get_attr(self, target, args, kwargs):
        return self._fake(super().get_attr(target, args, kwargs))

    def call_module(self, target, args, kwargs):
        if self.fake_mode is None:
            return super().call_module(target, args, kwargs)
        module = self.fetch_attr(target)
        # The fakes swapped into the module's own tables for the call, and back after: what
        # torch.func.functional_call does, without its checks (3x the cost of a conv here).
        swapped = [
            (table, name, tensor)
            for m in module.modules()
            for table in (m._parameters, m._buffers)
            for name, tensor in table.items()
            if tensor is not None
        ]
        try:
            for table, name, tensor in swapped:
                table[name] = self._fake(tensor)
            return module(*args, **kwargs)
        finally:
            for table, name, tensor in swapped:
                table[name] = tensor

    def run_node(self, node: fx.Node):
        from torch._dispatch.python import enable_python_dispatcher

        try:
            if self.fake_mode is None:
                result = super().run_node(node)
            else:
                with self.fake_mode, enable_python_dispatcher():
                    result = self._run_on_fakes(node)
        except NodeFailure:
            raise
        except Exception as error:
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            shown = [_describe_value(v) for v in pytree.tree_leaves((args, kwargs))]
            shown = [s for s in shown if "[" in s][:4]
            raise NodeFailure(node, error, shown) from error
        if self.store:
            record(node, result, self._tensor_metas)
        if self.values is not None:
            self.values[node] = result
        return result

    def _run_on_fakes(self, node: fx.Node) -> object:
        """``node``'s value; a call with the signature of an earlier one (:func:`_call_key`)
        gets that one's fake value instead of running again. The same fake tensor object:
        making a new one of its layout cost 1 ms with symbolic sizes (100 s of a 100k-node
        capture), and a node's fake value stands for its layout, not its memory (nothing
        reads storage identity off this graph's metadata)."""
        key = inputs = None
        if node.op in _CALLS and _repeatable(node, self.module):
            inputs = self.fetch_args_kwargs_from_env(node)
            key = _call_key(node, self.module, *inputs)
        seen = self._outputs.get(key) if key is not None else None
        if seen is not None:
            return seen
        result = super().run_node(node)
        if key is not None and _fresh_output(result, inputs):
            self._outputs[key] = result
        return result


_CALLS = ("call_module", "call_function", "call_method")


def _tensor_metadata(tensor: torch.Tensor, known: dict | None):
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    key = _tensor_key(tensor) if known is not None else None
    if key is None:
        return _extract_tensor_metadata(tensor)
    found = known.get(key)
    if found is None:
        found = known[key] = _extract_tensor_metadata(tensor)
    return found


def _repeatable(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node``'s output layout follows from its signature (:func:`_call_key`).

    A model repeats its blocks: a 100k-node one calls the same conv thousands of times on
    inputs of one shape, and running each call on fake tensors (with fakes of its
    weights, and autograd's bookkeeping) was most of its capture. Repeatable: an op that
    :mod:`fxopt.ir.ops` knows as pure, not random, no view and writing nothing; for a
    module, also one of torch.nn's own leaf classes without hooks. Guards are no concern:
    an identical call adds the same guards again.
    """
    from fxopt.ir import ops

    info = ops.info(node, gm)
    if not info.removable or info.view or info.inplace:
        return False
    if node.op != "call_module":
        return True
    module = ops.submodule(gm, str(node.target))
    return type(module).__module__.startswith("torch.nn.") and not module._modules


def _call_key(node: fx.Node, gm: fx.GraphModule, args: tuple, kwargs: dict) -> tuple | None:
    """A key two calls share only when their outputs have the same layout, or None: the
    op (for a module, its class, its settings, every plain attribute with ``training``
    among them, and the layout of its weights), the layout of the inputs (symbolic sizes
    and strides as expressions), other arguments by value, grad and autocast modes."""
    from fxopt.ir import ops

    tensors: list = []
    if node.op == "call_module":
        module = ops.submodule(gm, str(node.target))
        settings = []
        for name, value in module.__dict__.items():
            if name.startswith("_"):
                continue  # the tables (parameters, buffers, hooks) and private bookkeeping
            if not isinstance(value, (int, float, str, bool, tuple, type(None))):
                return None
            settings.append((name, value))
        op: object = (type(module), tuple(settings), tuple(module._parameters))
        op += (tuple(module._buffers),)
        tensors = [*module._parameters.values(), *module._buffers.values()]
    else:
        op = (node.op, node.target)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    keys = [_value_key(v) for v in [*tensors, *leaves]]
    if any(k is None for k in keys):
        return None
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    key = (op, tuple(keys), spec, modes, torch._C._is_any_autocast_enabled())
    try:
        hash(key)
    except TypeError:  # a setting or an argument that holds something unhashable
        return None
    return key


def _tensor_key(tensor: torch.Tensor) -> tuple | None:
    from torch._subclasses.fake_tensor import FakeTensor

    plain = type(tensor) in (torch.Tensor, torch.nn.Parameter, FakeTensor)
    if not plain or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    return (
        tuple(_int_key(s) for s in tensor.shape),
        tuple(_int_key(s) for s in tensor.stride()),
        _int_key(tensor.storage_offset()),
        tensor.dtype,
        tensor.device,
        tensor.requires_grad,
    )


def _value_key(value: object) -> tuple | None:
    if value is None:
        return ("none",)  # an absent weight (a conv without bias), or an input None
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    if isinstance(value, (int, float, str, bool)):
        return ("value", type(value), value)
    if isinstance(value, torch.SymInt):
        return ("symint", _int_key(value))
    return None


def _int_key(value) -> object:
    """A size or stride as a hashable: the int, or the symbol's expression."""
    return value.node.expr if isinstance(value, torch.SymInt) else value


def _fresh_output(result: object, inputs: object) -> bool:
    """One fake tensor at offset 0 of a storage no input has, sized by the inputs' symbols
    only and holding no known value: what a new tensor of its layout stands in for (not
    an input returned as it is, nor a view of one, nor a data-dependent size).
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.multiprocessing.reductions import StorageWeakRef

    if type(result) is not FakeTensor or result.constant is not None:
        return False
    if result.storage_offset() != 0 or free_unbacked_symbols(result):
        return False
    storage = StorageWeakRef(result.untyped_storage())
    tensors = [v for v in pytree.tree_leaves(inputs) if isinstance(v, torch.Tensor)]
    return all(StorageWeakRef(v.untyped_storage()) != storage for v in tensors)


def record(node: fx.Node, result: object, known: dict | None = None) -> None:
    """Store ``result``'s metadata on ``node`` (``val``, and ShapeProp's ``tensor_meta``).

    ``known`` caches ``tensor_meta`` by layout for one run: with symbolic sizes, finding a
    tensor's memory format takes symbolic arithmetic (about 0.4 ms), the same for every
    node of the same layout."""
    leaves = pytree.tree_leaves(result)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        node.meta["tensor_meta"] = pytree.tree_map(
            lambda v: _tensor_metadata(v, known) if isinstance(v, torch.Tensor) else v, result
        )
    if isinstance(result, (torch.Tensor, torch.SymInt, tuple, list)):
        node.meta["val"] = result
    node.meta["type"] = type(result)


def propagate(gm: fx.GraphModule, values: Sequence, dims: DynamicDims) -> str | None:
    """Fill every node's metadata by running ``gm`` on fake inputs (symbolic where ``dims``
    says so). Returns a note when dynamic dims had to be dropped, else None.

    Falls back to static fake shapes when symbolic propagation fails, and to a real run
    (forked RNG, buffers restored) when an op has no fake implementation. Raises
    CaptureError naming the node when the graph fails on the example itself.

    The graph runs without autograd: the metadata is of layouts (sizes, strides, dtypes),
    ``requires_grad`` is False throughout. Autograd's bookkeeping on fake tensors tripled
    the cost of an elementwise op, and a call that repeats an earlier one's signature
    gets a new tensor of its layout (:func:`_repeatable`), which under autograd would be
    a leaf that in-place ops refuse.
    """
    with torch.no_grad():
        return _propagate(gm, values, dims)


def _propagate(gm: fx.GraphModule, values: Sequence, dims: DynamicDims) -> str | None:
    note = None
    if any(dims):
        names = _placeholder_names(gm)
        try:
            mode, fakes = fake_inputs(values, dims, names)
            with size_oblivious():
                _Recorder(gm, store=True, fake_mode=mode).run(*fakes)
            return None
        except UserInputError:
            raise
        except Exception as error:  # static shapes below: stricter, still correct
            reason = error.error if isinstance(error, NodeFailure) else error
            note = (
                f"dynamic dims dropped ({type(reason).__name__}: "
                f"{str(reason).strip().splitlines()[0][:160] if str(reason).strip() else ''}); "
                "the graph was optimized for the example's shapes"
            )
    from torch._subclasses import FakeTensorMode

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in values]
        _Recorder(gm, store=True, fake_mode=mode).run(*fakes)
        return note
    except Exception:
        pass  # no fake kernel for some op: a real run below
    saved = {name: b.detach().clone() for name, b in gm.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            _Recorder(gm, store=True).run(*values)
    except NodeFailure as failure:
        raise CaptureError(f"the model fails on its example inputs: {failure.message}") from None
    except Exception as error:
        raise CaptureError(
            f"the model fails on its example inputs: {type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        ) from error
    finally:
        with torch.no_grad():
            for name, buffer in gm.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])
    return note


def _placeholder_names(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.find_nodes(op="placeholder")]


def placeholder_values(gm: fx.GraphModule, inputs: Sequence) -> tuple:
    """The value each placeholder of ``gm`` receives when called with ``inputs``.

    Export graphs flatten their inputs (``_in_spec``); module-level graphs take them as
    they are, with defaults for parameters the caller leaves out.
    """
    placeholders = gm.graph.find_nodes(op="placeholder")
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is not None:
        leaves, _ = pytree.tree_flatten((tuple(inputs), {}))
        return tuple(leaves)
    values = list(inputs)
    for node in placeholders[len(values) :]:
        values.append(node.args[0] if node.args else None)
    return tuple(values[: len(placeholders)])
