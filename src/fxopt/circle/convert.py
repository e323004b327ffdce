"""The conversion pipeline: pre-flight → export → core ATen → fxopt passes → checks →
layout + lowering → Circle-level optimizations → builder.

Each stage is timed into ``CircleModel.report["stages_ms"]``; the fx passes are the
``"circle"`` list of :mod:`fxopt.passes.pipelines`, run by the :class:`PassManager`, which
checks the invariants between passes. ``dump_after`` keeps the graph text after one named
pass or stage (no weights: graphs print shapes, not values).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from fxopt.circle import export as export_stage
from fxopt.circle import optimize as circle_optimize
from fxopt.circle.build import build, constant_bytes
from fxopt.circle.config import CircleConfig
from fxopt.circle.lower import lower
from fxopt.circle.model import CircleModel
from fxopt.errors import UserInputError
from fxopt.ir import spec
from fxopt.passes import PassManager
from fxopt.passes.pipelines import PIPELINES

# Invariants checked before lowering (fxopt.ir.spec): the graph is what the lowering expects.
LOWERING_INVARIANTS = ("well-formed", "core-aten", "inference-only", "has-shapes")

_TOGGLES = {
    "remove-nops": "remove_nops",
    "fold-bn": "fold_bn",
    "fold-constants": "fold_constants",
    "cse": "cse",
}


def dump_points() -> tuple[str, ...]:
    """The names ``dump_after`` (``--dump-after``) accepts, in pipeline order: the
    ``decompose`` stage, then the fx passes of the ``circle`` pipeline."""
    return ("decompose", *PIPELINES["circle"])


def check_dump_after(name: str | None, config: CircleConfig) -> None:
    """Refuse a ``dump_after`` that would print nothing: an unknown name, or a pass the
    config switches off."""
    if name is None:
        return
    if name not in dump_points():
        raise UserInputError(
            f"cannot dump the graph after '{name}': not a stage or pass of the Circle "
            f"pipeline; valid names: {', '.join(dump_points())}"
        )
    toggle = _TOGGLES.get(name)
    if toggle is not None and not getattr(config, toggle):
        raise UserInputError(
            f"cannot dump the graph after '{name}': the config sets {toggle}: false, so the "
            "pass does not run"
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
    names = [p for p in PIPELINES["circle"] if getattr(config, _TOGGLES.get(p, ""), True)]
    records = []
    # The graph is ours (to_graph_module built it): no defensive copy. One manager for the
    # list; one per pass only when a pass's graph must be dumped.
    groups = [[n] for n in names] if dump_after in names else [names]
    for group in groups:
        result = PassManager(group, invariants=("well-formed",), copy=False).run(gm)
        gm = result.module
        records.extend(r.to_dict() for r in result.records)
        if dump_after in group:
            dumps[dump_after] = str(gm.graph)
    lap("passes")
    spec.check(gm, *LOWERING_INVARIANTS)
    graph = lower(gm, config)
    lap("lower")
    circle_stats = circle_optimize.optimize(graph, config)
    lap("optimize")
    data = build(graph, external_threshold=config.external_buffer_threshold)
    lap("build")
    operators = [op.code for op in graph.operators]
    report = {
        "passes": records,
        "circle_steps": circle_stats,
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
