"""Capture a model as a torch.fx GraphModule, at module level or at ATen level.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> gm = trace(model, torch.randn(2, 4), mode="fx")
    >>> [n.op for n in gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']

``mode="fx"`` is ``torch.fx.symbolic_trace``: ``call_module`` nodes are kept, so module
structure (and BatchNorm modules) stay visible. ``mode="export"`` is ``torch.export`` with
the core-ATen decompositions, returned as a plain GraphModule whose parameters and buffers
are attributes (``get_attr`` nodes) and whose nodes carry ``meta["val"]`` fake tensors.
Either way every node has shape/dtype metadata, and the user's model is never touched: it
is deep-copied first, so a pass that rewrites weights rewrites the copy.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import fx, nn

from fxopt.errors import CaptureError, UserInputError
from fxopt.ir.copying import clone_module

Mode = Literal["fx", "export"]
MODES: tuple[str, ...] = ("fx", "export")
_TORCH_DIR = os.path.dirname(torch.__file__)


def as_input_tuple(example_inputs: object) -> tuple:
    """A tensor becomes a 1-tuple; tuples and lists become tuples."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise UserInputError(
        f"example_inputs must be a tensor or a tuple of tensors, got {type(example_inputs)}"
    )


def trace(model: nn.Module, example_inputs: object, mode: Mode = "fx") -> fx.GraphModule:
    """Capture ``model`` (never mutated) as a GraphModule with shape metadata on every node."""
    if not isinstance(model, nn.Module):
        raise UserInputError(f"expected an nn.Module to capture, got {type(model).__name__}")
    if mode not in MODES:
        raise UserInputError(f"unknown capture mode '{mode}'; use one of {', '.join(MODES)}")
    inputs = as_input_tuple(example_inputs)
    try:
        model_copy = clone_module(model)
    except Exception as error:
        raise CaptureError(
            f"cannot copy {type(model).__name__} to capture it (fxopt never rewrites your "
            f"model object): {error}"
        ) from error
    if mode == "fx":
        return _trace_fx(model_copy, inputs)
    return _trace_export(model_copy, inputs)


def _trace_fx(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    try:
        gm = fx.symbolic_trace(model)
    except Exception as error:
        raise CaptureError(_describe_failure("fx", model, error, other="export")) from error
    propagate_shapes(gm, inputs)
    return gm


def propagate_shapes(gm: fx.GraphModule, inputs: Sequence) -> None:
    """Fill ``node.meta["tensor_meta"]`` (and ``"val"``) by running ``gm`` on fake tensors.

    Fake tensors cost no compute and leave module state alone. If an op has no fake
    implementation, fall back to a real run under a forked RNG with buffers restored, so
    BatchNorm running statistics are not updated by capturing.
    """
    from torch._subclasses import FakeTensorMode
    from torch.fx.passes.shape_prop import ShapeProp

    try:
        ShapeProp(gm, fake_mode=FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
        return
    except Exception:
        pass  # fall through to a real run
    saved = {name: b.detach().clone() for name, b in gm.named_buffers()}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            ShapeProp(gm).propagate(*inputs)
    except Exception as error:
        raise CaptureError(
            f"the captured graph fails on the example inputs: {type(error).__name__}: "
            f"{_first_line(error)}"
        ) from error
    finally:
        with torch.no_grad():
            for name, buffer in gm.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])


def _trace_export(model: nn.Module, inputs: tuple) -> fx.GraphModule:
    # torch.export merges example tensors that are the same object into one placeholder.
    inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        with warnings.catch_warnings():
            # torch 2.13's own pytree deprecation warning, raised inside export.
            warnings.simplefilter("ignore", FutureWarning)
            program = torch.export.export(model, inputs)
            program = program.run_decompositions()
            module = program.module()
    except Exception as error:
        raise CaptureError(_describe_failure("export", model, error, other="fx")) from error
    return _plain_graph_module(module)


def _plain_graph_module(module: fx.GraphModule) -> fx.GraphModule:
    """Drop export's runtime input guards and wrapper class: a plain, copyable GraphModule.

    The guards re-check example-input shapes at every call; fxopt verifies shapes itself,
    and the wrapper class does not deep-copy cleanly.
    """
    graph = module.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            graph.erase_node(node)
    gm = fx.GraphModule(module, graph, class_name="ExportedGraphModule")
    gm.meta.update(getattr(module, "meta", {}))
    return gm


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _user_frame(error: BaseException) -> str | None:
    """'file:line: code' of the innermost traceback frame outside torch, if any."""
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(_TORCH_DIR) and "/fxopt/" not in f.filename
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


def _describe_failure(mode: str, model: nn.Module, error: BaseException, other: str) -> str:
    text = str(error)
    where = _user_frame(error) if mode == "fx" else _export_user_line(text)
    where = where or _user_frame(error)
    message = _first_line(error)
    located = f" at {where}" if where else ""
    control_flow = "control flow" in text or "data-dependent" in text
    hint = ", or remove Python control flow that depends on tensor values" if control_flow else ""
    return (
        f"cannot capture {type(model).__name__} with mode='{mode}': {message}{located}. "
        f"Try mode='{other}'{hint}."
    )
