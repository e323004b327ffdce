"""fuse-kernels: conv2d / linear (+ activation, + residual add) on oneDNN's fused kernels.

The fusion mechanics, for every kernel: built with ``fast_math=True``, which also fuses the
kernels exact for finite inputs only (a fused ReLU maps NaN to 0; attention on SDPA
unchecked). What the default, exact form keeps out and how: tests/test_exact.py.
"""

from __future__ import annotations

import copy
import io
import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.capture import trace
from fxopt.ir import ops
from fxopt.passes import PassManager, cpu_kernels
from fxopt.passes.cpu_kernels import PackedWeight
from fxopt.passes.fuse_kernels import FuseKernels

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN"
)

_CONV = torch.ops.mkldnn._convolution_pointwise.default
_CONV_BINARY = torch.ops.mkldnn._convolution_pointwise.binary
_LINEAR = torch.ops.mkldnn._linear_pointwise.default


@pytest.fixture
def onednn_linears(monkeypatch):
    """Linears as in a build without MKL: on oneDNN's kernels, which fuse post-ops (with
    MKL, a linear runs on its packed GEMM and its post-op after it)."""
    monkeypatch.setattr(cpu_kernels, "_USE_MKL_LINEAR", False)


def _lower(model: nn.Module, x: torch.Tensor, mode: str = "fx", dynamic=None):
    gm = trace(model.eval(), (x,), mode=mode, dynamic=dynamic)
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    return result.module, result.records[0]


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _sdpa_takes_a_mask(gm) -> bool:
    (sdpa,) = [n for n in gm.graph.nodes if ops.is_call(n, "scaled_dot_product_attention")]
    return ops.args(sdpa).get("attn_mask") is not None


def _same(model, lowered, *inputs, atol=1e-4):
    with torch.no_grad():
        expected, actual = model(*inputs), lowered(*inputs)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=1e-4)


class ConvAct(nn.Module):
    def __init__(self, act: nn.Module, groups: int = 1, bias: bool = True, **conv):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, groups=groups, bias=bias, **conv)
        self.act = act

    def forward(self, x):
        return self.act(self.conv(x))


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize(
    "act",
    [
        nn.ReLU(),
        nn.ReLU(inplace=True),
        nn.ReLU6(),
        nn.Hardtanh(-0.5, 0.25),
        nn.SiLU(),
        nn.Sigmoid(),
        nn.Tanh(),
        nn.Hardswish(),
        nn.LeakyReLU(0.2),
        nn.GELU(),
        nn.GELU(approximate="tanh"),
    ],
    ids=lambda m: repr(m),
)
def test_conv_with_its_activation_becomes_one_kernel(act, mode):
    model, x = ConvAct(act), torch.randn(2, 4, 9, 9)
    captured = trace(model.eval(), (x,), mode=mode)
    # Core ATen decomposes some activations (silu → x * sigmoid(x)): then the conv output
    # has two users and nothing is fused, but the conv is still lowered.
    whole = sum(n.op.startswith("call") for n in captured.graph.nodes) == 2
    lowered, record = _lower(model, x, mode)
    assert record.changed and (record.stats["lowered"], record.stats["fused_ops"]) == (
        1,
        int(whole),
    )
    if whole:
        assert _targets(lowered) == [_CONV]
    _same(model, lowered, x)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "geometry",
    [{}, {"stride": 2}, {"padding": 2, "dilation": 2}, {"padding": (1, 0), "stride": (1, 2)}],
    ids=str,
)
def test_conv_geometry_groups_and_bias(groups, bias, geometry):
    model, x = ConvAct(nn.Identity(), groups, bias, **geometry), torch.randn(1, 4, 11, 10)
    lowered, record = _lower(model, x)
    assert record.stats["lowered"] == 1
    _same(model, lowered, x)


class Residual(nn.Module):
    """conv → add(skip) → relu, as in a ResNet block (the skip is another conv)."""

    def __init__(self, relu_after: bool = True, skip_conv: bool = True):
        super().__init__()
        self.main = nn.Conv2d(4, 4, 3, padding=1)
        self.skip = nn.Conv2d(4, 4, 1) if skip_conv else nn.Identity()
        self.relu_after = relu_after

    def forward(self, x):
        y = self.main(x) + self.skip(x)
        return F.relu(y) if self.relu_after else y


@pytest.mark.parametrize("dynamic", [None, "batch"])
@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("relu_after", [True, False])
def test_residual_add_runs_inside_one_conv_kernel(relu_after, mode, dynamic):
    # With a dynamic batch the add's operands are [s0, 8, 8, 8] both: provably one shape.
    model, x = Residual(relu_after), torch.randn(2, 4, 8, 8)
    lowered, record = _lower(model, x, mode, dynamic)
    # Both convs feed the add; exactly one of them takes it (and the relu).
    assert sorted(map(str, _targets(lowered))) == sorted(map(str, [_CONV, _CONV_BINARY]))
    assert (record.stats["lowered"], record.stats["fused_ops"]) == (2, 1 + relu_after)
    # The other conv's placements with the add overlap the chosen one: --explain says so.
    chosen = "conv_add_relu" if relu_after else "conv_add"
    assert any("not chosen" in s.reason and f"{chosen} at add" in s.reason for s in record.skipped)
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(5, 4, 8, 8))


def test_residual_with_the_input_itself_as_skip():
    model, x = Residual(skip_conv=False), torch.randn(1, 4, 8, 8)
    lowered, _ = _lower(model, x)
    assert _targets(lowered) == [_CONV_BINARY]
    _same(model, lowered, x)


def test_a_broadcasting_add_is_not_fused_but_the_conv_is_lowered():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.register_buffer("shift", torch.randn(1, 4, 1, 1))

        def forward(self, x):
            return self.conv(x) + self.shift

    model, x = Broadcast(), torch.randn(1, 4, 5, 5)
    lowered, record = _lower(model, x)
    assert (record.stats["lowered"], record.stats["fused_ops"]) == (1, 0)
    assert _CONV in _targets(lowered) and _CONV_BINARY not in _targets(lowered)
    _same(model, lowered, x)


def test_a_conv_output_used_twice_keeps_its_users_outside_the_kernel():
    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            return F.relu(y), y * 2

    model, x = TwoUsers(), torch.randn(1, 4, 6, 6)
    lowered, record = _lower(model, x)
    assert (record.stats["lowered"], record.stats["fused_ops"]) == (1, 0)
    _same(model, lowered, x)


_MKL_LINEAR = torch.ops.mkl._mkl_linear.default


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linears_on_3d_inputs(approximate, onednn_linears):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate=approximate), nn.Linear(16, 4))
    x = torch.randn(2, 5, 8)
    lowered, record = _lower(model, x)
    # The first linear takes the GELU.
    assert (record.stats["lowered"], record.stats["fused_ops"]) == (2, 1)
    assert _targets(lowered) == [_LINEAR, _LINEAR]
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(3, 7, 8))  # packed for 10 rows; 21 still right


def test_a_linear_without_bias():
    model, x = nn.Sequential(nn.Linear(8, 4, bias=False)), torch.randn(6, 8)
    lowered, record = _lower(model, x)
    assert record.stats["lowered"] == 1
    _same(model, lowered, x)


@pytest.mark.parametrize(
    "model, x, reason",
    [
        (nn.Conv1d(4, 4, 3), torch.randn(1, 4, 9), "Conv1d is not lowered"),
        (nn.Conv2d(4, 4, 3, padding_mode="reflect", padding=1), None, "reflect"),
        (nn.Conv2d(4, 4, 3, padding="same"), None, "padding 'same'"),
        (nn.ConvTranspose2d(4, 4, 3), None, "transposed convolution is not lowered"),
        (nn.Conv2d(4, 4, 3).double(), torch.randn(1, 4, 6, 6).double(), "torch.float64"),
    ],
    ids=["conv1d", "reflect", "same", "transpose", "float64"],
)
def test_what_is_not_lowered_says_why(model, x, reason):
    x = torch.randn(1, 4, 6, 6) if x is None else x
    model = nn.Sequential(model)  # the conv as a leaf module call, as in real models
    lowered, record = _lower(model, x)
    assert not record.changed
    assert any(reason in s.reason for s in record.skipped), record.skipped
    _same(model, lowered, x)


def test_a_hooked_conv_is_left_alone():
    model = ConvAct(nn.ReLU())
    model.conv.register_forward_hook(lambda module, args, out: out * 2)
    x = torch.randn(1, 4, 6, 6)
    gm = trace(model.eval(), (x,))
    plan = FuseKernels(fast_math=True).analyze(gm)
    assert not plan.sites and any("forward hooks" in s.reason for s in plan.skipped)


def test_second_run_changes_nothing_and_says_so():
    model, x = Residual(), torch.randn(1, 4, 8, 8)
    lowered, _ = _lower(model, x)
    again = PassManager([FuseKernels(fast_math=True)]).run(lowered)
    assert not again.changed


def test_a_graph_without_convs_or_linears_is_unchanged():
    model, x = nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(3, 3)
    _, record = _lower(model, x)
    assert not record.changed and record.stats == {"lowered": 0}


def test_other_batch_sizes_still_compute_the_same():
    # The weight is packed for the example's shape; other shapes must still be right.
    model, x = Residual(), torch.randn(1, 4, 8, 8)
    lowered, _ = _lower(model, x)
    _same(model, lowered, torch.randn(5, 4, 8, 8))
    _same(model, lowered, torch.randn(2, 4, 12, 7))


def test_packed_modules_copy_and_pickle():
    model, x = ConvAct(nn.ReLU()), torch.randn(1, 4, 6, 6)
    lowered, _ = _lower(model, x)
    _same(model, copy.deepcopy(lowered), x)
    packed = next(m for m in lowered.modules() if isinstance(m, PackedWeight))
    assert "packed" not in packed.state_dict()  # checkpoints hold the dense weight
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert restored.packed.is_mkldnn
    torch.testing.assert_close(restored.dense, packed.dense)


def test_the_original_weights_are_dropped():
    model, x = ConvAct(nn.ReLU()), torch.randn(1, 4, 6, 6)
    lowered, _ = _lower(model, x)
    assert not any(isinstance(m, nn.Conv2d) for m in lowered.modules())


def test_golden_graph():
    model, x = ConvAct(nn.ReLU()), torch.randn(1, 4, 6, 6)
    lowered, _ = _lower(model, x)
    code = [line.strip() for line in lowered.code.strip().splitlines()[1:]]
    assert code == [
        "_fxopt_onednn_0_packed = self._fxopt_onednn_0.packed",
        "_fxopt_onednn_0_bias = self._fxopt_onednn_0.bias",
        "_convolution_pointwise_default = torch.ops.mkldnn._convolution_pointwise.default("
        "x, _fxopt_onednn_0_packed, _fxopt_onednn_0_bias, [0, 0], [1, 1], [1, 1], 1, "
        "'relu', [], '');  x = _fxopt_onednn_0_packed = _fxopt_onednn_0_bias = None",
        "return _convolution_pointwise_default",
    ]


# -- the kernel library and the tiler ---------------------------------------------------------


def test_every_pattern_of_the_cpu_library_has_a_kernel_and_says_which():
    from fxopt.passes.cpu_kernels import KERNELS
    from fxopt.tiling import load_library

    library = load_library("cpu")
    assert {p.name for p in library} == set(KERNELS)
    for pattern in library:
        # The op the rewrite emits is the one the library names (MKL's linear only where
        # this build has MKL).
        emitted = str(KERNELS[pattern.name])
        assert pattern.kernel in emitted or not torch._C.has_mkl, (pattern.name, emitted)


# -- attention → scaled_dot_product_attention --------------------------------------------------

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """BERT's self-attention: q/k/v projections, scaled scores + additive mask, softmax,
    dropout (identity in eval), weighted sum, output projection with a residual."""

    def __init__(self, hidden: int = 16, heads: int = 2, masked: bool = True, p: float = 0.1):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(p)
        self.masked = masked

    def _split(self, x):
        return x.view(x.size(0), x.size(1), self.heads, self.dim).transpose(1, 2)

    def forward(self, x, mask_bias):
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.dim)
        if self.masked:
            scores = scores + mask_bias
        probs = self.drop(torch.softmax(scores, dim=-1))
        context = torch.matmul(probs, v).transpose(1, 2).reshape(x.shape)
        return x + self.out(context)


def _attention_inputs(batch: int, tokens: int, hidden: int = 16):
    keep = (torch.rand(batch, tokens) > 0.3).float()
    return torch.randn(batch, tokens, hidden), ((1.0 - keep) * -1e9)[:, None, None, :]


@pytest.mark.parametrize("masked", [True, False])
def test_attention_becomes_one_sdpa_call_and_the_output_projection_takes_the_residual(
    masked, onednn_linears
):
    model = Attention(masked=masked).eval()
    x, mask = _attention_inputs(2, 5)
    gm = trace(model, (x, mask), mode="fx")
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    record, lowered = result.records[0], result.module
    assert "attention: 1" in record.stats["kernels"]
    assert "linear_add: 1" in record.stats["kernels"]
    assert _targets(lowered).count(_SDPA) == 1
    assert _sdpa_takes_a_mask(lowered) is masked  # the variant without the optional add
    # The eval dropout between softmax and matmul went with the tile.
    assert not any(n.op == "call_module" and "drop" in str(n.target) for n in lowered.graph.nodes)
    _same(model, lowered, x, mask, atol=1e-5)
    _same(model, lowered, *_attention_inputs(3, 9), atol=1e-5)  # another batch and length


def test_attention_with_dropout_in_training_mode_is_not_fused():
    model = Attention().eval()
    model.drop.train()  # a random op between softmax and the matmul: not the kernel's
    x, mask = _attention_inputs(2, 5)
    gm = trace(model, (x, mask), mode="fx")
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert _SDPA not in _targets(result.module)
    assert "attention" not in result.records[0].stats.get("kernels", "")


class OddAttention(nn.Module):
    """Near misses of the attention pattern, each of which must stay as it is."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, mask):
        if self.kind == "tensor scale":
            scores = torch.matmul(q, k.transpose(-1, -2)) / mask.abs().sum().clamp(min=1)
        elif self.kind == "wrong transpose":
            scores = torch.matmul(q, k.transpose(1, 3)) / 2.0
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)) / 2.0
        dim = 2 if self.kind == "softmax over queries" else -1
        return torch.matmul(torch.softmax(scores + mask, dim=dim), v)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("tensor scale", "does not divide by a positive number"),
        ("softmax over queries", "not a softmax over the last dim"),
    ],
)
def test_attention_near_misses_stay_and_say_why(kind, reason):
    model = OddAttention(kind)
    q = k = v = torch.randn(2, 2, 4, 4)
    mask = torch.randn(2, 1, 1, 4)
    gm = trace(model, (q, k, v, mask), mode="fx")
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert _SDPA not in _targets(result.module)
    assert any(reason in s.reason for s in result.records[0].skipped), result.records[0].skipped
    _same(model, result.module, q, k, v, mask)


def test_a_transpose_of_other_dims_is_not_the_key_transpose():
    model = OddAttention("wrong transpose")
    q, k, v = torch.randn(2, 2, 4, 4), torch.randn(2, 4, 4, 2), torch.randn(2, 2, 4, 4)
    mask = torch.randn(2, 1, 1, 4)
    gm = trace(model, (q, k, v, mask), mode="fx")
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert _SDPA not in _targets(result.module)
    _same(model, result.module, q, k, v, mask)


# -- linear + residual, and core ATen's addmm ---------------------------------------------------


class LinearResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.fc(x)


@pytest.mark.parametrize("shape", [(12, 8), (2, 6, 8)])
def test_linear_with_a_residual_add_is_one_kernel(shape, onednn_linears):
    model, x = LinearResidual().eval(), torch.randn(*shape)
    lowered, record = _lower(model, x)
    assert _targets(lowered) == [torch.ops.mkldnn._linear_pointwise.binary]
    assert (record.stats["lowered"], record.stats["fused_ops"]) == (1, 1)
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(5, *shape[1:]))


@pytest.mark.skipif(not cpu_kernels._USE_MKL_LINEAR, reason="this PyTorch build has no MKL")
@pytest.mark.parametrize("shape", [(1, 8), (2, 4, 8), (64, 8)])
def test_with_mkl_a_linear_keeps_its_post_ops_apart(shape):
    # MKL's packed GEMM with the add (or activation) after it beats oneDNN's fused linear
    # at a decode step's few rows and a prefill's many, so the post-op stays eager's op.
    model, x = LinearResidual().eval(), torch.randn(*shape)
    lowered, record = _lower(model, x)
    assert _targets(lowered) == [torch.ops.mkl._mkl_linear.default, operator.add]
    assert record.stats["fused_ops"] == 0
    assert any("MKL's packed GEMM with the post-op" in s.reason for s in record.skipped)
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(3, *shape[1:]))

    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU()).eval()
    lowered, record = _lower(model, x)
    assert _targets(lowered) == [torch.ops.mkl._mkl_linear.default]
    assert nn.SiLU in {type(m) for m in lowered.children()}  # eager's, after the kernel
    _same(model, lowered, torch.randn(5, *shape[1:]))


def test_a_broadcasting_residual_of_a_linear_is_not_fused():
    class Broadcast(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, row):
            return self.fc(x) + row

    model, x, row = Broadcast().eval(), torch.randn(4, 8), torch.randn(8)
    gm = trace(model, (x, row))
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert "linear_add" not in result.records[0].stats["kernels"]
    assert any("broadcasts" in s.reason for s in result.records[0].skipped)
    _same(model, result.module, x, row)


def test_core_aten_addmm_runs_as_a_packed_linear(onednn_linears):
    from fxopt.passes import pipelines

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).eval()
    x = torch.randn(5, 8)
    gm = pipelines.get("speed").run(trace(model, (x,), mode="export", dynamic="batch")).module
    assert any("addmm" in str(n.target) for n in gm.graph.nodes)  # Wᵀ folded to a constant
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert result.records[0].stats["kernels"] == "addmm: 1, addmm_tanh: 1"
    assert not any("addmm" in str(t) for t in _targets(result.module))
    _same(model, result.module, x)
    _same(model, result.module, torch.randn(11, 8))


@pytest.mark.parametrize("mkl", [True, False])
def test_core_aten_mm_of_a_linear_without_bias_runs_as_a_packed_linear(mkl, monkeypatch):
    # Llama's projections have no bias: core ATen spells them mm(x, Wᵀ), not addmm.
    from fxopt.passes import pipelines

    if not mkl:
        monkeypatch.setattr(cpu_kernels, "_USE_MKL_LINEAR", False)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 4, bias=False))
    model.eval()
    x = torch.randn(5, 8)
    gm = pipelines.get("speed").run(trace(model, (x,), mode="export", dynamic="batch")).module
    assert sum("aten.mm" in str(n.target) for n in gm.graph.nodes) == 2
    result = PassManager([FuseKernels()]).run(gm)
    assert result.records[0].stats["kernels"] == "mm: 2"
    assert not any("aten.mm" in str(t) for t in _targets(result.module))
    _same(model, result.module, x)
    _same(model, result.module, torch.randn(11, 8))


def test_a_shared_linear_called_twice_packs_each_call_and_stays_right():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    model, x = Shared().eval(), torch.randn(3, 8)
    lowered, record = _lower(model, x)
    assert record.stats["lowered"] == 2
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(7, 8))


def test_an_in_place_residual_add_is_left_outside_the_kernel():
    # (``out += x`` traces as a fresh add under fx and is functionalized by export: both
    # fuse, rightly. An explicit in-place method call stays.)
    class InPlaceResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            out = self.conv(x)
            out.add_(x)
            return torch.relu(out)

    model, x = InPlaceResidual().eval(), torch.randn(1, 4, 6, 6)
    lowered, record = _lower(model, x)
    # The add_ writes the conv's output, which relu then reads: the conv's value has a
    # reader outside any conv_add tile, so only the conv runs on its kernel.
    assert _targets(lowered)[0] == _CONV and _CONV_BINARY not in _targets(lowered)
    assert record.stats["kernels"] == "conv: 1"
    _same(model, lowered, x)
    _same(model, lowered, torch.randn(3, 4, 6, 6))


def test_the_cli_explains_the_kernels_chosen_and_left_out(tmp_path):
    from fxopt.cli import main

    out = tmp_path / "out.txt"
    import contextlib

    with open(out, "w") as handle, contextlib.redirect_stdout(handle):
        code = main(["optimize", "zoo:resnet18?image=32", "--explain", "--runs", "1"])
    text = out.read_text()
    assert code == 0
    if "onednn" in text:  # when a fused candidate won the timing
        assert "fused kernels chosen by the tiler: " in text
        assert "conv_add_relu" in text and "not chosen: overlaps the chosen" in text
    else:
        assert "layout" in text


def test_a_write_between_the_tiles_nodes_keeps_them_apart():
    class WriteBetween(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x, skip):
            out = self.conv(x)
            x.mul_(2)  # the conv read x before this; a kernel at the add would read it after
            return out + skip

    model, x, skip = WriteBetween().eval(), torch.randn(1, 4, 6, 6), torch.randn(1, 4, 6, 6)
    gm = trace(model, (x.clone(), skip), mode="fx")
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert _CONV_BINARY not in _targets(result.module)
    assert any("x is written in place between" in s.reason for s in result.records[0].skipped)
    with torch.no_grad():
        expected = model(x.clone(), skip)
        actual = result.module(x.clone(), skip)
    torch.testing.assert_close(actual, expected)


class FeedForward(nn.Module):
    """A transformer's feed-forward block on (batch, tokens, hidden): at the ATen level
    each linear is view → addmm → view."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def test_core_aten_3d_linears_fuse_through_the_view_back(onednn_linears):
    from fxopt.passes import pipelines

    model, x = FeedForward().eval(), torch.randn(2, 5, 8)
    gm = pipelines.get("speed").run(trace(model, (x,), mode="export", dynamic="batch")).module
    result = PassManager([FuseKernels(fast_math=True)]).run(gm)
    assert result.records[0].stats["kernels"] == "addmm_view_add: 1, addmm_view_gelu: 1"
    assert _targets(result.module).count(torch.ops.mkldnn._linear_pointwise.binary) == 1
    _same(model, result.module, x)
    _same(model, result.module, torch.randn(7, 5, 8))  # another batch: the views follow it


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("cleaned", [True, False], ids=["after remove-nops", "raw export"])
def test_aten_attention_becomes_one_sdpa_call_after_bmm_to_matmul(masked, cleaned):
    from fxopt.passes import resolve
    from fxopt.passes.bmm_to_matmul import BmmToMatmul

    model = Attention(masked=masked).eval()
    x, mask = _attention_inputs(2, 5)
    gm = trace(model, (x, mask), mode="export", dynamic="batch")
    # Raw, eval dropout is a clone of the probabilities; remove-nops (speed preset) drops it.
    first = [resolve("remove-nops")] if cleaned else []
    result = PassManager([*first, BmmToMatmul(), FuseKernels(fast_math=True)]).run(gm)
    lowered, record = result.module, result.records[-1]
    assert "attention: 1" in record.stats["kernels"], record.stats
    assert _targets(lowered).count(_SDPA) == 1
    assert _sdpa_takes_a_mask(lowered) is masked
    _same(model, lowered, x, mask, atol=1e-5)
    _same(model, lowered, *_attention_inputs(3, 5), atol=1e-5)  # another batch


def test_aten_attention_with_a_permute_of_other_dims_is_not_fused():
    from fxopt.passes.bmm_to_matmul import BmmToMatmul

    model = OddAttention("wrong transpose")  # k.transpose(1, 3): a permute at the ATen level
    q, k, v = torch.randn(2, 2, 4, 4), torch.randn(2, 4, 4, 2), torch.randn(2, 2, 4, 4)
    mask = torch.randn(2, 1, 1, 4)
    gm = trace(model, (q, k, v, mask), mode="export")
    result = PassManager([BmmToMatmul(), FuseKernels(fast_math=True)]).run(gm)
    assert _SDPA not in _targets(result.module)
    reasons = [s.reason for s in result.records[-1].skipped]
    assert any("does not swap the last two dims" in r for r in reasons), reasons
    _same(model, result.module, q, k, v, mask)


def test_unused_submodules_are_deleted_as_torch_deletes_them():
    from torch import fx, nn

    from fxopt.passes.fuse_kernels import delete_unused_submodules

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Sequential(nn.Linear(4, 4), nn.ReLU())  # called: children kept
            self.parent = nn.Module()
            self.parent.weight_holder = nn.Linear(4, 4)  # only its weight is read
            self.parent.spare = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x) + self.parent.weight_holder.weight.sum()

    ours = fx.symbolic_trace(Net())
    theirs = copy.deepcopy(ours)
    delete_unused_submodules(ours)
    theirs.delete_all_unused_submodules()
    names = [name for name, _ in ours.named_modules()]
    assert names == [name for name, _ in theirs.named_modules()]
    assert "unused" not in names and "parent.spare" not in names and "used.0" in names
    x = torch.randn(3, 4)
    assert torch.equal(ours(x), theirs(x))
