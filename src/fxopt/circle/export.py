"""Pre-flight checks and export: a model (or an ExportedProgram) → a core-ATen GraphModule.

Decomposition uses torch's core-ATen table minus the ops Circle runs natively (the lowering
table's :data:`~fxopt.circle.lower.KEPT_WHOLE`): decomposing ``linear`` into ``permute`` +
``addmm`` and fusing it back later is work (and a place to get it wrong) for nothing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Iterator

import torch
from torch import fx, nn

from fxopt import op_failures
from fxopt.circle import quantized
from fxopt.circle.errors import DynamicShapeError, TrainingModeError
from fxopt.circle.lower import KEPT_WHOLE
from fxopt.errors import CaptureError, UserInputError
from fxopt.ir import ops


def preflight(model: nn.Module, args: tuple = (), kwargs: dict | None = None) -> None:
    """Refuse models that cannot become an inference graph, with what to do instead.

    The model runs once on ``args``: a wrong shape or dtype then fails with the op, the
    operands and the model's line named (export would accept some of them, an int64 input
    to a float ``linear`` among them, and write a Circle file no runtime can run).
    """
    if not isinstance(model, nn.Module):
        raise UserInputError(f"expected an nn.Module to convert, got {type(model).__name__}")
    training = [name or type(model).__name__ for name, m in model.named_modules() if m.training]
    if training and quantized.is_quantized_module(model):
        # PT2E's converted GraphModule says training=True and refuses eval(); its mode was
        # fixed when it was exported (move_exported_model_to_eval), not by this flag.
        training = []
    if training:
        shown = ", ".join(training[:3]) + (
            f" (+{len(training) - 3} more)" if len(training) > 3 else ""
        )
        raise TrainingModeError(
            f"{type(model).__name__} is in training mode ({shown}); Circle files are for "
            "inference: call model.eval() before converting"
        )
    _check_float32(model, args)
    op_failures.run_eagerly(model, cloned(args), kwargs)


def cloned(values):
    """Tensors cloned (the model may write into its inputs), anything else as is."""
    return type(values)(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


@contextlib.contextmanager
def buffers_restored(model: nn.Module) -> Iterator[None]:
    """Run the model for real (pre-flight, the validation's reference) without leaving a
    trace: a forward that updates its buffers (a KV cache, a counter) gets them back as
    they were, so the user's model is unchanged and every run starts from the state the
    file was converted from."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                if not torch.equal(buffer, value):
                    buffer.copy_(value)


#: Float dtypes a model may come in; its file computes in float32 (Circle has no bfloat16).
WIDENED_DTYPES = (torch.bfloat16, torch.float16)


def as_float32(model: nn.Module, args: tuple, kwargs: dict | None) -> tuple:
    """(model, args, kwargs, what was widened): a bfloat16 / float16 model (as checkpoints
    ship) and its inputs as a float32 copy, the file's arithmetic; the user's model is not
    changed (a copy of its modules holds the float32 weights). Anything else as given, and
    None for what was widened."""
    from fxopt.ir.copying import shared_copy

    tensors = [*model.parameters(), *model.buffers(), *_tensors(args), *_tensors(kwargs)]
    found = sorted(
        {str(t.dtype).removeprefix("torch.") for t in tensors if t.dtype in WIDENED_DTYPES}
    )
    if not found:
        return model, args, kwargs, None
    widened = shared_copy(model)
    with torch.no_grad():
        for module in widened.modules():
            for store in (module._parameters, module._buffers):
                for name, value in store.items():
                    if value is not None and value.dtype in WIDENED_DTYPES:
                        float32 = value.float()
                        if isinstance(value, nn.Parameter):
                            float32 = nn.Parameter(float32, requires_grad=value.requires_grad)
                        store[name] = float32

    def widen(value):
        return (
            value.float()
            if isinstance(value, torch.Tensor) and value.dtype in WIDENED_DTYPES
            else value
        )

    args = tuple(widen(a) for a in args)
    kwargs = None if kwargs is None else {k: widen(v) for k, v in kwargs.items()}
    return widened, args, kwargs, " and ".join(found)


def _tensors(values) -> list[torch.Tensor]:
    items = values.values() if isinstance(values, dict) else (values or ())
    return [v for v in items if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _check_float32(model: nn.Module, args: tuple) -> None:
    """Circle files from this converter are float32: its lowering and parity checks are
    written and validated for float32 only, and Circle has no bfloat16 tensor type."""
    found = [
        (f"{kind} '{name}'", t.dtype)
        for kind, tensors in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
        )
        for name, t in tensors
        if t.is_floating_point() and t.dtype != torch.float32
    ]
    found += [
        (f"input {i}", x.dtype)
        for i, x in enumerate(args)
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float32
    ]
    if found:
        (what, dtype), more = found[0], len(found) - 1
        others = f" (and {more} more)" if more else ""
        raise UserInputError(
            f"the Circle converter takes float32 models: {what} is "
            f"{str(dtype).removeprefix('torch.')}{others}; call model.float() and pass "
            "float32 inputs"
        )


def export(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    dynamic_shapes: object = None,
) -> torch.export.ExportedProgram:
    """``torch.export.export`` with errors turned into one readable CaptureError."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    with op_failures.quiet_fake_tensor_failures(model) as failed:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return torch.export.export(
                    model, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes
                )
        except Exception as error:
            raise _export_error(model, args, dynamic_shapes, error, failed) from error


def _export_error(
    model: nn.Module,
    args: tuple,
    dynamic_shapes: object,
    error: Exception,
    failed: list[op_failures.OpFailure],
) -> UserInputError:
    """What a failed export becomes: a dynamic dim the model fixes, an op that rejected
    its operands (a wrong example input), or a construct export cannot trace."""
    text = str(error)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if dynamic_shapes is not None and ("Constraints violated" in text or "specializ" in text):
        return DynamicShapeError(
            f"a dimension marked dynamic is not dynamic in {type(model).__name__}: "
            f"{first}. The model constrains it (e.g. a reshape to a fixed size); mark "
            "only dimensions the code keeps symbolic"
        )
    failure = op_failures.input_failure(error, failed, model)
    if failure is not None:  # an op rejected its operands: not control flow
        return op_failures.example_input_error(failure, args)
    return CaptureError(
        f"torch.export cannot capture {type(model).__name__}: {first}. Remove Python "
        "control flow that depends on tensor values, or export it yourself and call "
        "convert_from_exported_program"
    )


#: ``gm.meta`` key: the non-tensor user inputs export specialized, name → value.
BAKED_INPUTS_KEY = "circle_baked_inputs"
#: ``gm.meta`` key: the buffers the model writes, whose final write the file leaves out.
STATE_WRITES_KEY = "circle_state_writes"


def to_graph_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """Core ATen (minus the ops the lowering keeps whole) as a plain GraphModule: weights
    as get_attr nodes, non-tensor inputs baked in (:func:`bake_constant_inputs`)."""
    from torch._decomp import core_aten_decompositions

    from fxopt.capture import plain_graph_module
    from fxopt.circle.decompose import DECOMPOSITIONS

    table = core_aten_decompositions()
    for op in KEPT_WHOLE:
        table.pop(op, None)
    table.update(DECOMPOSITIONS)
    ep, grouped = _fold_repeated_heads(ep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ep = ep.run_decompositions(table)
        module = ep.module()
    gm = plain_graph_module(module)
    _drop_runtime_asserts(gm)
    gm.meta[BAKED_INPUTS_KEY] = bake_constant_inputs(ep, gm)
    gm.meta[STATE_WRITES_KEY] = drop_state_writes(gm)
    gm.meta[GROUPED_ATTENTION_KEY] = grouped
    return gm


#: ``gm.meta`` key: how many attentions read their key/value heads unrepeated.
GROUPED_ATTENTION_KEY = "circle_grouped_attention"


def _fold_repeated_heads(
    ep: torch.export.ExportedProgram,
) -> tuple[torch.export.ExportedProgram, int]:
    """``ep`` with key/value heads repeated for grouped-query attention (transformers'
    repeat_kv) folded into SDPA's ``enable_gqa``, while SDPA is still whole: its
    decomposition then reads each key/value head once (:mod:`fxopt.circle.decompose`).
    Also how many attentions were folded. ``ep`` itself (maybe the user's) is unchanged:
    the rewrite is on a copy of its graph, which shares its weights."""
    from fxopt.passes.gqa_attention import GqaAttention

    if not any(ops.is_call(node, "scaled_dot_product_attention") for node in ep.graph.nodes):
        return ep, 0
    # A copy of the nodes sharing their metadata (fake values): a deep copy would copy those.
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(ep.graph._codegen)
    graph.output(graph.graph_copy(ep.graph, {}))
    gm = fx.GraphModule(ep.graph_module, graph)
    result = GqaAttention()(gm)
    if not result.changed:
        return ep, 0
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return ep._update(gm, _renamed_outputs(ep, gm)), int(result.stats.get("grouped", 0))


def _renamed_outputs(ep: torch.export.ExportedProgram, gm: fx.GraphModule):
    """``ep``'s graph signature with its outputs named as ``gm``'s output node reads them
    (a rewrite may have replaced an output's node)."""
    from torch.export.graph_signature import ExportGraphSignature, TensorArgument

    signature = ep.graph_signature
    returned = gm.graph.output_node().args[0]
    specs = [
        dataclasses.replace(spec, arg=TensorArgument(name=node.name))
        if isinstance(spec.arg, TensorArgument) and isinstance(node, fx.Node)
        else spec
        for spec, node in zip(signature.output_specs, returned, strict=True)
    ]
    return ExportGraphSignature(signature.input_specs, specs)


def drop_state_writes(gm: fx.GraphModule) -> list[str]:
    """Leave out the model's writes back into its buffers, and into inputs it returns.

    Export functionalizes an in-place update (``self.cache[:, i] = x``, ``buf.copy_(y)``)
    into out-of-place ops whose result the outputs read, plus one ``copy_`` of the new value
    into the buffer after them. The outputs never read that write, or read it only where
    the model returns the written tensor itself (``return self.cache``, ``dst.copy_(src);
    return dst``): that output is the new value. A Circle file has no state, so it
    computes one call from the buffers' values at conversion; the names of the buffers
    written are returned (and reported), an input as ``input:<name>``. A write into a
    user input that the model does not return would be visible to the caller only
    through its own tensor, which a file cannot change: that is an error.
    """
    written = []
    for node in list(gm.graph.nodes):
        if ops.aten_name(node) != "copy_":
            continue
        target, new_value = node.args[0], node.args[1]
        if not isinstance(target, fx.Node) or target.op not in ("placeholder", "get_attr"):
            continue
        returned = [user for user in node.users if user.op == "output"]
        if len(returned) != len(node.users) or not _same_tensor_type(target, new_value):
            continue  # read by an op: not the layout export makes; the invariant check says
        if target.op == "placeholder" and not returned:
            raise UserInputError(
                f"the model writes into its input '{target.name}' in place (x.add_(...), "
                "x[...] = ..., x.copy_(...)) and does not return it: a Circle file cannot "
                "change its inputs; return the written tensor, or compute a new one"
            )
        node.replace_all_uses_with(new_value)
        gm.graph.erase_node(node)
        written.append(f"input:{target.name}" if target.op == "placeholder" else str(target.target))
    if written:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return written


def _same_tensor_type(target: fx.Node, new_value: object) -> bool:
    """Whether ``new_value`` can stand for the written tensor: same shape and dtype."""
    if not isinstance(new_value, fx.Node):
        return False
    old, new = target.meta.get("val"), new_value.meta.get("val")
    return (
        isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and old.shape == new.shape
        and old.dtype == new.dtype
    )


def bake_constant_inputs(ep: torch.export.ExportedProgram, gm: fx.GraphModule) -> dict:
    """Drop the placeholders of non-tensor user inputs (a float scale, an int dim, a flag,
    ``None``) and return them, name → value.

    torch.export specializes such inputs: the graph already holds their example values
    as literals, and the placeholder is read by nothing but the guard. A Circle file has
    tensor inputs only, so they are not inputs of the file; the report lists them, since a
    different value needs a new conversion.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind

    user_inputs = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(user_inputs) != len(placeholders):
        return {}  # not the layout this function knows: leave the graph as export made it
    baked = {}
    for spec, node in zip(user_inputs, placeholders):
        if isinstance(spec.arg, ConstantArgument) and not node.users:
            baked[spec.arg.name] = spec.arg.value
            gm.graph.erase_node(node)
    if baked:  # export's pytree signature still names them: call with the tensors only
        gm.graph.set_codegen(fx.graph.CodeGen())
        gm.recompile()
    return baked


def _drop_runtime_asserts(gm: fx.GraphModule) -> None:
    """Export's shape/metadata assertions check the example inputs; Circle has no asserts."""
    for node in list(gm.graph.nodes):
        name = getattr(node.target, "__name__", str(node.target))
        if node.op == "call_function" and not node.users and "assert" in name:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def check_dynamic(gm: fx.GraphModule, dynamic_shapes: object) -> None:
    """Every dim the user marked dynamic must be symbolic in the graph."""
    if dynamic_shapes is None:
        return
    wanted = _requested_dims(dynamic_shapes)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, dims in wanted:
        if position >= len(placeholders):
            continue
        val = placeholders[position].meta.get("val")
        for dim in dims:
            if val is not None and isinstance(val.shape[dim], int):
                raise DynamicShapeError(
                    f"input {position} dim {dim} was marked dynamic but export made it static "
                    f"({val.shape[dim]}); the model fixes it"
                )


def _requested_dims(dynamic_shapes: object) -> list[tuple[int, list[int]]]:
    specs = list(dynamic_shapes.values()) if isinstance(dynamic_shapes, dict) else dynamic_shapes
    out = []
    for position, spec in enumerate(specs or ()):
        if isinstance(spec, dict):
            out.append((position, [int(d) for d in spec]))
        elif isinstance(spec, (list, tuple)):
            out.append((position, [i for i, d in enumerate(spec) if d is not None]))
    return out
