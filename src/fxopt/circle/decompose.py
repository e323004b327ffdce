"""Decompositions for ops Circle has no operator for, in ops the lowering table has.

They join torch's core-ATen table when the exported program is decomposed
(:func:`fxopt.circle.export.to_graph_module`), so they run once, on fake tensors, and the
graph the passes and the lowering see already holds their result. Each returns
``NotImplemented`` for the forms it leaves alone: the op then stays whole and its own
lowering (or a clear "no lowering" error) takes it.

    >>> import torch
    >>> torch.ops.aten.slice_scatter.default in DECOMPOSITIONS
    True
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def slice_scatter(base, src, dim=0, start=None, end=None, step=1):
    """``base`` with ``src`` written into ``base[start:end:step]`` along ``dim`` (what
    export makes of ``y[:, 1:3] = v``): a CONCATENATION of the untouched parts and
    ``src`` when ``step == 1``, else a SELECT_V2 between ``base`` and ``src`` gathered to
    every position."""
    dim = dim % base.dim()
    size = base.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else min(start, size))
    end = size if end is None else (end + size if end < 0 else min(end, size))
    if step == 1:
        pieces = [base.narrow(dim, 0, start), src, base.narrow(dim, end, size - end)]
        return torch.cat([p for p in pieces if p.shape[dim]], dim)
    position = torch.arange(size, device=base.device)
    written = (position >= start) & (position < end) & ((position - start) % step == 0)
    source_index = ((position - start) // step).clamp(0, src.shape[dim] - 1)
    gathered = src.index_select(dim, source_index)
    shape = [1] * base.dim()
    shape[dim] = size
    return torch.where(written.reshape(shape), gathered, base)


def copy(dst, src, non_blocking=False):
    """Functional ``copy``: ``src`` cast to ``dst``'s dtype and broadcast to its shape."""
    return src.to(dst.dtype).expand(dst.shape).clone()


def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """1-D convolutions (transposed ones too) as 2-D ones over a height-1 image (Circle
    has no 1-D convolution). The rest stay whole: grouped ones are split at lowering, after
    fold-bn has folded a following BatchNorm into the whole convolution's weights."""
    if x.dim() == 3:
        out = aten.convolution.default(
            x.unsqueeze(2),
            weight.unsqueeze(2),
            bias,
            [1, *stride],
            [0, *padding],
            [1, *dilation],
            transposed,
            [0, *output_padding],
            groups,
        )
        return out.squeeze(2)
    return NotImplemented


def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    """SELU and scaled ELUs (export spells them as elu with scales): SELECT_V2 over EXP.
    The plain ELU stays whole: Circle's ELU, which onert runs."""
    if alpha == scale == input_scale == 1:
        return NotImplemented
    negative = (torch.exp(x * input_scale) - 1) * (alpha * scale)
    return torch.where(x > 0, x * scale, negative)


def expm1(x):
    return torch.exp(x) - 1


def log1p(x):
    """``log(1 + x)``: exact to float32 rounding except for |x| below ~1e-7, where the
    absolute error stays under 1e-7."""
    return torch.log(x + 1)


def exp2(x):
    return torch.exp(x * 0.6931471805599453)


def sign(x):
    return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


def trunc(x):
    return torch.where(x < 0, torch.ceil(x), torch.floor(x))


def div_mode(a, b, *, rounding_mode=None):
    """``div`` with ``rounding_mode`` (``//`` on floats is ``floor``): DIV then FLOOR, or
    the truncation above. Integer division stays whole."""
    if rounding_mode is None or not a.is_floating_point():
        return NotImplemented
    quotient = a / b
    return torch.floor(quotient) if rounding_mode == "floor" else trunc(quotient)


def remainder(a, b):
    """Python's modulo (the sign of the divisor): ``a - floor(a / b) * b`` for floats."""
    if not a.is_floating_point():
        return NotImplemented
    return a - torch.floor(a / b) * b


def isnan(x):
    return x != x


def clamp_tensor(x, min=None, max=None):
    """``clamp`` with tensor bounds: MAXIMUM with ``min`` then MINIMUM with ``max`` (so
    where ``min > max`` the result is ``max``, as in torch)."""
    out = x if min is None else torch.maximum(x, min.to(x.dtype))
    return out if max is None else torch.minimum(out, max.to(x.dtype))


def addmm(bias, a, b, *, beta=1, alpha=1):
    """``beta * bias + alpha * (a @ b)`` as a plain ``addmm`` (FULLY_CONNECTED): the scales
    move onto the bias and the weight, where constant folding absorbs them. With
    ``beta == 0`` torch ignores the bias, NaN and inf in it included: a plain ``mm``."""
    if beta == 1 and alpha == 1:
        return NotImplemented
    if beta == 0:
        return aten.mm.default(a, b * alpha)
    return aten.addmm.default(bias * beta, a, b * alpha)


def mean_dtype(x, dim=None, keepdim=False, *, dtype=None):
    """``mean(..., dtype=d)``: a cast to ``d`` (when it changes anything), then the mean."""
    if dtype is None:
        return NotImplemented
    return aten.mean.dim(x if dtype == x.dtype else x.to(dtype), dim, keepdim)


def any_dims(x, dim=None, keepdim=False):
    """``any`` of a non-bool tensor: REDUCE_ANY takes bool only (onert 0.1.0 refuses the
    rest), so compare with zero first."""
    if x.dtype == torch.bool:
        return NotImplemented
    mask = x != 0
    return mask.any() if dim is None else aten.any.dims(mask, dim, keepdim)


def any_dim(x, dim, keepdim=False):
    return any_dims(x, [dim], keepdim)


def variance(x, dim=None, *, correction=None, keepdim=False):
    """``var``: mean of squared deviations over ``N - correction`` (MEAN, SUB, MUL, SUM)."""
    dims = list(range(x.dim())) if dim is None else [d % x.dim() for d in dim]
    count = 1
    for d in dims:
        count *= x.shape[d]
    correction = 1 if correction is None else correction
    deviation = x - x.mean(dims, keepdim=True)
    return (deviation * deviation).sum(dims, keepdim=keepdim) / max(count - correction, 0)


def max_dim(x, dim, keepdim=False):
    """``max(x, dim)``: (REDUCE_MAX, ARG_MAX); the unused half is dead code."""
    return torch.amax(x, dim, keepdim), torch.argmax(x, dim, keepdim)


def min_dim(x, dim, keepdim=False):
    return torch.amin(x, dim, keepdim), torch.argmin(x, dim, keepdim)


def group_norm(x, weight, bias, n, channels, spatial, groups, eps):
    """``native_group_norm``: statistics per (sample, group) over a reshaped view, then the
    per-channel affine (MEAN, SUB, MUL, RSQRT, ...). Returns (out, mean, rstd)."""
    if groups in (1, channels):
        # One group (PoolFormer) or one per channel: reduce over the dims themselves, no
        # reshape, so an NHWC value stays NHWC (a reshape needs the torch order).
        dims = list(range(1 if groups == 1 else 2, x.dim()))
        mean = x.mean(dims, keepdim=True)
        deviation = x - mean
        rstd = torch.rsqrt((deviation * deviation).mean(dims, keepdim=True) + eps)
        out = deviation * rstd
    else:
        grouped = x.reshape(n, groups, -1)
        mean = grouped.mean(-1, keepdim=True)
        deviation = grouped - mean
        rstd = torch.rsqrt((deviation * deviation).mean(-1, keepdim=True) + eps)
        out = (deviation * rstd).reshape(x.shape)
    affine = [1, channels] + [1] * (x.dim() - 2)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    return out, mean.reshape(n, groups), rstd.reshape(n, groups)


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """``linalg.vector_norm`` (``F.normalize``) for ord 1, 2 and inf."""
    if dtype is not None:
        x = x.to(dtype)
    dims = list(range(x.dim())) if dim is None else list(dim)
    if ord == 2:
        return torch.sqrt((x * x).sum(dims, keepdim=keepdim))
    if ord == 1:
        return x.abs().sum(dims, keepdim=keepdim)
    if ord == float("inf"):
        return x.abs().amax(dims, keepdim=keepdim)
    return NotImplemented


def gather(x, dim, index, sparse_grad=False):
    """``torch.gather`` as one GATHER on the flattened input: the flat position of each
    element is ``index * stride[dim]`` plus the (constant) offsets of the other dims."""
    dim = dim % x.dim()
    strides = [1] * x.dim()
    for d in range(x.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * x.shape[d + 1]
    flat = index * strides[dim]
    for d in range(x.dim()):
        if d == dim:
            continue
        shape = [1] * x.dim()
        shape[d] = index.shape[d]
        flat = flat + torch.arange(index.shape[d], device=x.device).reshape(shape) * strides[d]
    return x.reshape(-1).index_select(0, flat.reshape(-1)).reshape(index.shape)


def flip(x, dims):
    """``flip`` as a GATHER with a reversed (constant) index per flipped dim."""
    for d in dims:
        size = x.shape[d]
        x = x.index_select(d, torch.arange(size - 1, -1, -1, device=x.device))
    return x


def adaptive_max_pool2d(x, output_size):
    """Global max pooling (output 1×1): REDUCE_MAX over H, W; other sizes stay whole."""
    if tuple(output_size) != (1, 1):
        return NotImplemented
    values = torch.amax(x, (-2, -1), keepdim=True)
    indices = torch.argmax(x.flatten(-2), -1, keepdim=True).unsqueeze(-1)
    return values, indices


def scaled_dot_product_attention(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """Attention as BATCH_MATMUL → (mask) → SOFTMAX → BATCH_MATMUL.

    torch's own decomposition guards rows whose scores are all ``-inf`` (softmax would give
    NaN; torch returns 0) by testing the *scores* in every layer: EQUAL, LOGICAL_NOT,
    REDUCE_ANY, LOGICAL_NOT and SELECT_V2 per attention. A score is ``-inf`` exactly where
    the mask is (``q·k`` is finite for finite inputs), so the guard here tests the mask: one
    computation that CSE shares across every layer reading the same mask, and none at all
    without a mask or for a causal one (every row keeps its diagonal).
    """
    if dropout_p != 0.0:
        return NotImplemented
    length, source = q.shape[-2], k.shape[-2]
    group = 1
    if enable_gqa:
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
            return NotImplemented
        group = q.shape[1] // k.shape[1]
    heads = q.shape[-3]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Grouped-query attention: the ``group`` query heads of one key/value head are rows of
    # one matrix, so each key/value head is read as it is (repeating it for every query
    # head would be a RESHAPE, BROADCAST_TO and RESHAPE per key and value, per layer).
    rows = q * scale
    if group > 1:
        rows = rows.reshape(q.shape[0], heads // group, group * length, q.shape[-1])
    scores = rows @ k.transpose(-2, -1)
    keep = None
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=q.device).tril()
        scores = torch.where(causal.repeat(group, 1), scores, float("-inf"))
    elif attn_mask is not None:
        mask = _grouped_rows(attn_mask, group, length)
        if attn_mask.dtype == torch.bool:
            scores = torch.where(mask, scores, float("-inf"))
            keep = mask.any(-1, keepdim=True)
        else:
            scores = scores + mask
            keep = (mask != float("-inf")).any(-1, keepdim=True)
    weights = torch.softmax(scores, -1)
    if keep is not None:
        weights = torch.where(keep, weights, 0.0)
    out = weights @ v
    return out.reshape(*out.shape[:-3], heads, length, out.shape[-1]) if group > 1 else out


def _grouped_rows(mask, group: int, length: int):
    """An attention mask (``[..., heads or 1, length, source]``) for scores whose rows are
    ``group`` query heads of ``length`` rows each (one head's rows after another)."""
    if group == 1:
        return mask
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    batch, heads, source = mask.shape[0], mask.shape[1], mask.shape[-1]
    if mask.dtype == torch.bool:  # (onert's BROADCAST_TO takes no bool tensor)
        return _grouped_rows(mask.to(torch.float32), group, length) > 0.5
    if heads == 1:  # one mask for every head: the same rows for each head of the group
        return (
            mask.unsqueeze(2)
            .expand(batch, 1, group, length, source)
            .reshape(batch, 1, group * length, source)
        )
    return mask.expand(batch, heads, length, source).reshape(
        batch, heads // group, group * length, source
    )


def slice_copy(x, dim=0, start=None, end=None, step=1):
    """The ``*_copy`` spellings of views (``torch.slice_copy``) are the view, cloned."""
    return aten.slice.Tensor(x, dim, start, end, step).clone()


def select_copy(x, dim, index):
    return aten.select.int(x, dim, index).clone()


def index_put(x, indices, values, accumulate=False):
    """``x[i] = v`` with one 1-D integer index on the first dim (a KV cache written at
    computed positions): each row of ``x`` whose number is in ``i`` takes the row of ``v``
    that names it (GATHER of ``v`` by the matching position, then SELECT_V2). Other forms
    (several index tensors, masks, ``accumulate``) stay whole and are reported."""
    if accumulate or len(indices) != 1 or indices[0] is None:
        return NotImplemented
    index = indices[0]
    if index.dim() != 1 or index.dtype in (torch.bool, torch.uint8):
        return NotImplemented
    rows = x.shape[0]
    position = torch.arange(rows, device=x.device)[:, None]
    # A negative index -j names row rows - j: compare with both (no SELECT_V2 on int64,
    # which onert 0.1.0 cannot run).
    hits = (position == index[None, :]) | (position == index[None, :] + rows)  # [rows, k]
    source = torch.argmax(hits.to(torch.int32), 1)  # which value each row takes
    values = values.expand(index.shape[0], *x.shape[1:]).to(x.dtype)
    taken = values.index_select(0, source)
    written = hits.any(1).reshape(rows, *([1] * (x.dim() - 1)))
    return torch.where(written, taken, x)


#: ATen overload → decomposition, merged into torch's core-ATen table by the export stage.
DECOMPOSITIONS = {
    aten.slice_scatter.default: slice_scatter,
    aten.copy.default: copy,
    aten.convolution.default: convolution,
    aten.elu.default: elu,
    aten.expm1.default: expm1,
    aten.log1p.default: log1p,
    aten.exp2.default: exp2,
    aten.sign.default: sign,
    aten.trunc.default: trunc,
    aten.div.Tensor_mode: div_mode,
    aten.div.Scalar_mode: div_mode,
    aten.remainder.Tensor: remainder,
    aten.remainder.Scalar: remainder,
    aten.isnan.default: isnan,
    aten.clamp.Tensor: clamp_tensor,
    aten.addmm.default: addmm,
    aten.mean.dim: mean_dtype,
    aten.any.dims: any_dims,
    aten.any.dim: any_dim,
    aten.var.correction: variance,
    aten.max.dim: max_dim,
    aten.min.dim: min_dim,
    aten.native_group_norm.default: group_norm,
    aten.linalg_vector_norm.default: vector_norm,
    aten.gather.default: gather,
    aten.flip.default: flip,
    aten.adaptive_max_pool2d.default: adaptive_max_pool2d,
    aten.scaled_dot_product_attention.default: scaled_dot_product_attention,
    aten.slice_copy.Tensor: slice_copy,
    aten.select_copy.int: select_copy,
    aten.index_put.default: index_put,
}


def decomposed_ops() -> set[str]:
    """Canonical names (:mod:`fxopt.ir.ops`) of the ops decomposed here."""
    from fxopt.ir.op_table import SPEC_BY_ATEN

    names = set()
    for overload in DECOMPOSITIONS:
        packet = overload._overloadpacket.__name__
        spec = SPEC_BY_ATEN.get(packet)
        names.add(spec.name if spec is not None else packet)
    return names
