"""Weight-only quantization of linear layers in ggml's block formats, which onert runs.

A language model's weights are mostly linear layers, and on a device they are what does
not fit. onert's FULLY_CONNECTED takes a weight in ggml's block formats (Circle tensor
types ``GGML_Q8_0`` and ``GGML_Q4_0``) beside a float input and output:

========  ===============================================================  ==============
format    one block: 32 consecutive weights of a row                       bits / weight
========  ===============================================================  ==============
``q8_0``  a float16 scale ``d`` and 32 int8 ``q``: ``w = d · q``                 8.5
``q4_0``  a float16 scale ``d`` and 32 4-bit ``q`` (two per byte): ``w = d · (q − 8)``  4.5
========  ===============================================================  ==============

The kernel (ggml's) also rounds the *input* of each such layer to ``q8_0`` blocks of 32
before the product (measured: onert's results equal this arithmetic within float
rounding, 3e-7 of the output's range). onert's GATHER reads ``q4_0`` tables, so in that
format embedding tables are packed too (:class:`GGMLEmbedding`). :func:`weight_only`
returns a copy of the model whose linears compute exactly that, :class:`GGMLLinear` (the
op ``fxopt::ggml_linear``), so the model the converter checks the file against is the
quantized model itself, and its accuracy against the float model can be measured in
torch. Group-wise scales are what makes 4 bits usable: a scale per 32 weights, where a
per-channel scale covers a whole row.

    >>> import torch
    >>> from fxopt.quant.ggml import weight_only
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
    >>> quantized, report = weight_only(model, "q4_0")
    >>> report["replaced"], report["packed_bytes"], report["float_bytes"]
    (1, 1152, 8192)
    >>> x = torch.randn(3, 64)
    >>> (quantized(x) - model(x)).abs().max() < 0.3
    tensor(True)
"""

from __future__ import annotations

import torch
from torch import nn

from fxopt.errors import UserInputError

#: Weights per block (ggml's QK8_0 and QK4_0).
BLOCK = 32
#: Formats and their bytes per block: a float16 scale, then the block's integers.
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}
#: Each format's Circle tensor type.
CIRCLE_TYPES = {"q8_0": "GGML_Q8_0", "q4_0": "GGML_Q4_0"}


def _round_away(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: halves away from zero, exactly (``trunc(v + 0.5)`` can round the
    sum up)."""
    whole = torch.trunc(v)
    return whole + torch.where((v - whole).abs() >= 0.5, torch.sign(v), 0.0)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, 1.0), 0.0)


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``quantize_row_q8_0_ref`` on [..., 32] blocks: (float16 scales, int8 q).
    (Any blocks are valid weights; these are the ones ggml's own quantizer writes.)"""
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = _round_away(blocks * _inverse(d)).to(torch.int8)
    return d.to(torch.float16), q


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's ``quantize_row_q4_0_ref``: (float16 scales, q in 0..15). The scale maps
    the block's value of largest magnitude to -8."""
    largest = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
    d = largest / -8
    q = torch.clamp(torch.trunc(blocks * _inverse(d) + 8.5), max=15).to(torch.uint8)
    return d.to(torch.float16), q


def pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """A [out, in] float weight as ggml blocks (uint8, one row's blocks after another)."""
    rows, cols = weight.shape
    blocks = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    if kind == "q8_0":
        d, q = _q8_0(blocks)
        body = q.view(torch.uint8)
    else:
        d, q = _q4_0(blocks)
        body = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)
    return torch.cat([d.view(torch.uint8), body], dim=-1).reshape(-1)


def unpack(packed: torch.Tensor, kind: str, rows: int, cols: int) -> torch.Tensor:
    """The float weight ``packed`` holds ([rows, cols])."""
    blocks = packed.reshape(rows, cols // BLOCK, BLOCK_BYTES[kind])
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    body = blocks[..., 2:]
    if kind == "q8_0":
        q = body.contiguous().view(torch.int8).float()
    else:
        q = torch.cat([body & 0xF, body >> 4], dim=-1).float() - 8
    return (d * q).reshape(rows, cols)


def round_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel sees it: its last dim rounded to q8_0 blocks the way ggml's
    vectorized ``quantize_row_q8_0`` does, which onert runs (measured on ties and on a
    last-bit case): the inverse scale is ``127 / amax``, not ``1 / d``, and halves round
    to even, not away from zero."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    # (a tensor over a tensor: ``127.0 / t`` is ``t.reciprocal() * 127``, a rounding apart)
    inverse = torch.where(largest != 0, largest.new_tensor(127.0) / largest, 0.0)
    d = (largest / 127).to(torch.float16).float()
    return (d * torch.round(blocks * inverse)).reshape(x.shape)


@torch.library.custom_op("fxopt::ggml_linear", mutates_args=())
def ggml_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, kind: str, out_features: int
) -> torch.Tensor:
    """``linear(round_input(x), unpack(packed)) + bias``: onert's FULLY_CONNECTED on a
    ggml weight, then the bias (the kernel takes none)."""
    weight = unpack(packed, kind, out_features, x.shape[-1])
    y = torch.nn.functional.linear(round_input(x), weight)
    return y + bias if bias is not None else y


@ggml_linear.register_fake
def _(x, packed, bias, kind, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("fxopt::ggml_embedding", mutates_args=())
def ggml_embedding(
    indices: torch.Tensor, packed: torch.Tensor, kind: str, dim: int
) -> torch.Tensor:
    """The rows ``indices`` of the table ``packed`` holds: onert's GATHER on ggml blocks."""
    rows = packed.numel() // (dim // BLOCK * BLOCK_BYTES[kind])
    return unpack(packed, kind, rows, dim)[indices]


@ggml_embedding.register_fake
def _(indices, packed, kind, dim):
    return packed.new_empty((*indices.shape, dim), dtype=torch.float32)


class GGMLLinear(nn.Module):
    """A linear layer whose weight is ggml blocks (module docs). The bias, when there is
    one, is the original layer's tensor, shared."""

    def __init__(self, linear: nn.Linear, kind: str, packed: torch.Tensor | None = None):
        super().__init__()
        self.kind, self.in_features, self.out_features = (
            kind,
            linear.in_features,
            linear.out_features,
        )
        self.register_buffer("packed", pack(linear.weight, kind) if packed is None else packed)
        self.bias = linear.bias
        self.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ggml_linear(x, self.packed, self.bias, self.kind, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


class GGMLEmbedding(nn.Module):
    """An embedding table in ggml blocks (onert's GATHER reads ``q4_0`` tables)."""

    def __init__(self, embedding: nn.Embedding, kind: str, packed: torch.Tensor):
        super().__init__()
        self.kind, self.embedding_dim = kind, embedding.embedding_dim
        self.num_embeddings = embedding.num_embeddings
        self.register_buffer("packed", packed)
        self.train(embedding.training)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return ggml_embedding(indices, self.packed, self.kind, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind}"


#: Formats onert 0.1.0's GATHER reads (measured: q8_0 tables fail at run time).
EMBEDDING_KINDS = ("q4_0",)


def weight_only(model: nn.Module, kind: str = "q8_0") -> tuple[nn.Module, dict]:
    """A copy of ``model`` whose float32 linear layers (and, in ``q4_0``, embedding tables)
    hold ggml blocks (``kind``: ``q8_0`` or ``q4_0``), and a report: layers replaced,
    those left float and why, the weights' bytes before and after. The copy shares every
    other tensor with ``model``, which is not changed; a weight tied to a table is packed
    once. A layer whose input size is not a multiple of 32 stays float.
    """
    if kind not in BLOCK_BYTES:
        raise UserInputError(
            f"unknown weight-only format {kind!r}; expected one of {', '.join(BLOCK_BYTES)}"
        )
    if not isinstance(model, nn.Module):
        raise UserInputError(f"expected an nn.Module, got {type(model).__name__}")
    packer = _Packer(kind)
    return packer.copy_of(model, ""), packer.report


class _Packer:
    """:func:`weight_only`'s walk: each module copied where a descendant is replaced."""

    def __init__(self, kind: str):
        self.kind = kind
        self.report = {
            "kind": kind,
            "replaced": 0,
            "left_float": {},
            "float_bytes": 0,
            "packed_bytes": 0,
        }
        self._swapped: dict[int, nn.Module] = {}  # a layer used twice: one packed layer
        self._blocks: dict[int, torch.Tensor] = {}  # a tied weight: one packed tensor

    def copy_of(self, module: nn.Module, path: str) -> nn.Module:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            reason = _cannot_pack(module, self.kind)
            if reason is None:
                return self._replaced(module)
            self.report["left_float"][path] = reason
        if not module._modules:
            return module
        clone = _shallow_copy(module)
        for name, child in module._modules.items():
            if child is not None:
                clone._modules[name] = self.copy_of(child, f"{path}.{name}" if path else name)
        return clone

    def _replaced(self, module: nn.Module) -> nn.Module:
        if id(module) not in self._swapped:
            layer = GGMLLinear if isinstance(module, nn.Linear) else GGMLEmbedding
            self._swapped[id(module)] = layer(module, self.kind, self._packed(module.weight))
            self.report["replaced"] += 1
        return self._swapped[id(module)]

    def _packed(self, weight: torch.Tensor) -> torch.Tensor:
        if id(weight) not in self._blocks:
            self._blocks[id(weight)] = pack(weight, self.kind)
            self.report["float_bytes"] += weight.numel() * 4
            self.report["packed_bytes"] += self._blocks[id(weight)].numel()
        return self._blocks[id(weight)]


def _cannot_pack(layer: nn.Module, kind: str) -> str | None:
    if layer.weight.dtype != torch.float32:
        return f"weight is {layer.weight.dtype}, not float32"
    if isinstance(layer, nn.Embedding):
        if kind not in EMBEDDING_KINDS:
            return f"onert's GATHER does not read {kind} tables (only {', '.join(EMBEDDING_KINDS)})"
        if layer.max_norm is not None:
            return "max_norm renormalizes the table as it reads it"
        size = layer.embedding_dim
    else:
        size = layer.in_features
    if size % BLOCK:
        return f"input size {size} is not a multiple of {BLOCK}"
    return None


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object with ``module``'s attributes; parameters and buffers shared."""
    clone = module.__class__.__new__(module.__class__)
    clone.__dict__ = dict(module.__dict__)
    for table in ("_parameters", "_buffers", "_modules"):
        clone.__dict__[table] = dict(module.__dict__[table])
    return clone
