"""Trace a language model's head and its cross-entropy in chunks of rows.

A decoder's LM loss is ``cross_entropy(linear(hidden, W), labels)``: logits of batch ×
sequence × vocabulary floats, their log-softmax as big again, and in the backward the
gradient of each. No recomputation plan gets under that: whatever the plan, the backward
holds a whole log-softmax and its gradient at once (on a Llama with a 32000-word
vocabulary, 2 × 4096 tokens × 32000 × 4 bytes = 1 GiB). Computed in chunks of rows, the
same loss needs one chunk at a time, and the planner can recompute each chunk's
log-softmax in the backward just before that chunk's gradient:

    for each chunk of rows:  logits = linear(rows, W) → log_softmax → the label's column
    loss = nll_loss(those columns, ...)        # one column per row, same reduction

:class:`ChunkedHead` is a ``TorchFunctionMode`` active while the training step is traced:
it notes which tensors are rows of a ``linear`` (through reshapes that keep the last dim,
dtype casts, ``tanh`` and scaling by a number, as softcapping does) and replaces a
``cross_entropy`` of such rows with the chunked form, so AOTAutograd traces the chunks and
derives their backward. Anything else (class weights, label smoothing, probabilities as
targets, ``reduction="none"``) is traced as written.

Exactness. Each row's log-softmax is computed alone, and ``nll_loss`` over the picked
column reduces the rows in the order it reduces the full matrix's, so the loss is eager's
to the bit and so is each row's gradient of the logits (NaN and ±inf included: a NaN
logit makes its row's loss NaN either way). The weight's gradient is the sum of each
chunk's ``rowsᵀ @ grad`` instead of one product over every row, which rounds differently
(a few float32 ulps); the report says when a step was traced this way.

    >>> import torch, torch.nn.functional as F
    >>> head, hidden = torch.nn.Linear(8, 50), torch.randn(2, 6, 8)
    >>> labels = torch.randint(0, 50, (12,))
    >>> with ChunkedHead(chunks=3) as mode:
    ...     loss = F.cross_entropy(head(hidden).view(-1, 50), labels)
    >>> mode.chunked, torch.equal(loss, F.cross_entropy(head(hidden).view(-1, 50), labels))
    (1, True)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: Chunks an LM head is split into when ``compile_step`` chunks it on its own.
DEFAULT_CHUNKS = 8

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_RESHAPES = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.contiguous}
_CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type}
_SCALINGS = {
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
    torch.Tensor.mul,
    torch.Tensor.div,
    torch.mul,
    torch.div,
}
_TANH = {torch.tanh, torch.Tensor.tanh}


@dataclass(frozen=True)
class _Rows:
    """A tensor whose rows are ``linear(input's rows, weight, bias)`` with ``steps``
    applied to each element, in row-major order over the leading dims."""

    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    steps: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()


class ChunkedHead(TorchFunctionMode):
    """Traces ``cross_entropy(linear(...))`` as ``chunks`` chunks of rows (module docs).

    ``sites`` counts the cross-entropies of a linear's rows seen, ``chunked`` those
    traced in chunks (all of them when ``chunks`` > 1, none otherwise); ``logit_bytes``
    is the size of the largest such logits, ``weight_bytes`` its head's weight's.
    """

    def __init__(self, chunks: int = DEFAULT_CHUNKS):
        super().__init__()
        self.chunks = chunks
        self.sites = self.chunked = self.logit_bytes = self.weight_bytes = 0
        # id(tensor) -> (tensor, rows); the tensor is held so its id is not reused.
        self._rows: dict[int, tuple[torch.Tensor, _Rows]] = {}

    def __enter__(self):
        self.sites = self.chunked = self.logit_bytes = self.weight_bytes = 0
        return super().__enter__()

    def __exit__(self, *exc):
        self._rows.clear()  # the traced tensors, held only while tracing
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            chunked = self._cross_entropy(args, kwargs)
            if chunked is not None:
                return chunked
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() >= 2:
            rows = self._rows_of(func, args, kwargs, out)
            if rows is not None:
                self._rows[id(out)] = (out, rows)
        return out

    def _rows_of(self, func, args, kwargs, out: torch.Tensor) -> _Rows | None:
        if func is F.linear:
            bound = dict(zip(("input", "weight", "bias"), args)) | kwargs
            if bound["input"].dim() >= 1 and bound["weight"].dim() == 2:
                return _Rows(bound["input"], bound["weight"], bound.get("bias"))
            return None
        source = self._known(args[0] if args else None)
        if source is None or out.shape[-1] != args[0].shape[-1]:
            return None
        if func in _RESHAPES and out.is_contiguous() and out.numel() == args[0].numel():
            return source
        if out.shape != args[0].shape:
            return None
        if func in _CASTS and not kwargs and _only_dtype(args[1:]):
            return _then(source, lambda chunk, dtype=out.dtype: chunk.to(dtype))
        if func in _TANH and len(args) == 1 and not kwargs:
            return _then(source, torch.tanh)
        if func in _SCALINGS and len(args) == 2 and not kwargs and _is_number(args[1]):
            return _then(source, lambda chunk, f=func, k=args[1]: f(chunk, k))
        return None

    def _known(self, tensor: object) -> _Rows | None:
        entry = self._rows.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def _cross_entropy(self, args, kwargs) -> torch.Tensor | None:
        try:
            call = _CROSS_ENTROPY.bind(*args, **kwargs).arguments
        except TypeError:
            return None
        logits, target = call["input"], call["target"]
        rows = self._known(logits)
        plain = (
            call.get("weight") is None
            and call.get("size_average") is None
            and call.get("reduce") is None
            and call.get("label_smoothing", 0.0) == 0.0
            and call.get("reduction", "mean") in ("mean", "sum")
        )
        if rows is None or not plain or logits.dim() != 2:
            return None
        if target.dim() != 1 or target.dtype != torch.long or target.shape[0] != logits.shape[0]:
            return None
        self.sites += 1
        if logits.numel() * logits.element_size() > self.logit_bytes:
            self.logit_bytes = logits.numel() * logits.element_size()
            self.weight_bytes = rows.weight.numel() * rows.weight.element_size()
        if self.chunks <= 1:
            return None
        self.chunked += 1
        return _chunked_loss(rows, target, self.chunks, call.get("ignore_index", -100), call)


def _chunked_loss(
    rows: _Rows, target: torch.Tensor, chunks: int, ignore_index: int, call: dict
) -> torch.Tensor:
    """``cross_entropy(rows, target)``, one chunk of rows at a time (module docs)."""
    hidden = rows.input.reshape(-1, rows.input.shape[-1])
    size = math.ceil(hidden.shape[0] / chunks)
    ignored = target == ignore_index
    column = torch.where(ignored, 0, target)  # any column: an ignored row's pick is unused
    picked = []
    # split, not slicing: the backward joins the chunks' gradients with one cat.
    for chunk, labels in zip(hidden.split(size), column.split(size)):
        logits = F.linear(chunk, rows.weight, rows.bias)
        for step in rows.steps:
            logits = step(logits)
        if torch.is_autocast_enabled(logits.device.type):
            # autocast runs cross_entropy in float32 (log_softmax alone it would not)
            logits = logits.float()
        picked.append(torch.log_softmax(logits, 1).gather(1, labels[:, None]))
    # The picked column as a one-class problem: the same rows, reduced in the same order.
    only_class = torch.where(ignored, ignore_index, 0)
    return F.nll_loss(
        torch.cat(picked),
        only_class,
        ignore_index=ignore_index,
        reduction=call.get("reduction", "mean"),
    )


def _then(rows: _Rows, step: Callable[[torch.Tensor], torch.Tensor]) -> _Rows:
    return _Rows(rows.input, rows.weight, rows.bias, (*rows.steps, step))


def _only_dtype(rest: tuple) -> bool:
    return len(rest) <= 1 and all(isinstance(a, torch.dtype) for a in rest)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
