"""Capture a model as a torch.fx GraphModule, at module level or at ATen level.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> gm = trace(model, torch.randn(2, 4), mode="fx")
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']

``mode="fx"`` is ``torch.fx.symbolic_trace``: ``call_module`` nodes are kept, so module
structure (and BatchNorm modules) stay visible. ``mode="export"`` is ``torch.export`` with
the core-ATen decompositions (``scaled_dot_product_attention`` kept whole: eager's fused
kernel), returned as a plain GraphModule whose parameters and buffers
are attributes (``get_attr`` nodes). ``mode="auto"`` takes fx when it captures the model
faithfully (it traces, and the graph computes what the model computes, buffer updates
included) and export otherwise: most Hugging Face models are not symbolically traceable.
``gm.meta["fxopt.capture"]`` says which mode was used and why.

Every node carries ``meta["val"]``: its value as a fake tensor, whose dynamic dims are
symbols (``dynamic="batch"``, or torch.export's ``dynamic_shapes``; see
:mod:`fxopt.ir.shapes`). The user's model is never touched: tracing works on a
:func:`~fxopt.ir.copying.shared_copy` (its own modules and attributes, the model's weights),
and every run of the model is :func:`~fxopt.ir.copying.isolated`. The captured graph reads
the model's own weight storage: capture copies no weight.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxopt import caches, op_failures
from fxopt.errors import CaptureError, UserInputError
from fxopt.ir import facts, ops, shapes
from fxopt.ir.contract import ExportGuards
from fxopt.ir.copying import isolated, may_change_state, shared_copy

Mode = Literal["auto", "fx", "export"]
MODES: tuple[str, ...] = ("auto", "fx", "export")
_TORCH_DIR = os.path.dirname(torch.__file__)
_FXOPT_DIR = os.path.dirname(os.path.abspath(__file__))
#: gm.meta key: {"mode", "requested", "dynamic", "notes"} of the capture.
CAPTURE_KEY = "fxopt.capture"
#: gm.meta key: torch.export's own guard function, kept for the input guard.
EXPORT_GUARDS_KEY = "fxopt.export_guards"


def as_input_tuple(example_inputs: object) -> tuple:
    """A tensor becomes a 1-tuple; tuples and lists become tuples."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise UserInputError(
        f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs)}"
    )


def trace(
    model: nn.Module,
    example_inputs: object,
    mode: Mode = "fx",
    *,
    dynamic: str | bool | None = None,
    dynamic_shapes: object = None,
    _expected_cache: dict | None = None,
) -> fx.GraphModule:
    """Capture ``model`` (never mutated) as a GraphModule with shape metadata on every node.

    ``dynamic="batch"`` lets dim 0 of every input vary (symbolic); ``dynamic_shapes`` takes
    torch.export's spec. By default every dim is the example's. The model runs once on
    its example (fake tensors forgive mistakes real kernels do not); with
    ``_expected_cache`` (:func:`fxopt.verify.check_outputs`'s: fxopt's own caller spares a
    run of the model), its output is kept there.
    """
    if not isinstance(model, nn.Module):
        raise UserInputError(f"expected an nn.Module to capture, got {type(model).__name__}")
    if mode not in MODES:
        raise UserInputError(f"unknown capture mode '{mode}'; use one of {', '.join(MODES)}")
    inputs = as_input_tuple(example_inputs)
    check_inputs(model, inputs)
    caches.register(model, inputs)
    caches.check_example(inputs)
    try:
        model_copy = shared_copy(model)
    except Exception as error:
        raise CaptureError(
            f"cannot copy {type(model).__name__} to capture it (fxopt never rewrites your "
            f"model object): {error}"
        ) from error
    if mode == "fx":
        gm = _trace_fx(model_copy, inputs, dynamic, dynamic_shapes, requested="fx")
    elif mode == "export":
        gm = _trace_export(model_copy, inputs, dynamic, dynamic_shapes, requested="export")
    else:  # runs the model
        return _trace_auto(model, model_copy, inputs, dynamic, dynamic_shapes, _expected_cache)
    # Fake tensors forgive some mistakes the real kernels do not (an int64 input into a
    # float linear): the model itself must run on its example. Then it runs twice more,
    # beside the graph, as auto mode's check does: a graph that fixed Python state changed
    # in forward (self.calls += 1) answers the first call's way every time.
    with isolated(model) as reference:
        failure = _eager_failure(reference, inputs, _expected_cache, isolate=False)
        if failure is not None:
            raise CaptureError(failure)
        unfaithful = differs_from_model(reference, gm, inputs, model_ran_once=True)
    if unfaithful is not None:
        raise CaptureError(
            f"mode='{mode}' does not capture what {type(model).__name__} computes: the graph "
            f"{unfaithful}. {capture_hint(mode)}"
        )
    return gm


def capture_hint(mode: str) -> str:
    """What a capture mode leaves out, and what to try instead."""
    if mode == "fx":
        return (
            "fx capture does not record Python state changed in forward (self.count += 1), "
            "RNG seeding inside forward or data-dependent control flow; try mode='export'"
        )
    return (
        "torch.export fixes Python state changed in forward (self.calls += 1) at its value "
        "when captured; move that state out of forward, or try mode='fx'"
    )


def check_inputs(model: nn.Module, inputs: tuple) -> None:
    """Example inputs the model's ``forward`` can take, as fxopt passes them (positionally)."""
    for index, value in enumerate(pytree.tree_leaves(inputs)):
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            raise UserInputError(
                f"example input {index} is on the meta device: it has no values, and fxopt "
                "runs the model to verify every rewrite; give real tensors"
            )
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    params = list(signature.parameters.values())
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if keyword_only:
        raise UserInputError(
            f"{type(model).__name__}.forward has keyword-only parameters "
            f"({', '.join(keyword_only)}); fxopt passes example inputs positionally: wrap "
            "the model in a module whose forward takes them positionally"
        )
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    required = [p.name for p in positional if p.default is p.empty]
    if not len(required) <= len(inputs) <= len(positional):
        names = ", ".join(p.name for p in positional)
        raise UserInputError(
            f"{type(model).__name__}.forward takes {len(required)}"
            f"{'' if len(required) == len(positional) else f' to {len(positional)}'} "
            f"inputs ({names}), but {len(inputs)} example inputs were given"
        )


def _trace_auto(
    pristine, model, inputs, dynamic, dynamic_shapes, expected_cache=None
) -> fx.GraphModule:
    # fx tracing runs the module's Python code, and so its side effects (self.count += 1
    # increments the real buffer): ``model`` is the copy fx traces, ``pristine`` the
    # caller's, never run or changed (only copies of it run), which export, if needed,
    # starts again from.
    try:
        gm = _trace_fx(model, inputs, dynamic, dynamic_shapes, requested="auto")
    except CaptureError as fx_error:
        if _fails_on_inputs(fx_error):
            raise  # the inputs are wrong for the model; export would fail the same way
        reason = f"fx cannot capture it ({_first_line(fx_error.__cause__ or fx_error)})"
        try:
            return _trace_export(
                shared_copy(pristine), inputs, dynamic, dynamic_shapes, "auto", [reason]
            )
        except CaptureError as export_error:
            raise CaptureError(
                f"cannot capture {type(model).__name__} with fx ({_first_line(fx_error)}) or "
                f"with export ({_first_line(export_error)})"
            ) from export_error
    # One run of the model serves both checks (on a 100k-node model a call takes ~1 s).
    with isolated(pristine) as reference:
        failure = _eager_failure(reference, inputs, expected_cache, isolate=False)
        if failure is not None:
            raise CaptureError(failure)
        unfaithful = differs_from_model(reference, gm, inputs, model_ran_once=True)
    if unfaithful is None:
        return gm
    reason = f"the fx graph does not compute what the model does ({unfaithful})"
    exported = _trace_export(
        shared_copy(pristine), inputs, dynamic, dynamic_shapes, "auto", [reason]
    )
    also = differs_from_model(pristine, exported, inputs)
    if also is not None:
        raise CaptureError(
            f"neither capture computes what {type(model).__name__} computes: fx {unfaithful}; "
            f"export {also}. Move what torch cannot trace (seeding the RNG, Python state "
            "changed in forward) out of forward"
        )
    return exported


def _fails_on_inputs(error: CaptureError) -> bool:
    return str(error).startswith("the model fails on its example inputs")


def differs_from_model(
    model: nn.Module, gm: fx.GraphModule, inputs: Sequence, *, model_ran_once: bool = False
) -> str | None:
    """Why ``gm`` is not a faithful capture of ``model`` on ``inputs``, or None.

    Runs both twice (each :func:`~fxopt.ir.copying.isolated`), under two seeds, and
    compares outputs and then buffers: fx drops buffer updates (``self.count += 1``: the
    second call differs) and bakes in RNG seeding done in forward (the draws no longer
    follow the caller's seed). With ``model_ran_once``, ``model`` is already isolated by
    the caller, who ran it once on ``inputs`` under seed 0; ``gm`` first makes the same
    call, so both have made the same calls when they are compared.
    """
    from fxopt import verify

    runs = []
    for module in (model, gm):
        session = (
            contextlib.nullcontext(module)
            if module is model and model_ran_once
            else isolated(module)
        )
        try:
            with session as running, torch.no_grad(), _quiet():
                if model_ran_once and module is gm and may_change_state(gm):
                    verify.run_seeded(running, verify.fresh(inputs), 0)
                before = {name: b.clone() for name, b in running.named_buffers()}
                outputs = [
                    verify.run_seeded(running, verify.fresh(inputs), seed) for seed in (1, 2)
                ]
                buffers = {name: b.clone() for name, b in running.named_buffers()}
        except Exception as error:
            return f"it fails on the example: {type(error).__name__}: {_first_line(error)}"
        runs.append((outputs, buffers, before))
    (expected, buffers, before), (actual, graph_buffers, _) = runs
    for call, (want, got) in enumerate(zip(expected, actual)):
        outputs = verify.compare(want, got)
        if not outputs.ok:
            return f"outputs of call {call + 1} differ: {outputs.message}"
    for name, value in buffers.items():
        # A buffer the graph does not hold is one forward never read: wrong only if the
        # model writes it.
        missing = name not in graph_buffers and not _same(before[name], value)
        if missing or (name in graph_buffers and not _same(value, graph_buffers[name])):
            return f"buffer '{name}' is not updated as the model updates it"
    return None


def _same(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Equal by :func:`fxopt.verify.compare`; bit-equal buffers (nearly all of them: a
    100k-node model has 75k) by a check a hundred times cheaper."""
    from fxopt import verify

    same_kind = expected.shape == actual.shape and expected.dtype == actual.dtype
    return (same_kind and torch.equal(expected, actual)) or verify.compare(expected, actual).ok


def _trace_fx(model, inputs, dynamic, dynamic_shapes, requested: str) -> fx.GraphModule:
    try:
        # Isolated: tracing runs forward's Python, and an op on a real tensor attribute
        # (self.calls.add_(1)) runs for real, into storage the copy shares with the model.
        with _quiet(), isolated(model):
            gm = fx.symbolic_trace(model)
    except Exception as error:
        raise CaptureError(_describe_failure("fx", model, error)) from error
    values = shapes.placeholder_values(gm, inputs)
    names = [str(n.target) for n in gm.graph.find_nodes(op="placeholder")]
    dims = shapes.resolve_dynamic(dynamic, dynamic_shapes, values, names)
    try:
        with _quiet():
            note = shapes.propagate(gm, values, dims)
    except CaptureError as error:
        if not _fails_on_inputs(error):
            raise CaptureError(str(error)) from None
        # Named by fx node; the model's own run names the aten op, its operands and line.
        eager = _eager_failure(model, inputs)
        if eager is not None:
            raise CaptureError(eager) from None
        # The model runs: it is the graph that fails (an argument left at its default, such
        # as mask=None, is traced as a tensor input all the same).
        detail = str(error).split(": ", 1)[-1]
        raise CaptureError(
            f"the fx graph of {type(model).__name__} fails on the example inputs where the "
            f"model itself runs ({detail}); fx traces every forward argument as a tensor, "
            "one left at its default (mask=None) included: try mode='export'"
        ) from None
    if note is None:
        gm.meta[shapes.DECLARED_RANGES_KEY] = shapes.declared_ranges(dims, names)
    else:
        dims = tuple({} for _ in dims)  # propagated with static shapes
    _set_info(gm, "fx", requested, dims, [note] if note else [])
    return gm


def propagate_shapes(gm: fx.GraphModule, inputs: Sequence) -> None:
    """Fill every node's shape metadata for ``inputs`` (static shapes)."""
    values = shapes.placeholder_values(gm, inputs)
    with _quiet():
        shapes.propagate(gm, values, tuple({} for _ in values))


def _trace_export(
    model, inputs, dynamic, dynamic_shapes, requested: str, notes: Sequence[str] = ()
) -> fx.GraphModule:
    # torch.export merges example tensors that are the same object into one placeholder.
    inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
    notes = list(notes)
    if dynamic_shapes is not None:
        if dynamic not in (None, False, "none"):
            raise UserInputError("give either dynamic= or dynamic_shapes=, not both")
        spec = dynamic_shapes
    else:
        shapes.resolve_dynamic(dynamic, None, inputs, [""] * len(inputs))  # validates
        spec = _auto_spec(inputs, dynamic) if dynamic in (True, "batch", "all") else None
    try:
        # On a copy: a failed export can leave symbolic state behind in the module it traced.
        program = _export(shared_copy(model) if spec is not None else model, inputs, spec)
    except Exception as error:
        if spec is None or dynamic_shapes is not None:
            raise CaptureError(_describe_failure("export", model, error, inputs)) from error
        program = None
        if dynamic == "all":
            # Size-oblivious reasoning keeps an example's size-1 batch dynamic; some
            # models' size arithmetic (a sliding window's Max(0, n - w)) defeats it. The
            # lengths matter more than a size-1 batch: torch's own reasoning keeps them.
            with contextlib.suppress(Exception):
                program = _export(shared_copy(model), inputs, spec, oblivious=False)
                notes.append(
                    "dims of size 1 fixed (the model's size arithmetic needs them known: "
                    f"{type(error).__name__}: {_first_line(error)[:120]})"
                )
        if program is None:
            # dynamic="batch" is a default, not a demand: a model whose code needs the
            # example's batch (or that size-oblivious reasoning cannot follow) gets
            # static shapes.
            notes.append(
                f"dynamic dims dropped ({type(error).__name__}: {_first_line(error)[:160]}); "
                "the graph was optimized for the example's shapes"
            )
            try:
                program = _export(model, inputs, None)
            except Exception as static_error:
                raise CaptureError(
                    _describe_failure("export", model, static_error, inputs)
                ) from static_error
    dynamic_program = any(_symbolic(d) for d in _placeholder_sizes(program))
    # The decomposition retraces the graph: with the same size-oblivious reasoning, or a
    # broadcast check (x + conv(x)) would add "batch != 1" to a dynamic batch.
    oblivious = shapes.size_oblivious() if dynamic_program else contextlib.nullcontext()
    try:
        with warnings.catch_warnings(), _quiet(), oblivious:
            warnings.simplefilter("ignore", FutureWarning)
            program = program.run_decompositions(_core_aten_but_attention())
    except Exception as error:
        # GPT-2 under torch 2.13: export succeeds, the core-ATen decomposition does not.
        notes.append(
            f"core-ATen decomposition failed ({type(error).__name__}: {_first_line(error)}); "
            "the graph keeps torch.export's own ops"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        module = program.module()
    gm = plain_graph_module(module)
    dims = tuple(
        {i: shapes.DynamicDim() for i, d in enumerate(n.meta["val"].shape) if _symbolic(d)}
        if isinstance(n.meta.get("val"), torch.Tensor)
        else {}
        for n in gm.graph.find_nodes(op="placeholder")
    )
    # torch.export traces with the example's strides and records no guard on them: a
    # .contiguous() of a contiguous example, or a reshape that was a view for it, is gone
    # from the graph. So an export graph is valid only for inputs laid out like the example.
    facts.pin_every_input(gm)
    _set_info(gm, "export", requested, dims, notes)
    return gm


def _export(model: nn.Module, inputs: tuple, spec, *, oblivious: bool = True):
    # Size-oblivious reasoning only for dynamic dims: export makes every dim a symbol at
    # first, and an example dim of size 1 (broadcast against 4) then cannot specialize.
    oblivious = (
        shapes.size_oblivious() if spec is not None and oblivious else contextlib.nullcontext()
    )
    with warnings.catch_warnings(), _quiet(), oblivious:
        # torch 2.13's own pytree deprecation warning, raised inside export.
        warnings.simplefilter("ignore", FutureWarning)
        return torch.export.export(model, inputs, dynamic_shapes=spec)


def _placeholder_sizes(program) -> list:
    return [
        size
        for node in program.graph.find_nodes(op="placeholder")
        if isinstance(node.meta.get("val"), torch.Tensor)
        for size in node.meta["val"].shape
    ]


def _core_aten_but_attention():
    """torch.export's core-ATen decompositions, but for scaled_dot_product_attention: the
    op eager runs (one fused kernel) instead of its math (two matmuls, a softmax and the
    mask handling around it: 25 ms against 12.5 ms on BERT-base's 12 layers at 128 tokens).
    A rewrite that needs it decomposed (Circle's) decomposes it itself."""
    table = torch.export.default_decompositions()
    for op in ops.aten_overloads("scaled_dot_product_attention"):
        table.pop(op, None)
    return table


def _symbolic(size: object) -> bool:
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


def _auto_spec(inputs: tuple, dynamic: str | bool) -> tuple:
    """torch.export's dynamic_shapes for "dim 0 of every input tensor may vary" ("batch")
    or "every dim may, where the model lets it" ("all"), as torch.export walks the inputs:
    a registered class (a KV cache) by the children its pytree flattening gives."""
    from torch.export import Dim

    def spec(value):
        if isinstance(value, torch.Tensor):
            if dynamic != "all":
                return {0: Dim.AUTO} if value.dim() else None
            # A dim of size 1 beyond the batch is a structure (a decode step's one new
            # token), not a length: it stays as it is.
            dims = [d for d, size in enumerate(value.shape) if d == 0 or size != 1]
            return dict.fromkeys(dims, Dim.AUTO) or None
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*map(spec, value))
        if isinstance(value, (list, tuple)):
            return type(value)(map(spec, value)) if type(value) in (list, tuple) else None
        if isinstance(value, dict):
            return {key: spec(item) for key, item in value.items()}
        node = pytree.SUPPORTED_NODES.get(type(value))
        return None if node is None else [spec(child) for child in node.flatten_fn(value)[0]]

    return tuple(map(spec, inputs))


def _set_info(gm, mode: str, requested: str, dims, notes: Sequence[str]) -> None:
    names = [str(n.target) for n in gm.graph.find_nodes(op="placeholder")]
    gm.meta[CAPTURE_KEY] = {
        "mode": mode,
        "requested": requested,
        "dynamic": [f"{name}.shape[{i}]" for name, entry in zip(names, dims) for i in entry],
        "notes": list(notes),
    }


def capture_info(gm: fx.GraphModule) -> dict:
    """What :func:`trace` recorded about how ``gm`` was captured."""
    return dict(gm.meta.get(CAPTURE_KEY) or {})


def plain_graph_module(module: fx.GraphModule) -> fx.GraphModule:
    """``ExportedProgram.module()`` as a plain, copyable GraphModule, its guard set aside.

    The guard function (``_guards_fn``) checks the shape conditions export proved the graph
    for; it is kept in ``gm.meta`` and becomes part of the optimized module's input guard,
    not a node the passes would have to step around.
    """
    graph = module.graph
    guards = None
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            guards = getattr(module, str(node.target), None)
            graph.erase_node(node)
    _read_written_buffers_through_copies(graph)
    # Export's tracer class cannot be rebuilt when a pickled GraphModule is loaded (it
    # needs a scope root): with none recorded, torch.save/torch.load work.
    graph._tracer_cls = None
    gm = fx.GraphModule(module, graph, class_name="ExportedGraphModule")
    gm.meta.update(getattr(module, "meta", {}))
    if guards is not None:
        gm.meta[EXPORT_GUARDS_KEY] = ExportGuards(guards)
    return gm


def _read_written_buffers_through_copies(graph: fx.Graph) -> None:
    """Let autograd run through an export graph that updates buffers.

    Export functionalizes a buffer update (BatchNorm's running statistics in training mode)
    into a functional op that reads the buffer, then ``copy_`` of the new value into it at
    the end. Autograd saves the buffer it read for the backward pass, and the ``copy_``
    then invalidates it: ``backward()`` fails ("modified by an inplace operation"). Reading
    a clone instead keeps the forward values and makes the graph trainable.
    """
    writes = [n for n in graph.nodes if ops.is_compute(n) and _is_copy_into(n)]
    for write in writes:
        buffer = write.args[0]
        if not isinstance(buffer, fx.Node) or buffer.op != "get_attr":
            continue
        readers = [user for user in buffer.users if user is not write]
        if not readers:
            continue
        with graph.inserting_after(buffer):
            copy = ops.emit(graph, "clone", buffer)
        copy.meta.update(buffer.meta)
        for reader in readers:
            reader.replace_input_with(buffer, copy)


def _is_copy_into(node: fx.Node) -> bool:
    op = ops.info(node)
    return op.name == "copy" and op.inplace


@contextlib.contextmanager
def _quiet():
    """Silence torch's own logging of failures fxopt reports itself (fake-tensor kernels,
    export's 0/1 specialization notes): the user gets one message, not a log."""
    names = (
        "torch._subclasses.fake_tensor",
        "torch._export",
        "torch.export",
        "torch._dynamo",
        "torch.fx.experimental.symbolic_shapes",
        "torch.fx.passes.shape_prop",
    )
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _user_frame(error: BaseException) -> str | None:
    """'file:line: code' of the innermost traceback frame outside torch and fxopt."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_TORCH_DIR) and not f.filename.startswith(_FXOPT_DIR)
    ]
    if not frames:
        return None
    frame = frames[-1]
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.filename}:{frame.lineno}{code}"


def _export_user_line(text: str) -> str | None:
    """torch.export errors quote the user's code as 'File "...", line N, in f' + code."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("File ") and _TORCH_DIR not in stripped:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            location = stripped.replace("File ", "", 1)
            return f"{location}: {code}" if code else location
    return None


def _describe_failure(
    mode: str, model: nn.Module, error: BaseException, inputs: tuple | None = None
) -> str:
    text = str(error)
    if inputs is not None:
        eager = _eager_failure(model, inputs)
        if eager is not None:  # the model itself fails on these inputs: say that, not export
            return eager
    where = _user_frame(error) if mode == "fx" else _export_user_line(text)
    where = where or _user_frame(error)
    message = _first_line(error)
    located = f" at {where}" if where else ""
    control_flow = "control flow" in text or "data-dependent" in text
    hint = "; remove Python control flow that depends on tensor values" if control_flow else ""
    other = "export" if mode == "fx" else "fx"
    if other == "fx" and not _fx_traceable(model):
        suggestion = f"mode='fx' cannot capture it either{hint}"
    else:
        suggestion = f"try mode='{other}'{hint}"
    name = type(model).__name__
    return f"cannot capture {name} with mode='{mode}': {message}{located}. {suggestion}."


def _eager_failure(
    model: nn.Module, inputs: tuple, expected_cache: dict | None = None, *, isolate: bool = True
) -> str | None:
    """How the model itself fails on ``inputs`` (:func:`~fxopt.ir.copying.isolated`, unless
    the caller isolated it already: ``isolate=False``; with copies of the inputs, seeded as
    verification seeds the example): one line naming the op, its operands and the model's
    line; None when it runs. Its output then goes into ``expected_cache``
    (:func:`fxopt.verify.check_outputs`'s), so verification need not run it again."""
    from fxopt import verify

    session = isolated(model) if isolate else contextlib.nullcontext(model)
    with session as runner:
        versions = verify.state_versions(runner)
        try:
            output = verify.run_seeded(
                lambda *xs: op_failures.run_eagerly(runner, xs), verify.fresh(inputs)
            )
        except op_failures.ExampleInputError as error:
            return str(error)
        unchanged = verify.state_versions(runner) == versions
    if expected_cache is not None and unchanged:
        verify.remember_expected(expected_cache, inputs, output)
    return None


def _fx_traceable(model: nn.Module) -> bool:
    try:
        copy_ = shared_copy(model)
        with _quiet(), isolated(copy_):
            fx.symbolic_trace(copy_)
    except Exception:
        return False
    return True
