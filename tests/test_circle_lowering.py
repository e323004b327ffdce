"""Per-lowering parity: each op converted to Circle and run in onert, against PyTorch.

Ops that onert 0.1.0 cannot run are validated in LiteRT, the second runtime; without it,
validate() must say "converted, not validated" for them instead of guessing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt import circle
from fxopt.circle import runtime
from fxopt.circle.converter import example_outputs
from fxopt.circle.runtime import litert_available, onert_available

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
needs_litert = pytest.mark.skipif(not litert_available(), reason="ai-edge-litert is not installed")


class Fn(nn.Module):
    def __init__(self, fn, *params: torch.Tensor):
        super().__init__()
        self.fn = fn
        for i, p in enumerate(params):
            self.register_buffer(f"p{i}", p)

    def forward(self, *xs):
        return self.fn(self, *xs)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _masked_row():
    """An additive attention mask with one row masked entirely (-inf): torch returns 0."""
    mask = _x(2, 1, 5, 5, seed=6)
    mask[0, 0, 1] = float("-inf")
    return mask


X4 = _x(2, 3, 6, 6)
X3 = _x(2, 4, 8)

# name → (module, inputs, an operator the Circle model must contain)
CASES = {
    "add": (Fn(lambda m, a, b: a + b), (X3, _x(2, 4, 8, seed=1)), "ADD"),
    "sub_scalar": (Fn(lambda m, a: a - 1.5), (X3,), "SUB"),
    "mul_broadcast": (Fn(lambda m, a, b: a * b), (X3, _x(8, seed=1)), "MUL"),
    "div": (Fn(lambda m, a: a / 3.0), (X3,), "DIV"),
    "relu": (nn.ReLU(), (X3,), "RELU"),
    "relu6": (nn.ReLU6(), (X3 * 5,), "RELU6"),
    "sigmoid": (nn.Sigmoid(), (X3,), "LOGISTIC"),
    "tanh": (nn.Tanh(), (X3,), "TANH"),
    "gelu": (nn.GELU(), (X3,), "GELU"),
    "gelu_tanh": (nn.GELU(approximate="tanh"), (X3,), "GELU"),
    "silu": (nn.SiLU(), (X3,), "LOGISTIC"),
    "hardswish": (nn.Hardswish(), (X3 * 4,), "MUL"),
    "leaky_relu": (nn.LeakyReLU(0.2), (X3,), "LEAKY_RELU"),
    "clamp": (Fn(lambda m, a: a.clamp(-0.5, 0.7)), (X3,), "MINIMUM"),
    # onert 0.1.0 refuses a standalone RELU_N1_TO_1: [-1, 1] is MAXIMUM and MINIMUM too.
    "clamp_minus_one_one": (Fn(lambda m, a: (a * 2).clamp(-1, 1)), (X3,), "MINIMUM"),
    "hardtanh": (nn.Hardtanh(), (X3 * 2,), "MAXIMUM"),
    "exp_log": (Fn(lambda m, a: torch.log(torch.exp(a) + 1)), (X3,), "LOG"),
    "floor": (Fn(lambda m, a: torch.floor(a * 3)), (X3,), "FLOOR"),
    "comparisons": (
        Fn(lambda m, a, b: torch.where(a > b, a, b) + (a <= 0).float()),
        (X3, _x(2, 4, 8, seed=1)),
        "SELECT_V2",
    ),
    "softmax": (nn.Softmax(dim=-1), (X3,), "SOFTMAX"),
    "softmax_dim1": (nn.Softmax(dim=1), (X3,), "SOFTMAX"),
    "log_softmax": (nn.LogSoftmax(dim=-1), (X3,), "LOG_SOFTMAX"),
    "layer_norm": (nn.LayerNorm(8), (X3,), "RSQRT"),
    "linear_3d": (nn.Linear(8, 5), (X3,), "FULLY_CONNECTED"),
    "matmul_4d": (
        Fn(lambda m, a, b: a @ b),
        (_x(2, 2, 3, 4), _x(2, 2, 4, 5, seed=1)),
        "BATCH_MATMUL",
    ),
    "bmm": (
        Fn(lambda m, a, b: torch.bmm(a, b)),
        (_x(2, 3, 4), _x(2, 4, 5, seed=1)),
        "BATCH_MATMUL",
    ),
    "permute_reshape": (Fn(lambda m, a: a.permute(0, 2, 1).reshape(2, -1)), (X3,), "TRANSPOSE"),
    "slice": (Fn(lambda m, a: a[:, 1:3, ::1]), (X3,), "SLICE"),
    "select": (Fn(lambda m, a: a[:, 2]), (X3,), "SLICE"),
    # onert prepares REDUCE_ANY of bool only: any() of numbers goes through x != 0.
    # (torch.any(x, dim) of numbers reaches the lowering as any(x != 0) already.)
    "any_of_floats": (Fn(lambda m, a: torch.any(a.relu() - 1.5)), (X4,), "NOT_EQUAL"),
    "any_of_ints": (Fn(lambda m, a: torch.any((a * 3).int())), (X4,), "NOT_EQUAL"),
    # NaN where torch has NaN (log, sqrt of negatives) is a match, not "error nan".
    "log_of_negatives": (Fn(lambda m, a: torch.log(a)), (X3,), "LOG"),
    "sqrt_of_negatives": (Fn(lambda m, a: torch.sqrt(a) + 1), (X3,), "SQRT"),
    # onert 0.1.0's SLICE of a rank-5 tensor is wrong; its STRIDED_SLICE is right.
    "slice_rank5": (Fn(lambda m, a: a[:, 1:] * 2), (_x(2, 3, 2, 4, 5),), "STRIDED_SLICE"),
    "slice_rank5_last_dim": (
        Fn(lambda m, a: a[..., :3] * 2),
        (_x(1, 2, 2, 4, 5),),
        "STRIDED_SLICE",
    ),
    "select_rank5": (Fn(lambda m, a: a[:, 0] * 2), (_x(1, 2, 2, 8, 4),), "STRIDED_SLICE"),
    "cat": (
        Fn(lambda m, a, b: torch.cat([a, b], dim=1)),
        (X3, _x(2, 4, 8, seed=1)),
        "CONCATENATION",
    ),
    "split": (Fn(lambda m, a: torch.split(a, [3, 5], dim=-1)[1] * 2), (X3,), "SLICE"),
    "mean_sum": (Fn(lambda m, a: a.mean(-1) + a.sum(1).mean(-1, keepdim=True)), (X3,), "MEAN"),
    "amax": (Fn(lambda m, a: a.amax(-1)), (X3,), "REDUCE_MAX"),
    "embedding": (nn.Embedding(10, 4), (torch.tensor([[1, 2, 9], [0, 3, 3]]),), "GATHER"),
    "index_select": (
        Fn(lambda m, a: torch.index_select(a, 2, m.p0), torch.tensor([0, 5, 2])),
        (X3,),
        "GATHER",
    ),
    # aten.index.Tensor: GATHER on the (flattened) indexed dims, no GATHER_ND
    "index_const_one_dim": (
        Fn(lambda m, a: a[:, m.p0], torch.tensor([[3, 0], [-1, 2]])),
        (X3,),
        "GATHER",
    ),
    "index_const_two_dims": (
        Fn(lambda m, a: a[m.p0, m.p1], torch.tensor([1, 0, 1]), torch.tensor([[3], [0]])),
        (X3,),
        "GATHER",
    ),
    "index_computed_one_dim": (
        Fn(lambda m, a, i: a[:, :, i]),
        (X3, torch.tensor([[7, 1], [0, 2]])),
        "GATHER",
    ),
    "index_computed_two_dims": (
        Fn(lambda m, a, i, j: a[i, j]),
        (X3, torch.tensor([1, 0, 1]), torch.tensor([[3], [0]])),
        "GATHER",
    ),
    # transformers' mask[arange(b)[:, None], arange(n)]: lowered as a RESHAPE to the same
    # shape (no GATHER), which merge-reshapes then bypasses: only the MUL is left
    "index_identity_is_free": (
        Fn(lambda m, a: a[torch.arange(4)[:, None], torch.arange(8)[None, :]] * 2),
        (_x(4, 8),),
        "MUL",
    ),
    "any": (Fn(lambda m, a: (a > 1).any(-1, keepdim=True).float() + a), (X3,), "REDUCE_ANY"),
    "conv": (nn.Conv2d(3, 4, 3, padding=1), (X4,), "CONV_2D"),
    "conv_stride2_nobias": (nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False), (X4,), "CONV_2D"),
    "conv_dilated": (nn.Conv2d(3, 4, 3, dilation=2, padding=2), (X4,), "CONV_2D"),
    "depthwise": (nn.Conv2d(3, 6, 3, padding=1, groups=3), (X4,), "DEPTHWISE_CONV_2D"),
    "max_pool": (nn.MaxPool2d(2), (X4,), "MAX_POOL_2D"),
    "max_pool_padded": (nn.MaxPool2d(3, 2, padding=1), (X4,), "MAX_POOL_2D"),
    "avg_pool": (nn.AvgPool2d(2), (X4,), "AVERAGE_POOL_2D"),
    "adaptive_avg_pool": (nn.AdaptiveAvgPool2d(1), (X4,), "MEAN"),
    "pad": (Fn(lambda m, a: F.pad(a, (1, 2, 0, 1), value=0.5)), (X4,), "PADV2"),
    "interpolate_bilinear": (
        Fn(lambda m, a: F.interpolate(a, scale_factor=2, mode="bilinear")),
        (X4,),
        "RESIZE_BILINEAR",
    ),
    "batch_norm_unfolded": (
        Fn(
            lambda m, a: F.batch_norm(a, m.p0, m.p1, training=False),
            torch.rand(3),
            torch.rand(3) + 0.5,
        ),
        (X4,),
        "MUL",
    ),
    # fxopt.circle.decompose: ops Circle has no operator for, in ops it has
    "conv1d": (nn.Conv1d(4, 6, 3, stride=2, padding=1), (X3,), "CONV_2D"),
    "conv1d_depthwise": (nn.Conv1d(4, 8, 3, groups=4, dilation=2), (X3,), "DEPTHWISE_CONV_2D"),
    "conv_grouped": (nn.Conv2d(4, 6, 3, groups=2, padding=1), (_x(2, 4, 6, 6),), "CONCATENATION"),
    "slice_scatter": (
        Fn(lambda m, a: torch.slice_scatter(a, a[:, 1:3] * 2, 1, 1, 3)),
        (X3,),
        "CONCATENATION",
    ),
    "slice_scatter_step": (
        Fn(lambda m, a: torch.slice_scatter(a, a[:, :, 1::2] * 3, 2, 0, 8, 2)),
        (X3,),
        "SELECT_V2",
    ),
    "index_assign": (Fn(lambda m, a: _assigned(a)), (X3,), "CONCATENATION"),
    "slice_copy": (Fn(lambda m, a: torch.slice_copy(a, 1, 1, 3) * 2), (X3,), "SLICE"),
    "select_copy": (Fn(lambda m, a: torch.select_copy(a, 2, 3) + 1), (X3,), "SLICE"),
    "elu": (nn.ELU(0.7), (X3,), "EXP"),
    "elu_plain": (nn.ELU(), (X3,), "ELU"),
    "selu": (nn.SELU(), (X3,), "EXP"),
    "softplus": (nn.Softplus(), (X3,), "LOG"),
    "log1p_expm1": (Fn(lambda m, a: torch.log1p(a.abs()) + torch.expm1(a)), (X3,), "LOG"),
    "round": (Fn(lambda m, a: torch.round(a * 3)), (X3,), "ROUND"),
    "ceil": (Fn(lambda m, a: torch.ceil(a * 3)), (X3,), "FLOOR"),
    "trunc_sign": (Fn(lambda m, a: torch.trunc(a * 3) + torch.sign(a)), (X3,), "FLOOR"),
    "floor_divide": (Fn(lambda m, a: torch.floor_divide(a, 0.7)), (X3,), "FLOOR"),
    "remainder": (Fn(lambda m, a: torch.remainder(a, 0.7)), (X3,), "FLOOR"),
    "reciprocal": (Fn(lambda m, a: torch.reciprocal(a.abs() + 1)), (X3,), "DIV"),
    "max_dim": (Fn(lambda m, a: torch.max(a, dim=1)), (X3,), "ARG_MAX"),
    "min_dim": (Fn(lambda m, a: torch.min(a, dim=-1, keepdim=True)), (X3,), "ARG_MIN"),
    "amin": (Fn(lambda m, a: a.amin(1)), (X3,), "REDUCE_MAX"),
    "argmin_all": (Fn(lambda m, a: a.argmin()), (X3,), "ARG_MIN"),
    "mean_4d_dim1": (Fn(lambda m, a: a.mean(1) + a.sum((2, 3)).mean()), (X4,), "MEAN"),
    "var_std": (Fn(lambda m, a: a.var(-1) + a.std(1, correction=0).sum()), (X3,), "SUM"),
    "addmm_alpha_beta": (
        Fn(lambda m, b, a, w: torch.addmm(b, a, w, beta=0.5, alpha=2.0)),
        (_x(3, 5), _x(3, 4, seed=1), _x(4, 5, seed=2)),
        "BATCH_MATMUL",
    ),
    "clamp_tensor_bounds": (
        Fn(lambda m, a, lo, hi: torch.clamp(a, lo, hi)),
        (X3, torch.full((8,), -0.5), torch.full((8,), 0.5)),
        "MINIMUM",
    ),
    "mean_dtype": (Fn(lambda m, a: a.mean(1, dtype=torch.float32)), (X3,), "MEAN"),
    "any_float": (Fn(lambda m, a: a.any(1)), (X3,), "REDUCE_ANY"),
    "repeat": (Fn(lambda m, a: a.repeat(2, 1, 3)), (X3,), "TILE"),
    "repeat_new_dims": (Fn(lambda m, a: a.repeat(2, 1, 1, 3)), (X3,), "TILE"),
    "group_norm": (nn.GroupNorm(2, 4), (_x(2, 4, 5, 5),), "RSQRT"),
    "group_norm_one_group_after_conv": (  # PoolFormer: stays NHWC, no reshape
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(1, 4), nn.Conv2d(4, 2, 1)),
        (X4,),
        "RSQRT",
    ),
    "group_norm_per_channel": (nn.GroupNorm(4, 4), (_x(2, 4, 5, 5),), "RSQRT"),
    "grouped_conv_bn_folded": (  # RegNet: BN folds into the whole grouped conv first
        nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.BatchNorm2d(6), nn.ReLU()),
        (_x(2, 4, 6, 6),),
        "SPLIT",
    ),
    "normalize": (Fn(lambda m, a: F.normalize(a, dim=1)), (X3,), "SQRT"),
    "gather": (
        Fn(lambda m, a, i: torch.gather(a, 2, i)),
        (X3, torch.randint(0, 8, (2, 4, 3), generator=torch.Generator().manual_seed(0))),
        "GATHER",
    ),
    "flip": (Fn(lambda m, a: a.flip(-1, 1)), (X3,), "GATHER"),
    "adaptive_max_pool": (nn.AdaptiveMaxPool2d(1), (X4,), "REDUCE_MAX"),
    "isnan": (Fn(lambda m, a: torch.where(torch.isnan(a), 0.0, a)), (X3,), "NOT_EQUAL"),
    # constants of another dtype in a float op: cast at conversion
    "int_constant": (Fn(lambda m, a: a + m.p0, torch.arange(8)), (X3,), "ADD"),
    "bool_constant": (Fn(lambda m, a: a * m.p0, torch.arange(8) % 2 == 0), (X3,), "MUL"),
    "pow_int_tensor": (Fn(lambda m, a: torch.pow(a, m.p0), torch.tensor(3)), (X3,), "POW"),
    # matmul with a constant operand: FULLY_CONNECTED (onert refuses a constant-LHS BMM)
    "matmul_const_rhs": (Fn(lambda m, a: a @ m.p0, _x(8, 5, seed=3)), (X3,), "FULLY_CONNECTED"),
    "mm_const_lhs": (
        Fn(lambda m, a: torch.mm(m.p0, a), _x(3, 4, seed=3)),
        (_x(4, 5),),
        "FULLY_CONNECTED",
    ),
    "bmm_const_lhs": (
        Fn(lambda m, a: torch.bmm(m.p0, a), _x(1, 3, 4, seed=3)),
        (_x(1, 4, 5),),
        "FULLY_CONNECTED",
    ),
    "max_pool_ceil_mode": (nn.MaxPool2d(3, 2, padding=1, ceil_mode=True), (X4,), "MAX_POOL_2D"),
    "conv_weight_is_an_input": (
        Fn(lambda m, a, w: F.conv2d(a, w, padding=1)),
        (X4, _x(5, 3, 3, 3, seed=4)),
        "CONV_2D",
    ),
    "linear_computed_weight": (  # onert ignores BATCH_MATMUL's adjY: a TRANSPOSE instead
        Fn(lambda m, a, w: F.linear(a, w)),
        (X3, _x(5, 8, seed=5)),
        "BATCH_MATMUL",
    ),
    "sdpa_float_mask_fully_masked_row": (
        Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        (_x(2, 2, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2), _masked_row()),
        "SELECT_V2",
    ),
    "sdpa_bool_mask": (
        Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)),
        (_x(2, 2, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2), _masked_row() > 0),
        "SELECT_V2",
    ),
    "sdpa_causal": (
        Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
        (_x(2, 2, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2)),
        "SOFTMAX",
    ),
    "sdpa_without_a_heads_dim": (
        Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v)),
        (_x(2, 5, 8), _x(2, 5, 8, seed=1), _x(2, 5, 8, seed=2)),
        "SOFTMAX",
    ),
    # Grouped-query attention: 4 query heads on 2 key/value heads.
    "sdpa_gqa_bool_mask": (
        Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)),
        (_x(2, 4, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2), _masked_row() > 0),
        "SELECT_V2",
    ),
    "sdpa_gqa_float_mask_fully_masked_row": (
        Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)),
        (_x(2, 4, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2), _masked_row()),
        "SELECT_V2",
    ),
    "sdpa_gqa_mask_per_head": (
        Fn(lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)),
        (_x(2, 4, 5, 8), _x(2, 2, 5, 8, seed=1), _x(2, 2, 5, 8, seed=2), _x(2, 4, 5, 5, seed=3)),
        "SOFTMAX",
    ),
    "sdpa_gqa_causal": (
        Fn(
            lambda m, q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            )
        ),
        (_x(2, 4, 5, 8), _x(2, 2, 7, 8, seed=1), _x(2, 2, 7, 8, seed=2)),
        "SOFTMAX",
    ),
    "multihead_attention": (
        nn.MultiheadAttention(8, 2, batch_first=True),
        (X3,) * 3,
        "SOFTMAX",
    ),
}


def _assigned(a):
    y = a.clone()
    y[:, 1:3] = 0.5
    y[0] = y[0] * 2
    return y


# onert 0.1.0 has no kernel for these: converted, and validate() says so.
NOT_RUNNABLE = {
    "cumsum": (Fn(lambda m, a: torch.cumsum(a, dim=-1)), (X3,), "CUMSUM"),
    "interpolate_nearest": (
        Fn(lambda m, a: F.interpolate(a, scale_factor=2, mode="nearest")),
        (X4,),
        "RESIZE_NEAREST_NEIGHBOR",
    ),
    "conv_transpose2d": (
        nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, output_padding=1),
        (X4,),
        "TRANSPOSE_CONV",
    ),
    "conv_transpose2d_past_the_kernel": (  # output_padding > padding: zeros, then no bias
        nn.ConvTranspose2d(3, 2, 3, stride=2, output_padding=1, bias=False),
        (X4,),
        "TRANSPOSE_CONV",
    ),
    "conv_transpose1d": (nn.ConvTranspose1d(4, 3, 3, stride=2), (X3,), "TRANSPOSE_CONV"),
    "conv3d": (nn.Conv3d(2, 3, 3, padding=(0, 1, 2)), (_x(1, 2, 4, 6, 6),), "CONV_3D"),
    "cumsum_int32_into_int64": (  # RoBERTa's position ids: torch sums int32 into int64
        Fn(lambda m, a: (a > 0).int().cumsum(-1) * 2),
        (X3,),
        "CUMSUM",
    ),
}


@needs_onert
@pytest.mark.parametrize("name", sorted(CASES))
def test_lowering_matches_torch_in_onert(name):
    model, inputs, op = CASES[name]
    model.eval()
    converted = circle.convert(model, inputs)
    assert op in converted.op_counts, converted.op_counts
    result = circle.validate(converted, inputs, example_outputs(model, inputs), atol=2e-5)
    assert result.validated, result.message
    assert result.max_abs_error < 2e-5


@needs_litert
@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_lowering_onert_cannot_run_is_validated_in_litert(name):
    model, inputs, op = NOT_RUNNABLE[name]
    converted = circle.convert(model.eval(), inputs)
    assert op in converted.op_counts
    assert converted.validation.runtime == "litert" and converted.validation.validated
    other = tuple(x + 1.5 for x in inputs)
    result = circle.validate(converted, other, example_outputs(model, other))
    assert result.validated and result.runtime == "litert", result.message


@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_lowering_no_runtime_can_run_is_reported_not_guessed(name, monkeypatch):
    monkeypatch.setattr(runtime, "litert_available", lambda: False)
    model, inputs, op = NOT_RUNNABLE[name]
    with pytest.warns(circle.NotValidatedWarning, match=f"onert cannot run {op}"):
        converted = circle.convert(model.eval(), inputs)
    assert op in converted.op_counts
    result = circle.validate(converted, inputs, example_outputs(model, inputs))
    assert not result.validated and result.runtime is None
    assert result.message == (
        f"converted, not validated: onert cannot run {op}, and LiteRT (ai-edge-litert) is "
        "not installed"
    )


def test_topk_converts_to_topk_v2_with_int64_indices():
    model = Fn(lambda m, a: torch.topk(a, 3).indices)
    converted = circle.convert(model.eval(), (X3,))
    assert converted.op_counts.get("TOPK_V2") == 1
    assert converted.op_counts.get("CAST") == 1  # int32 indices → torch's int64


def test_index_that_picks_every_element_in_order_is_a_reshape_not_a_gather():
    model = Fn(lambda m, a: a[torch.arange(4)[:, None, None], torch.arange(8)[None, None, :]])
    converted = circle.convert(model.eval(), (_x(4, 8),))
    assert converted.op_counts == {"RESHAPE": 1}


def test_index_split_by_a_full_slice_is_reported_unsupported():
    model = Fn(lambda m, a, i: a[i, :, i] + 1)
    inputs = (X3, torch.tensor([0, 1]))
    with pytest.raises(circle.UnsupportedOpsError, match=r"index ×1 .*separated by a full slice"):
        circle.convert(model.eval(), inputs)


def _shifted(*shape, seed):
    """Values with a mean and scale far from 0 and 1: a norm that ignored them shows."""
    return _x(*shape, seed=seed) * 3 + 5


INSTANCE_NORMS = {
    "instance_norm_2d": (nn.InstanceNorm2d(3), (2, 3, 6, 6)),
    "instance_norm_2d_affine": (nn.InstanceNorm2d(3, affine=True), (2, 3, 6, 6)),
    "instance_norm_1d": (nn.InstanceNorm1d(4), (2, 4, 8)),
    "group_of_one_batch": (Fn(lambda m, a: F.batch_norm(a, None, None, training=True)), (1, 3, 5)),
}


@needs_onert
@pytest.mark.parametrize("name", sorted(INSTANCE_NORMS))
def test_batch_statistics_norms_match_torch_on_inputs_the_example_is_not(name):
    # Instance norm decomposes to a batch norm over the batch's own statistics; lowering
    # it with the running-statistics formula wrote a file off by ~11 that ran fine.
    model, shape = INSTANCE_NORMS[name]
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.rand_like(p) + 0.5)
    converted = circle.convert(model, (_shifted(*shape, seed=0),))
    assert "MEAN" in converted.op_counts, converted.op_counts
    for seed in (1, 2):  # other values, same shape: the statistics are computed, not baked
        inputs = (_shifted(*shape, seed=seed) * seed,)
        result = circle.validate(converted, inputs, example_outputs(model, inputs), atol=1e-4)
        assert result.validated, result.message


def _repeated_heads(x, group: int):
    """transformers' repeat_kv: each key/value head repeated for its query group."""
    batch, heads, length, dim = x.shape
    x = x[:, :, None, :, :].expand(batch, heads, group, length, dim)
    return x.reshape(batch, heads * group, length, dim)


@needs_onert
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "bool mask"])
@pytest.mark.parametrize("length", [1, 6], ids=["decode", "prefill"])
def test_repeated_key_value_heads_are_read_once_not_broadcast(length, masked):
    def attention(m, q, k, v, *mask):
        k, v = _repeated_heads(k, 2), _repeated_heads(v, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None)

    def two_layers(m, q, k, v, *mask):
        return attention(m, attention(m, q, k, v, *mask), k, v, *mask)

    def inputs(seed, source=9):
        mask = (_x(1, 1, length, source, seed=seed + 3) > -0.5,) if masked else ()
        kv = (_x(1, 2, source, 8, seed=seed + 1), _x(1, 2, source, 8, seed=seed + 2))
        return (_x(1, 4, length, 8, seed=seed), *kv, *mask)

    model = Fn(two_layers).eval()
    converted = circle.convert(model, inputs(0))
    assert converted.report["grouped_attention"] == 2
    # Only the mask is broadcast (to the rows of each query group), once for every layer;
    # the keys and values never are.
    assert converted.op_counts.get("BROADCAST_TO", 0) == int(masked)
    other = inputs(10)  # other values and another mask
    result = circle.validate(converted, other, example_outputs(model, other), atol=2e-5)
    assert result.validated, result.message


class _CacheUpdate(nn.Module):
    """A decode step's attention: the grown key/value cache is returned and read."""

    def forward(self, k0, k1, v0, v1, q):
        k, v = torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v, k, v


@needs_onert
@pytest.mark.parametrize(
    "model", [_CacheUpdate(), Fn(lambda m, x, q: (q @ (x * 1.5).transpose(-1, -2), x * 1.5))]
)
def test_a_returned_value_attention_reads_is_right_in_onert_without_a_retry(model):
    # onert overwrote such outputs (by 2-6.5); convert(validate=True) would have retried
    # with every read output copied, a file converted without validation would not.
    def inputs(seed):
        if isinstance(model, _CacheUpdate):
            return (*(_x(1, 2, n, 8, seed=seed + n) for n in (4, 1, 4, 1)), _x(1, 2, 1, 8))
        return (_x(1, 2, 5, 8, seed=seed), _x(1, 2, 1, 8, seed=seed + 1))

    converted = circle.convert(model.eval(), inputs(0), validate=False)
    for seed in (0, 10):
        result = circle.validate(converted, inputs(seed), example_outputs(model, inputs(seed)))
        assert result.validated, result.message


@needs_onert
def test_folding_repeated_heads_leaves_the_users_exported_program_as_it_was():
    def attention(m, q, k, v):
        return F.scaled_dot_product_attention(q, _repeated_heads(k, 2), _repeated_heads(v, 2))

    inputs = (_x(1, 4, 3, 8), _x(1, 2, 3, 8, seed=1), _x(1, 2, 3, 8, seed=2))
    ep = torch.export.export(Fn(attention).eval(), inputs)
    before = ep.graph_module.code
    converted = circle.convert_from_exported_program(ep)
    assert converted.report["grouped_attention"] == 1 and converted.validation.validated
    assert ep.graph_module.code == before


@needs_onert
def test_legalize_causal_mask_value_bounds_minus_inf_and_keeps_outputs():
    """-inf in a mask becomes -120 (TICO's value): no -inf constant left, same outputs."""
    model = Fn(lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)).eval()
    inputs = (_x(1, 2, 6, 8), _x(1, 2, 6, 8, seed=1), _x(1, 2, 6, 8, seed=2))
    on = circle.convert(model, inputs, config=circle.CircleConfig(legalize_causal_mask_value=True))
    assert on.validation.validated and on.validation.max_abs_error < 1e-5
    off = circle.convert(model, inputs)
    assert _has_minus_inf(off.bytes) and not _has_minus_inf(on.bytes)


def _has_minus_inf(data: bytes) -> bool:
    from circle_schema.v0_10.circle.Model import Model, ModelT

    model = ModelT.InitFromObj(Model.GetRootAsModel(data, 0))
    floats = [
        np.frombuffer(bytes(model.buffers[t.buffer].data), np.float32)
        for t in model.subgraphs[0].tensors
        if t.type == 0 and model.buffers[t.buffer].data is not None  # FLOAT32 constants
    ]
    return any(np.isneginf(values).any() for values in floats)


@needs_onert
def test_convert_expand_to_slice_cat_has_no_broadcast_and_same_outputs():
    model = Fn(lambda m, a: a[:, :1].expand(2, 3, 8) + a[:, :, :1])
    config = circle.CircleConfig(convert_expand_to_slice_cat=True)
    converted = circle.convert(model.eval(), (X3[:, :3].contiguous(),), config=config)
    assert "BROADCAST_TO" not in converted.op_counts
    assert "CONCATENATION" in converted.op_counts and converted.validation.validated


@needs_onert
def test_const_lhs_matmul_toggle_off_writes_the_batch_matmul_onert_refuses():
    model = Fn(lambda m, a: torch.mm(m.p0, a), _x(3, 4, seed=3)).eval()
    config = circle.CircleConfig(const_lhs_matmul_to_fully_connected=False)
    with pytest.raises(circle.CircleValidationError, match="onert failed to run"):
        circle.convert(model, (_x(4, 5),), config=config)
    converted = circle.convert(model, (_x(4, 5),), config=config, validate=False)
    assert converted.op_counts == {"BATCH_MATMUL": 1}


def test_identity_layer_norm_affine_is_not_lowered():
    fresh = nn.LayerNorm(8).eval()  # weight 1, bias 0
    trained = nn.LayerNorm(8).eval()
    with torch.no_grad():
        trained.weight.mul_(2)
        trained.bias.add_(0.5)
    plain = circle.convert(fresh, (X3,)).op_counts
    affine = circle.convert(trained, (X3,)).op_counts
    assert affine["MUL"] == plain["MUL"] + 1 and affine["ADD"] == plain["ADD"] + 1


def test_batch_norm_after_a_grouped_conv_folds_into_it():
    model = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.BatchNorm2d(6), nn.ReLU()).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    converted = circle.convert(model, (_x(2, 4, 6, 6),))
    assert converted.op_counts == {
        "TRANSPOSE": 2,
        "CONV_2D": 2,
        "SPLIT": 1,
        "CONCATENATION": 1,
        "RELU": 1,
    }


@needs_onert
def test_where_with_an_all_true_constant_condition_is_no_operator():
    model = Fn(lambda m, a: torch.where(m.p0, a * 2, 0.0), torch.ones(8, dtype=torch.bool))
    converted = circle.convert(model.eval(), (X3,))
    assert converted.op_counts == {"MUL": 1} and converted.validation.validated


@needs_onert
def test_index_put_at_computed_rows_matches_on_other_indices():
    """``cache[i] = v`` (a KV cache written at computed positions), negative rows too."""

    def write(m, cache, index, values):
        out = cache.clone()
        out[index] = values
        return out * 1

    model = Fn(write).eval()
    cache, values = _x(8, 2, 4), _x(2, 2, 4, seed=1)
    converted = circle.convert(model, (cache, torch.tensor([3, 5]), values))
    assert converted.validation.validated
    for index in ([0, 7], [-1, 2], [6, -8]):
        inputs = (cache, torch.tensor(index), values)
        result = circle.validate(converted, inputs, example_outputs(model, inputs))
        assert result.validated, (index, result.message)


def test_validation_takes_nan_in_the_same_places_and_nothing_else():
    from fxopt.circle.validation import compare

    nan, inf = float("nan"), float("inf")
    torch_out = np.array([1.0, nan, inf, -inf], np.float32)
    same = compare([torch_out.copy()], [torch_out], rtol=1e-4, atol=1e-4)
    assert same.validated and same.max_abs_error == 0.0
    for wrong in ([1.0, 2.0, inf, -inf], [1.0, nan, inf, inf], [nan, nan, inf, -inf]):
        result = compare([np.array(wrong, np.float32)], [torch_out], rtol=1e-4, atol=1e-4)
        assert not result.validated and result.max_abs_error == inf, wrong
