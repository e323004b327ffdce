"""The conversion pipeline: pre-flight → export → core ATen → fxopt passes → layout +
lowering → Circle-level passes → builder.

Each stage is timed into ``CircleModel.report["stages_ms"]``, and its peak memory goes
into ``report["memory"]`` (:mod:`fxopt.memory`). Both rewrite stages are
pipelines of :mod:`fxopt.circle.passes`, run by the :class:`~fxopt.passes.PassManager`,
which checks the invariants between passes and at both ends. ``dump_after`` keeps the graph
text after one named stage or pass (no weights: graphs print shapes, not values).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from fxopt.circle import export as export_stage
from fxopt.circle import quantized
from fxopt.circle.build import LITERT, build_file, constant_bytes
from fxopt.circle.config import CircleConfig
from fxopt.circle.errors import CircleValidationError, NotValidatedWarning
from fxopt.circle.export import BAKED_INPUTS_KEY, GROUPED_ATTENTION_KEY, STATE_WRITES_KEY
from fxopt.circle.ggml_check import ggml_operators
from fxopt.circle.lower import constant_outputs, lower
from fxopt.circle.model import CircleModel
from fxopt.circle.passes import LOWERING_INVARIANTS, aten_pipeline, circle_pipeline
from fxopt.circle.validation import Validation, choose_runtime, runtime_inputs
from fxopt.circle.validation import validate as validate_in
from fxopt.errors import UserInputError
from fxopt.ir.sampling import other_values
from fxopt.memory import weight_bytes
from fxopt.phases import Phases

#: A file at least this large goes to disk before it is validated, so that the runtime
#: loads it while fxopt holds no copy of it in memory.
SPILL_BYTES = 64 * 2**20


def dump_points(config: CircleConfig | None = None) -> tuple[str, ...]:
    """The names ``dump_after`` (``--dump-after``) accepts, in pipeline order: stages and
    the passes ``config`` runs (on a quantized graph: its passes run on those only)."""
    config = config or CircleConfig()
    return (
        "decompose",
        *aten_pipeline(config, quantized=True).pass_names(),
        "lower",
        *circle_pipeline(config, quantized=True).pass_names(),
    )


def check_dump_after(name: str | None, config: CircleConfig) -> None:
    """Refuse a ``dump_after`` that would print nothing: an unknown name, or a pass the
    config switches off."""
    if name is None or name in dump_points(config):
        return
    toggles = ("remove_nops", "fold_bn", "fold_constants", "cse", "fuse_activations", "fold_affine")
    for toggle in toggles:
        if not getattr(config, toggle) and name in dump_points(replace(config, **{toggle: True})):
            raise UserInputError(
                f"cannot dump the graph after '{name}': the config sets {toggle}: false, so "
                "the pass does not run"
            )
    raise UserInputError(
        f"cannot dump the graph after '{name}': not a stage or pass of the Circle "
        f"pipeline; valid names: {', '.join(dump_points(config))}"
    )


def convert(
    model: nn.Module,
    example_inputs: object,
    *,
    kwargs: dict | None = None,
    dynamic_shapes: object = None,
    config: CircleConfig | None = None,
    dump_after: str | None = None,
    validate: bool = True,
    float_model: nn.Module | None = None,
    memory_check: bool = True,
) -> CircleModel:
    """Convert ``model`` (in eval mode) to Circle, checked in a runtime.

    For a quantized ``model`` (PT2E, fake-quant), ``float_model`` — the model before
    quantization — adds the file's accuracy against it to ``report["quantization"]``
    (``vs_float``: SQNR, max error, top-1 agreement), as ``config.quantize`` does.

    Non-tensor inputs (a float scale, an int dim, a flag) are baked in, as torch.export
    specializes them: ``report["baked_inputs"]`` lists them. With ``validate`` (the
    default) the file runs in onert (LiteRT where onert has no kernel) on the example and
    on a second input with other values; outputs that differ raise
    :class:`~fxopt.circle.errors.CircleValidationError`, and ``circle.validation`` says
    which runtime checked the file. When no runtime can run it, a
    :class:`~fxopt.circle.errors.NotValidatedWarning` says so.

    >>> import torch
    >>> from fxopt.circle import convert
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
    >>> circle = convert(model, (torch.randn(2, 4),))
    >>> circle.op_counts
    {'FULLY_CONNECTED': 1}
    >>> circle.validation.message
    'outputs match in onert'
    """
    from fxopt.capture import as_input_tuple

    config = config or CircleConfig()
    check_dump_after(dump_after, config)  # before the export: it takes seconds
    args = as_input_tuple(example_inputs)
    if memory_check:
        _check_room(model, config, validate)
    phases = Phases()
    model, args, kwargs, widened = export_stage.as_float32(model, args, kwargs)
    with phases("preflight"), export_stage.buffers_restored(model):
        export_stage.preflight(model, args, kwargs)
    quantizing = config.quantize != "none" or config.weight_only != "none"
    with phases("quantize") if quantizing else contextlib.nullcontext():
        model, float_model, packed = _to_quantize(
            model, args, kwargs, dynamic_shapes, config, float_model
        )
    with phases("export"):
        ep = export_stage.export(model, args, kwargs, dynamic_shapes)
    inputs = [*args, *(kwargs or {}).values()]
    circle = convert_from_exported_program(
        ep,
        config,
        dump_after=dump_after,
        validate=False,
        _dynamic_shapes=dynamic_shapes,
        _phases=phases,
        _litert_twin=validate,
    )
    if validate:

        def check(file: CircleModel, cfg: CircleConfig) -> None:
            _spill_if_large(file)
            with phases("validate"):
                check_in_runtime(file, model, inputs, kwargs, cfg)

        def again(cfg: CircleConfig) -> CircleModel:
            return convert_from_exported_program(
                ep, cfg, validate=False, _dynamic_shapes=dynamic_shapes, _litert_twin=True
            )

        circle = _validated_or_again(circle, config, check, again)
    _report_phases(circle, phases, weight_bytes(model))
    if widened is not None:
        circle.report["widened_from"] = widened
        circle.report.setdefault("notes", []).append(
            f"the model is {widened}: the file computes in float32 (Circle has no "
            f"{widened} arithmetic), validated against a float32 copy of the model; "
            "quantize: for smaller files"
        )
    if float_model is not None:
        _report_accuracy(circle, config, float_model, packed, args)
    return circle


def _to_quantize(model, args, kwargs, dynamic_shapes, config, float_model):
    """The model to convert, the float model it is measured against (None: none), and
    what weight-only quantization packed (None: none)."""
    if config.quantize != "none" and config.weight_only != "none":
        raise UserInputError("weight_only and quantize exclude each other: choose one")
    if config.quantize != "none":
        return _quantized(model, args, kwargs, dynamic_shapes, config), model, None
    if config.weight_only != "none":
        packed, report = _weight_only(model, config)
        return packed, model, report
    if float_model is not None and not quantized.is_quantized_module(model):
        raise UserInputError(
            "float_model is the reference of a quantized model; this model is not quantized"
        )
    return model, float_model, None


def _report_accuracy(
    circle: CircleModel, config: CircleConfig, float_model: nn.Module, packed, args
) -> None:
    """The file's accuracy against ``float_model``, in the report's ``weight_only``
    section (``packed``: what was packed) or ``quantization`` section."""
    section = packed if packed is not None else circle.report["quantization"]
    if packed is not None:
        circle.report["weight_only"] = packed
    elif section is not None and config.quantize != "none":
        section["scheme"] = config.quantize
    runtime = circle.validation.runtime if circle.validation is not None else None
    if section is not None and runtime is not None:
        section["vs_float"] = accuracy_vs_float(circle, float_model, args, runtime)


def _validated_or_again(circle: CircleModel, config: CircleConfig, check, again) -> CircleModel:
    """``check(circle, config)``; when the file's values differ, ``again(config)`` with every
    graph output another operator reads re-produced at the end, checked in turn: onert
    0.1.0's memory planner may give such an output's buffer to a later operator
    (:mod:`fxopt.circle.passes.copy_aliased_outputs`)."""
    try:
        check(circle, config)
        return circle
    except CircleValidationError as error:
        if not error.validation.mismatch or config.copy_read_outputs:
            raise
        first = error.validation.message
    config = replace(config, copy_read_outputs=True)
    circle = again(config)
    check(circle, config)
    circle.report.setdefault("notes", []).append(
        "graph outputs other operators read are produced again at the end "
        f"(copy_read_outputs): the first file failed validation ({first})"
    )
    return circle


def _quantized(model, args, kwargs, dynamic_shapes, config: CircleConfig) -> nn.Module:
    """``model`` quantized as ``config.quantize`` and ``config.calibration`` say."""
    from fxopt.quant import quantize

    if quantized.is_quantized_module(model):
        raise UserInputError(
            f"the model is already quantized; drop quantize: {config.quantize} from the config"
        )
    if kwargs or dynamic_shapes is not None:
        raise UserInputError(
            "quantize in the config takes positional example inputs and static shapes; "
            "quantize with fxopt.quant.quantize first, then convert"
        )
    return quantize(
        model,
        args,
        calibration=config.calibration,
        scheme=config.quantize,
        weights=config.quantize_weights,
    )


def _weight_only(model: nn.Module, config: CircleConfig) -> tuple[nn.Module, dict]:
    """``model`` with its linears' weights in ``config.weight_only``'s ggml format, and
    what was packed (:func:`fxopt.quant.ggml.weight_only`)."""
    from fxopt.quant.ggml import weight_only

    if quantized.is_quantized_module(model):
        raise UserInputError(
            f"the model is already quantized; drop weight_only: {config.weight_only}"
        )
    packed, report = weight_only(model, config.weight_only)
    if not report["replaced"]:
        reasons = "; ".join(f"{k}: {v}" for k, v in list(report["left_float"].items())[:3])
        raise UserInputError(
            f"weight_only {config.weight_only}: no linear layer can be packed"
            + (f" ({reasons})" if reasons else " (the model has none)")
        )
    return packed, report


#: Held-out batches the report's accuracy against the float model is measured on.
ACCURACY_BATCHES = 8


def accuracy_vs_float(circle: CircleModel, float_model: nn.Module, args, runtime: str) -> dict:
    """The file's accuracy against the float model (SQNR, max error, top-1 agreement;
    :func:`fxopt.quant.accuracy`) on the example and on held-out batches drawn like it
    (seeds calibration does not use)."""
    from fxopt.circle.runtime import open_session
    from fxopt.quant import accuracy

    batches = [tuple(args)] + [
        tuple(other_values(args, 10_000 + i)) for i in range(ACCURACY_BATCHES - 1)
    ]
    with open_session(circle.file, runtime) as session:
        outputs = [session.run(runtime_inputs(batch)) for batch in batches]
    with export_stage.buffers_restored(float_model):
        return accuracy(float_model, outputs, batches)


def check_in_runtime(
    circle: CircleModel,
    model: nn.Module,
    inputs: Sequence,
    kwargs: dict | None,
    config: CircleConfig,
) -> Validation:
    """Run ``circle`` on the example and on a second input with other values, against
    ``model``; set ``circle.validation``. Raises CircleValidationError when the file
    differs (or its runtime cannot run it); warns when no runtime can run it."""
    runtime, why = choose_runtime(circle)
    validation = Validation(False, None, f"converted, not validated: {why}")
    if runtime is None:
        warnings.warn(f"Circle file {validation.message}", NotValidatedWarning, stacklevel=3)
    else:
        worst = 0.0
        positional = inputs[: len(inputs) - len(kwargs or {})]
        # A quantized output: within a few of its quantization steps (integer kernels
        # round where the quantized model's float arithmetic does not).
        tolerances = [
            config.atol
            if step is None
            else max(config.atol, config.quantized_tolerance_steps * step)
            for step in circle.report.get("output_steps") or [None] * len(circle.output_names)
        ]
        for label, values in (
            ("the example input", list(inputs)),
            ("a second input with other values", other_values(inputs)),
        ):
            copies = export_stage.cloned(values)  # the model may write into its inputs
            call_args = copies[: len(positional)]
            call_kwargs = dict(zip((kwargs or {}).keys(), copies[len(positional) :]))
            with export_stage.buffers_restored(model):
                expected = example_outputs(model, call_args, call_kwargs)
            validation = validate_in(
                circle, values, expected, rtol=config.rtol, atol=tolerances, runtime=runtime
            )
            if validation.mismatch and circle.graph is not None and ggml_operators(circle.graph):
                validation = _check_ggml_kernels(circle, values, validation)
            elif validation.mismatch and circle.graph is not None:
                validation = _check_integer_kernels(circle, values, validation, config)
            elif validation.mismatch and not call_kwargs:
                positional_values = values[: len(positional)]
                validation = _judged_in_float64(
                    circle, model, positional_values, expected, validation
                )
            if validation.failed:
                raise CircleValidationError(validation.message, validation, label)
            worst = max(worst, validation.max_abs_error)
        validation.max_abs_error = worst
        if runtime != "onert":  # say why the file was not checked in the ONE runtime
            validation.message = f"{validation.message} ({why})"
    circle.validation = validation
    circle.report["validation"] = validation.to_dict()
    return validation


def _judged_in_float64(
    circle: CircleModel, model: nn.Module, args: Sequence, expected: list, end_to_end: Validation
) -> Validation:
    """A float file whose outputs miss eager float32's by more than the fixed tolerance,
    judged as optimize judges a rewrite (:func:`fxopt.verify.within_float32_error`): it
    passes when it is no further from a float64 run of the model than twice eager float32's
    own error there (a deep network rounds differently in any other order of operations;
    a wrong lowering is orders of magnitude past that). The float64 run raises each weight
    as an op reads it: no float64 copy of the model."""
    from fxopt import verify
    from fxopt.circle.runtime import open_session

    runtime = end_to_end.runtime
    with open_session(circle.file, runtime, litert_file=circle.litert) as session:
        actual = [torch.from_numpy(a) for a in session.run(runtime_inputs(args))]
    with export_stage.buffers_restored(model):
        close = verify.within_float32_error(model, export_stage.cloned(args), expected, actual, 0)
    if not close:
        end_to_end.message += "; and further from a float64 run than eager float32 is"
        return end_to_end
    return Validation(
        True,
        end_to_end.max_abs_error,
        f"outputs match in {runtime} within float32's own rounding: {end_to_end.max_abs_error:.3g} "
        "from eager float32, past the fixed tolerance, but no further from a float64 run "
        "of the model than twice eager float32 is",
        runtime,
    )


def _check_integer_kernels(
    circle: CircleModel, values: Sequence, end_to_end: Validation, config: CircleConfig
) -> Validation:
    """A quantized file whose outputs drift from the quantized model's by more than the
    tolerance: validated when every integer kernel is within the tolerance of its float
    twin on these inputs (:mod:`fxopt.circle.kernel_check`; the drift is then integer
    rounding carried through the layers), failed with the kernels that are not."""
    from fxopt.circle.kernel_check import check_kernels

    tensors = runtime_inputs(values)
    steps = config.quantized_tolerance_steps
    found = check_kernels(circle.graph, tensors, end_to_end.runtime, steps)
    if not found.passed:
        wrong = "; ".join(found.failures[:5]) or "no integer kernel to check"
        end_to_end.message += f"; integer kernels off by more than {steps:g} steps: {wrong}"
        return end_to_end
    return Validation(
        True,
        end_to_end.max_abs_error,
        f"every integer kernel matches its float twin in {end_to_end.runtime} "
        f"({found.checked} kernels, worst {found.worst_steps:.1f} steps); end to end the "
        f"outputs differ from the quantized model's by up to {end_to_end.max_abs_error:.3g} "
        "(integer rounding carried through the layers)",
        end_to_end.runtime,
    )


def _check_ggml_kernels(
    circle: CircleModel, values: Sequence, end_to_end: Validation
) -> Validation:
    """A file with ggml weights whose outputs drift from the quantized model's: validated
    when every ggml kernel computes ggml's arithmetic on the input the file gave it
    (:mod:`fxopt.circle.ggml_check`; the drift is then the kernels' input rounding landing
    on the other side of a boundary), failed with the kernels that do not."""
    from fxopt.circle.ggml_check import RTOL, check_ggml_kernels

    found = check_ggml_kernels(circle.graph, runtime_inputs(values), end_to_end.runtime)
    if not found.passed:
        wrong = "; ".join(found.failures[:5])
        end_to_end.message += f"; ggml kernels off by more than {RTOL:g} of their range: {wrong}"
        return end_to_end
    return Validation(
        True,
        end_to_end.max_abs_error,
        f"every ggml kernel matches ggml's arithmetic in {end_to_end.runtime} "
        f"({found.checked} kernels, worst {found.worst_steps:.2g} of its range); end to end "
        f"the outputs differ from the quantized model's by up to {end_to_end.max_abs_error:.3g}"
        " (a kernel rounds its input to q8_0 blocks: a value on a boundary lands on either "
        "side, and the step is carried through the layers)",
        end_to_end.runtime,
    )


def convert_from_pt2(path: str | Path, config: CircleConfig | None = None) -> CircleModel:
    """Convert an ExportedProgram saved with ``torch.export.save``."""
    path = Path(path)
    if not path.is_file():
        raise UserInputError(f"PT2 file not found: {path}")
    try:
        ep = torch.export.load(str(path))
    except Exception as error:
        raise UserInputError(f"cannot load {path} as a PT2 ExportedProgram: {error}") from error
    return convert_from_exported_program(ep, config)


def convert_from_exported_program(
    ep: torch.export.ExportedProgram,
    config: CircleConfig | None = None,
    *,
    dump_after: str | None = None,
    validate: bool = True,
    _dynamic_shapes: object = None,
    _phases: Phases | None = None,
    _litert_twin: bool = False,
) -> CircleModel:
    """Convert an ExportedProgram (already captured by ``torch.export``) to Circle; with
    ``validate``, check it in a runtime against the program itself on its example inputs
    (see :func:`convert`)."""
    config = config or CircleConfig()
    check_dump_after(dump_after, config)
    phases = _phases if _phases is not None else Phases()
    dumps: dict[str, str] = {}
    with phases("decompose"):
        gm = export_stage.to_graph_module(ep)
        export_stage.check_dynamic(gm, _dynamic_shapes)
    if dump_after == "decompose":
        dumps["decompose"] = str(gm.graph)
    dump = (dump_after,) if dump_after else ()
    is_quantized = quantized.is_quantized(gm)
    with phases("passes"):
        fx_result = aten_pipeline(config, dump_after=dump, quantized=is_quantized).run(gm)
    with phases("lower"):
        graph = lower(fx_result.module, config)
    if dump_after == "lower":
        dumps["lower"] = graph.format()
    with phases("optimize"):
        circle_result = circle_pipeline(config, dump_after=dump, quantized=is_quantized).run(graph)
    dumps.update(fx_result.dumps)
    dumps.update(circle_result.dumps)
    with phases("build"):
        data = build_file(graph, external_threshold=config.external_buffer_threshold)
        external = constant_bytes(graph) > config.external_buffer_threshold
        # onert 0.1.0 cannot read offset buffers: a file of them is validated in LiteRT,
        # from a twin written now, while the graph (its weights) is at hand.
        twin = None
        if external and (validate or _litert_twin):
            twin = build_file(graph, external_threshold=0, identifier=LITERT[0], version=LITERT[1])
    operators = [op.code for op in graph.operators]
    _, constants = constant_outputs(fx_result.module.graph.find_nodes(op="output")[0])
    report = {
        "quantization": quantized.summary(graph) if is_quantized else None,
        "output_steps": quantized.output_steps(graph),
        "baked_inputs": {
            name: repr(value) for name, value in gm.meta.get(BAKED_INPUTS_KEY, {}).items()
        },
        "constant_outputs": {i: repr(value) for i, value in constants.items()},
        "state_writes": list(gm.meta.get(STATE_WRITES_KEY, [])),
        # Attentions over key/value heads repeated for their query group, read unrepeated.
        "grouped_attention": gm.meta.get(GROUPED_ATTENTION_KEY, 0),
        "passes": [r.to_dict() for r in (*fx_result.records, *circle_result.records)],
        "stages_ms": {},
        "dumps": dumps,
        "external_buffers": external,
    }
    circle = CircleModel(data, operators, list(graph.input_names), list(graph.output_names), report)
    circle.litert = twin
    if is_quantized or ggml_operators(graph):  # the per-kernel checks read it
        circle.graph = graph
    # Else let it go: its constants moved into the file now read the file's memory, which
    # must be free when the file spills to disk for the runtime.
    del graph, circle_result
    if validate:

        def check(file: CircleModel, cfg: CircleConfig) -> None:
            _spill_if_large(file)
            with phases("validate"):
                _check_program_in_runtime(file, ep, cfg)

        def again(cfg: CircleConfig) -> CircleModel:
            return convert_from_exported_program(
                ep, cfg, validate=False, _dynamic_shapes=_dynamic_shapes, _litert_twin=True
            )

        circle = _validated_or_again(circle, config, check, again)
    if _phases is None:
        _report_phases(circle, phases, sum(t.nbytes for t in ep.state_dict.values()))
    return circle


def _check_room(model: nn.Module, config: CircleConfig, validate: bool) -> None:
    """Refuse a conversion the machine cannot hold beside the model (fxopt.memory)."""
    from fxopt import memory

    weights = weight_bytes(model)
    anyway = "or memory_check=False (--no-memory-check) to try anyway"
    if weights <= config.external_buffer_threshold:  # the file is built in memory
        factor = memory.CONVERT_FACTOR
        lower = (
            "external_buffer_threshold: 0 in the config writes the weights after the "
            f"FlatBuffer, to disk one by one ({memory.CONVERT_STREAMED_FACTOR:g}x validated in "
            f"LiteRT, {memory.CONVERT_STREAMED_UNVALIDATED_FACTOR:g}x with --no-validate); "
            + anyway
        )
    elif validate:
        factor = memory.CONVERT_STREAMED_FACTOR
        unvalidated = memory.CONVERT_STREAMED_UNVALIDATED_FACTOR
        lower = f"--no-validate (validate=False) needs {unvalidated:g}x; {anyway}"
    else:
        factor, lower = memory.CONVERT_STREAMED_UNVALIDATED_FACTOR, anyway
    memory.check_room("convert", weights, factor, lower)


def _spill_if_large(circle: CircleModel) -> None:
    """A file of :data:`SPILL_BYTES` or more goes to disk (the runtime reads it there)."""
    if circle.nbytes >= SPILL_BYTES:
        circle.file.spill()


def _report_phases(circle: CircleModel, phases: Phases, weights: int) -> None:
    circle.report["stages_ms"] = {name: s * 1e3 for name, s in phases.seconds.items()}
    circle.report["memory"] = phases.memory.report(weights)


def _check_program_in_runtime(
    circle: CircleModel, ep: torch.export.ExportedProgram, config: CircleConfig
) -> None:
    """:func:`check_in_runtime` with the program as the reference, on its example inputs."""
    example = getattr(ep, "example_inputs", None)
    if example is None:
        circle.validation = Validation(
            False, None, "converted, not validated: the program has no example inputs"
        )
        circle.report["validation"] = circle.validation.to_dict()
        warnings.warn(circle.validation.message, NotValidatedWarning, stacklevel=3)
        return
    args, kwargs = example
    check_in_runtime(circle, ep.module(), [*args, *kwargs.values()], kwargs, config)


def example_outputs(model: nn.Module, inputs: Sequence, kwargs: dict | None = None) -> list:
    """The model's outputs as a flat list of tensors (the parity reference): an int,
    float or bool output as the scalar tensor the file returns for it. An output that is
    a view of a buffer (``return self.cache``) is copied: restoring the buffers after the
    run would change it."""
    with torch.no_grad():
        out = model(*inputs, **(kwargs or {}))
    flat, _ = torch.utils._pytree.tree_flatten(out)
    state = {b.untyped_storage().data_ptr() for b in model.buffers()}
    return [
        (t.clone() if t.untyped_storage().data_ptr() in state else t)
        if isinstance(t, torch.Tensor)
        else torch.tensor(t)
        for t in flat
        if isinstance(t, (torch.Tensor, int, float, bool))
    ]


__all__ = [
    "LOWERING_INVARIANTS",
    "check_dump_after",
    "check_in_runtime",
    "convert",
    "convert_from_exported_program",
    "convert_from_pt2",
    "dump_points",
    "example_outputs",
]
