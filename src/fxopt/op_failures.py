"""Say in one line which op fails when a model runs on its example inputs, and where.

A wrong input shape or dtype fails deep inside torch. Traced on fake tensors
(``torch.export``, AOTAutograd), torch first logs some 20 lines of traceback per failing
op, and the error that surfaces names neither the op nor the layer, so the capture code
blamed Python control flow. The two tools here record the op, its tensor operands and the
model's module and source line, and keep torch's log quiet:

* :func:`run_eagerly` runs an inference model once under a dispatch mode that watches
  every op (the converter and the tiler do it before capturing);
* :func:`quiet_fake_tensor_failures` wraps a tracer (remat's AOTAutograd capture): it
  drops torch's fake-tensor failure log, keeping the op that log names.

    >>> import torch
    >>> from fxopt.errors import UserInputError
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> try:
    ...     run_eagerly(model, (torch.randn(3, 5),))
    ... except UserInputError as error:
    ...     print(str(error).split(": mat1")[0])  # doctest: +NORMALIZE_WHITESPACE
    the model fails on its example inputs (float32[3, 5]): aten.addmm on float32[2],
    float32[3, 5], float32[4, 2] at module '0' (Linear)
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxopt.errors import UserInputError, WritesWeightsError

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FAKE_TENSOR_LOG = "torch._subclasses.fake_tensor"
# The message torch logs (with the traceback) when an op's meta kernel raises on fake
# tensors: torch/_subclasses/fake_tensor.py, FakeTensorMode._dispatch_impl (torch 2.13).
_META_FAILURE = "failed while attempting to run meta for %s"


class ExampleInputError(UserInputError):
    """The model fails on its example inputs (a wrong shape or dtype, most often)."""


@dataclass(frozen=True)
class OpFailure:
    """An op that raised, in words: ``aten.mm on float32[3, 5], float32[784, 256]``."""

    op: str
    operands: str  # the tensor operands' dtypes and shapes
    where: str  # "module 'fc1' (Linear), zoo/mlp.py:31", or "" when unknown
    message: str  # the first line of the op's error
    # To match the error a tracer finally raises; it holds the frames: drop after use.
    error: BaseException | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        on = f" on {self.operands}" if self.operands else ""
        at = f" at {self.where}" if self.where else ""
        return f"{self.op}{on}{at}: {self.message}"


class NodeFailed(Exception):
    """A node of a captured graph raised when run on real tensors (a meta kernel let the
    operands through at capture). ``failure`` says which op, on what."""

    def __init__(self, failure: OpFailure):
        super().__init__(str(failure))
        self.failure = failure


def run_node(target: object, operands: Sequence, call: Callable, *call_args: object) -> object:
    """``call(*call_args)``, which runs a graph node calling ``target`` on ``operands``; an
    op's error (the exact types an op raises on operands it rejects) becomes NodeFailed
    naming the op."""
    try:
        return call(*call_args)
    except (RuntimeError, ValueError, IndexError, TypeError) as error:
        if type(error) not in (RuntimeError, ValueError, IndexError, TypeError):
            raise  # a subclass: torch's tracer and data-dependent errors, not an operand
        failure = OpFailure(
            _op_name(target), _describe_operands(operands), "", _first_line(error), error
        )
        raise NodeFailed(failure) from error


def example_input_error(failure: OpFailure, inputs: Sequence) -> ExampleInputError:
    """The one-line error for ``failure`` on ``inputs``, saying what to check."""
    given = ", ".join(describe_tensor(x) for x in inputs if isinstance(x, torch.Tensor))
    return ExampleInputError(
        f"the model fails on its example inputs ({given or 'no tensors'}): {failure}; give "
        "inputs of the shapes and dtypes the model expects"
    )


def run_eagerly(model: nn.Module, inputs: Sequence, kwargs: dict | None = None) -> object:
    """``model(*inputs, **kwargs)`` without autograd; an exception becomes one
    ExampleInputError naming the op (or the line) that raised. The model runs for real:
    callers pass models in eval mode or copies they own, since a forward may update
    buffers."""
    watch = _WatchOps(model, stop=sys._getframe())
    try:
        with torch.no_grad(), watch:
            return model(*inputs, **(kwargs or {}))
    except WritesWeightsError:
        raise
    except Exception as error:
        failure = watch.failure if watch.failure is not None else raised_in(error, model)
        raise example_input_error(failure, inputs) from error


@contextlib.contextmanager
def quiet_fake_tensor_failures(model: nn.Module | None = None) -> Iterator[list[OpFailure]]:
    """Around a tracer: drop torch's traceback log for ops that fail on fake tensors, and
    yield the list of those failures (:func:`input_failure` matches one to the error)."""
    failures: list[OpFailure] = []
    names = _module_names(model)

    def keep(record: logging.LogRecord) -> bool:
        if record.msg != _META_FAILURE or not record.exc_info or not record.exc_info[2]:
            return True
        frame = record.exc_info[2].tb_frame  # the dispatch that caught it: func, args
        operands = [*frame.f_locals.get("args", ()), *frame.f_locals.get("kwargs", {}).values()]
        failures.append(
            OpFailure(
                _op_name(record.args[0] if record.args else frame.f_locals.get("func")),
                _describe_operands(operands),
                _where(_callers(frame), names),
                _first_line(record.exc_info[1]),
                record.exc_info[1],
            )
        )
        return False

    log = logging.getLogger(_FAKE_TENSOR_LOG)
    log.addFilter(keep)
    try:
        yield failures
    finally:
        log.removeFilter(keep)


def input_failure(
    error: BaseException, failures: Sequence[OpFailure], model: nn.Module | None
) -> OpFailure | None:
    """The failure behind a tracer's ``error`` when it is the model rejecting its example
    inputs: an op that raised on its operands (recorded in ``failures`` or seen in the
    traceback), or a ValueError / IndexError from the model's Python code. None when it
    is something else (a construct the tracer cannot follow)."""
    chain = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    for failure in reversed(failures):
        if any(failure.error is e for e in chain):
            return failure
    # Exact types: torch's data-dependent and tracer errors subclass RuntimeError.
    if type(error) not in (RuntimeError, ValueError, IndexError):
        return None
    failure = raised_in(error, model)
    if failure.operands or type(error) is not RuntimeError:
        return failure
    return None


def raised_in(error: BaseException, model: nn.Module | None) -> OpFailure:
    """``error`` as an OpFailure read off its traceback: the innermost aten op it passed
    through (with its operands), else its type; the innermost module of ``model`` and the
    line of the model's code."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    op, operands = type(error).__name__, ""
    for frame in reversed(frames):
        callee = frame.f_locals.get("self")
        if frame.f_code.co_name == "__call__" and isinstance(callee, torch._ops.OpOverload):
            if callee.name() == "aten::_local_scalar_dense":
                break  # .item() while tracing: data-dependent, not a bad input
            args = [*frame.f_locals.get("args", ()), *frame.f_locals.get("kwargs", {}).values()]
            op, operands = _op_name(callee), _describe_operands(args)
            break
    where = _where(reversed(frames), _module_names(model))
    return OpFailure(op, operands, where, _first_line(error), error)


def describe_tensor(x: torch.Tensor) -> str:
    """``float32[3, 5]``."""
    shape = ", ".join(str(d) for d in x.shape)
    return f"{str(x.dtype).removeprefix('torch.')}[{shape}]"


class _WatchOps(TorchDispatchMode):
    """Remember the first op that raises, with its operands and the model's line (frames
    up to ``stop``, the caller's, are searched for it); refuse an op that would write into
    one of the model's parameters (fxopt runs the caller's own model, whose weights it
    shares: :class:`~fxopt.errors.WritesWeightsError`)."""

    def __init__(self, model: nn.Module, stop: types.FrameType):
        super().__init__()
        self._names = _module_names(model)
        self._stop = stop
        self.failure: OpFailure | None = None
        self._weights = {
            p.untyped_storage().data_ptr(): name
            for name, p in model.named_parameters()
            if p.layout == torch.strided
        }

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if func._schema.is_mutable and self._weights:
            self._refuse_weight_writes(func, args, kwargs or {})
        try:
            return func(*args, **(kwargs or {}))
        except Exception as error:
            if self.failure is None:
                self.failure = OpFailure(
                    _op_name(func),
                    _describe_operands([*args, *(kwargs or {}).values()]),
                    _where(_callers(sys._getframe(1), self._stop), self._names),
                    _first_line(error),
                    error,
                )
            raise

    def _refuse_weight_writes(self, func, args: tuple, kwargs: dict) -> None:
        schema = func._schema
        for index, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            for tensor in tree_leaves(value):
                if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
                    continue
                name = self._weights.get(tensor.untyped_storage().data_ptr())
                if name is not None:
                    where = _where(_callers(sys._getframe(2), self._stop), self._names)
                    raise WritesWeightsError(
                        f"the model writes its parameter '{name}' in place "
                        f"({_op_name(func)}{f' at {where}' if where else ''}); fxopt shares "
                        "the model's weights instead of copying them and does not run such "
                        "a forward: move the write out of forward"
                    )


def _op_name(func: object) -> str:
    return str(func).removesuffix(".default") if func is not None else "an op"


def _describe_operands(operands: Sequence) -> str:
    tensors = [t for t in tree_leaves(list(operands)) if isinstance(t, torch.Tensor)]
    shown = ", ".join(describe_tensor(t) for t in tensors[:4])
    return shown + (f" (+{len(tensors) - 4} more)" if len(tensors) > 4 else "")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


def _callers(
    frame: types.FrameType | None, stop: types.FrameType | None = None
) -> Iterator[types.FrameType]:
    while frame is not None and frame is not stop:
        yield frame
        frame = frame.f_back


def _module_names(model: nn.Module | None) -> dict[int, str]:
    if model is None:
        return {}
    return {id(m): name for name, m in model.named_modules()}


def _where(frames: Iterable[types.FrameType], names: dict[int, str]) -> str:
    """From the innermost frame outwards: the innermost module of the model whose forward
    is running, and the innermost line outside torch that runs inside one (frames outside
    every forward are fxopt's or the tracer's, not the model's)."""
    module = line = candidate = ""
    for frame in frames:
        path = frame.f_code.co_filename
        if not candidate and not path.startswith((_TORCH_DIR, "<")) and path != __file__:
            candidate = f"{os.sep.join(path.split(os.sep)[-2:])}:{frame.f_lineno}"
        owner = frame.f_locals.get("self") if frame.f_code.co_name == "forward" else None
        if id(owner) not in names:
            continue
        if not module:
            name = names[id(owner)]
            kind = type(owner).__name__
            module = f"module '{name}' ({kind})" if name else f"the model ({kind})"
        line = candidate
        if line:
            break
    return ", ".join(part for part in (module, line) if part)
