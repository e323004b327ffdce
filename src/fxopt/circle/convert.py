"""The conversion pipeline: pre-flight → export → core ATen → fxopt passes → layout +
lowering → Circle-level passes → builder.

Each stage is timed into ``CircleModel.report["stages_ms"]``. Both rewrite stages are
pipelines of :mod:`fxopt.circle.passes`, run by the :class:`~fxopt.passes.PassManager`,
which checks the invariants between passes and at both ends. ``dump_after`` keeps the graph
text after one named stage or pass (no weights: graphs print shapes, not values).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from fxopt.circle import export as export_stage
from fxopt.circle.build import build, constant_bytes
from fxopt.circle.config import CircleConfig
from fxopt.circle.lower import lower
from fxopt.circle.model import CircleModel
from fxopt.circle.passes import LOWERING_INVARIANTS, aten_pipeline, circle_pipeline
from fxopt.errors import UserInputError


def dump_points(config: CircleConfig | None = None) -> tuple[str, ...]:
    """The names ``dump_after`` (``--dump-after``) accepts, in pipeline order: stages and
    the passes ``config`` runs."""
    config = config or CircleConfig()
    return (
        "decompose",
        *aten_pipeline(config).pass_names(),
        "lower",
        *circle_pipeline(config).pass_names(),
    )


def check_dump_after(name: str | None, config: CircleConfig) -> None:
    """Refuse a ``dump_after`` that would print nothing: an unknown name, or a pass the
    config switches off."""
    if name is None or name in dump_points(config):
        return
    for toggle in ("remove_nops", "fold_bn", "fold_constants", "cse", "fuse_activations"):
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
) -> CircleModel:
    """Convert ``model`` (in eval mode) to Circle.

    >>> import torch
    >>> from fxopt.circle import convert
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()).eval()
    >>> circle = convert(model, (torch.randn(2, 4),))
    >>> circle.op_counts
    {'FULLY_CONNECTED': 1}
    """
    from fxopt.capture import as_input_tuple

    config = config or CircleConfig()
    check_dump_after(dump_after, config)  # before the export: it takes seconds
    args = as_input_tuple(example_inputs)
    export_stage.preflight(model, args, kwargs)
    start = time.perf_counter()
    ep = export_stage.export(model, args, kwargs, dynamic_shapes)
    export_ms = (time.perf_counter() - start) * 1e3
    circle = convert_from_exported_program(
        ep, config, dump_after=dump_after, _dynamic_shapes=dynamic_shapes
    )
    circle.report["stages_ms"] = {"export": export_ms, **circle.report["stages_ms"]}
    return circle


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
    _dynamic_shapes: object = None,
) -> CircleModel:
    """Convert an ExportedProgram (already captured by ``torch.export``) to Circle."""
    config = config or CircleConfig()
    check_dump_after(dump_after, config)
    stages: dict[str, float] = {}
    dumps: dict[str, str] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        stages[name] = (now - clock) * 1e3
        clock = now

    gm = export_stage.to_graph_module(ep)
    export_stage.check_dynamic(gm, _dynamic_shapes)
    lap("decompose")
    if dump_after == "decompose":
        dumps["decompose"] = str(gm.graph)
    dump = (dump_after,) if dump_after else ()
    fx_result = aten_pipeline(config, dump_after=dump).run(gm)
    lap("passes")
    graph = lower(fx_result.module, config)
    lap("lower")
    if dump_after == "lower":
        dumps["lower"] = graph.format()
    circle_result = circle_pipeline(config, dump_after=dump).run(graph)
    lap("optimize")
    dumps.update(fx_result.dumps)
    dumps.update(circle_result.dumps)
    data = build(graph, external_threshold=config.external_buffer_threshold)
    lap("build")
    operators = [op.code for op in graph.operators]
    report = {
        "passes": [r.to_dict() for r in (*fx_result.records, *circle_result.records)],
        "stages_ms": stages,
        "dumps": dumps,
        "external_buffers": constant_bytes(graph) > config.external_buffer_threshold,
    }
    return CircleModel(data, operators, list(graph.input_names), list(graph.output_names), report)


def example_outputs(model: nn.Module, inputs: Sequence, kwargs: dict | None = None) -> list:
    """The model's outputs as a flat list of tensors (the parity reference)."""
    with torch.no_grad():
        out = model(*inputs, **(kwargs or {}))
    flat, _ = torch.utils._pytree.tree_flatten(out)
    return [t for t in flat if isinstance(t, torch.Tensor)]


__all__ = [
    "LOWERING_INVARIANTS",
    "check_dump_after",
    "convert",
    "convert_from_exported_program",
    "convert_from_pt2",
    "dump_points",
    "example_outputs",
]
