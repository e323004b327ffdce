"""lower-onednn: conv2d / linear (+ activation, + residual add) on oneDNN's fused kernels."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.capture import trace
from fxopt.passes import PassManager
from fxopt.passes.lower_onednn import LowerOneDnn, PackedWeight

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this PyTorch build has no oneDNN"
)

_CONV = torch.ops.mkldnn._convolution_pointwise.default
_CONV_BINARY = torch.ops.mkldnn._convolution_pointwise.binary
_LINEAR = torch.ops.mkldnn._linear_pointwise.default


def _lower(model: nn.Module, x: torch.Tensor, mode: str = "fx", dynamic=None):
    gm = trace(model.eval(), (x,), mode=mode, dynamic=dynamic)
    result = PassManager([LowerOneDnn()]).run(gm)
    return result.module, result.records[0]


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


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
    assert record.changed and record.stats == {"lowered": 1, "fused_post_ops": int(whole)}
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
    assert record.stats == {"lowered": 2, "fused_post_ops": 1}
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
    assert record.stats == {"lowered": 1, "fused_post_ops": 0}
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
    assert record.stats == {"lowered": 1, "fused_post_ops": 0}
    _same(model, lowered, x)


_MKL_LINEAR = torch.ops.mkl._mkl_linear.default


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_linears_on_3d_inputs(approximate):
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate=approximate), nn.Linear(16, 4))
    x = torch.randn(2, 5, 8)
    lowered, record = _lower(model, x)
    if torch._C.has_mkl:  # MKL's packed GEMM: the activation stays a separate op
        assert record.stats == {"lowered": 2, "fused_post_ops": 0}
        assert _targets(lowered) == [_MKL_LINEAR, _MKL_LINEAR]
    else:  # oneDNN's linear, with the activation fused in
        assert record.stats == {"lowered": 2, "fused_post_ops": 1}
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
    plan = LowerOneDnn().analyze(gm)
    assert not plan.sites and "forward hooks" in plan.skipped[0].reason


def test_second_run_changes_nothing_and_says_so():
    model, x = Residual(), torch.randn(1, 4, 8, 8)
    lowered, _ = _lower(model, x)
    again = PassManager([LowerOneDnn()]).run(lowered)
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
