"""Models of the shapes TICO's module tests have, which the converter once refused or
wrote wrong: list arguments, writes into inputs and buffers that the model returns, graph
outputs onert overwrote. convert validates each file in onert on the example and on a
second input with other values; the tests add a third set where the module allows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fxopt import circle
from fxopt.circle.converter import example_outputs
from fxopt.circle.runtime import Session, onert_available
from fxopt.errors import UserInputError

pytestmark = pytest.mark.skipif(not onert_available(), reason="onert is not installed")


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _validated_on(converted, model, inputs) -> None:
    result = circle.validate(converted, inputs, example_outputs(model, list(inputs)))
    assert result.validated, result.message


class CatOfList(nn.Module):
    def forward(self, tensors):
        return torch.cat(tensors, dim=1) * 2


def test_a_list_argument_is_flattened_into_the_file_inputs():
    model = CatOfList().eval()
    example = ([_x(2, 3), _x(2, 5, seed=1), _x(2, 1, seed=2)],)
    converted = circle.convert(model, example)
    assert len(converted.input_names) == 3 and converted.validation.validated
    _validated_on(converted, model, ([_x(2, 3, seed=7), _x(2, 5, seed=8), _x(2, 1, seed=9)],))


class CopyInto(nn.Module):
    def forward(self, dst, src):
        dst.copy_(src)
        return dst


def test_a_written_input_that_is_returned_is_an_output_and_reported():
    model = CopyInto().eval()
    dst, src = torch.zeros(2, 3, 4), _x(3, 1, seed=1)  # src broadcasts over dst
    converted = circle.convert(model, (dst, src))
    assert converted.report["state_writes"] == ["input:dst"]
    assert converted.validation.validated
    assert torch.equal(dst, torch.zeros(2, 3, 4))  # the caller's tensor is left alone
    _validated_on(converted, model, (_x(2, 3, 4, seed=2), _x(3, 1, seed=3)))


class WriteNotReturned(nn.Module):
    def forward(self, cache, x):
        cache[:, :2] = x
        return cache.sum(1)


def test_a_written_input_that_is_not_returned_is_refused_by_name():
    with pytest.raises(UserInputError, match=r"input .cache.* does not return it"):
        circle.convert(WriteNotReturned().eval(), (torch.zeros(2, 5), _x(2, 2)))


class CacheUpdate(nn.Module):
    """A static KV cache written at a position, then returned whole and up to it (TICO's
    ``net.KVCache.KVCacheUpdate``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", _x(3, 2, 16, 4, seed=5))

    def forward(self, new, position: int):
        self.cache[:2, :, position : position + 4] = new
        return self.cache[:2, :, : position + 4], self.cache


def test_a_cache_write_returned_with_a_slice_of_it_validates():
    model = CacheUpdate().eval()
    before = model.cache.clone()
    converted = circle.convert(model, (_x(2, 2, 4, 4, seed=1), 6))
    assert converted.report["state_writes"] == ["cache"]
    assert converted.validation.validated
    assert torch.equal(model.cache, before)
    _validated_on(converted, model, (_x(2, 2, 4, 4, seed=4), 6))


class CatThenSlice(nn.Module):
    def forward(self, x, z):
        y = torch.cat([x, z])
        return y[:4, :, :24], y


def test_a_concatenation_output_also_sliced_is_produced_again_for_onert():
    """onert 0.1.0 returned ``y`` off by ~6 in its first rows when a SLICE also read it."""
    model = CatThenSlice().eval()
    converted = circle.convert(model, (_x(4, 8, 32, 2), _x(5, 8, 32, 2, seed=1)))
    assert converted.op_counts["RESHAPE"] == 1 and converted.validation.validated
    with Session(converted.bytes) as session:
        first, whole = session.run([_x(4, 8, 32, 2, seed=2), _x(5, 8, 32, 2, seed=3)])
    expected = torch.cat([_x(4, 8, 32, 2, seed=2), _x(5, 8, 32, 2, seed=3)]).numpy()
    np.testing.assert_array_equal(whole, expected)
    np.testing.assert_array_equal(first, expected[:4, :, :24])


class FedConv(nn.Module):
    """A convolution whose weight and bias are inputs (or computed from them)."""

    def __init__(self, conv, **options):
        super().__init__()
        self.conv, self.options = conv, options

    def forward(self, x, weight, bias):
        return self.conv(x, weight * 1.5, bias, **self.options)


F = torch.nn.functional
# name → (module, shapes of x, weight, bias)
FED_CONVS = {
    "conv2d": (FedConv(F.conv2d, padding=1), (2, 4, 7, 9), (5, 4, 3, 3), (5,)),
    "grouped2d": (FedConv(F.conv2d, groups=2, stride=2), (2, 6, 8, 8), (4, 3, 3, 3), (4,)),
    "depthwise": (FedConv(F.conv2d, groups=4, padding="same"), (1, 4, 6, 6), (8, 1, 3, 3), (8,)),
    "conv3d": (FedConv(F.conv3d), (1, 3, 4, 6, 6), (5, 3, 2, 3, 3), (5,)),
    "grouped3d": (FedConv(F.conv3d, groups=2, padding=1), (1, 4, 4, 5, 5), (6, 2, 3, 3, 3), (6,)),
}


@pytest.mark.parametrize("name", sorted(FED_CONVS))
def test_a_convolution_with_a_computed_weight_and_bias_validates(name):
    module, *shapes = FED_CONVS[name]
    model = module.eval()
    converted = circle.convert(model, tuple(_x(*s, seed=i) for i, s in enumerate(shapes)))
    assert converted.validation.validated, converted.validation.message
    _validated_on(converted, model, tuple(_x(*s, seed=10 + i) for i, s in enumerate(shapes)))


class InstanceNormFedAffine(nn.Module):
    def forward(self, x, weight, bias):
        return F.instance_norm(x, weight=weight, bias=bias)


def test_instance_norm_with_a_computed_affine_validates():
    model = InstanceNormFedAffine().eval()
    converted = circle.convert(model, (_x(3, 4, 5, 5), _x(4, seed=1), _x(4, seed=2)))
    assert converted.validation.validated
    _validated_on(converted, model, (_x(3, 4, 5, 5, seed=3), _x(4, seed=4), _x(4, seed=5)))


class EmbedWithSize(nn.Module):
    """A patch embedding that returns its grid size too (TICO's ``net.ConvEmbed``)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 3, stride=2, padding=1)

    def forward(self, x):
        x = self.proj(x)
        _, _, h, w = x.shape
        return x.permute(0, 2, 3, 1), (h, w), 0.5, None


def test_non_tensor_outputs_are_constant_outputs_of_the_file():
    model = EmbedWithSize().eval()
    converted = circle.convert(model, (_x(1, 3, 12, 10),))
    assert converted.output_names == ["output_0", "output_1", "output_2", "output_3"]
    assert converted.report["constant_outputs"] == {1: "6", 2: "5", 3: "0.5", 4: "None"}
    with Session(converted.bytes) as session:
        _, h, w, half = session.run([_x(1, 3, 12, 10, seed=1)])
    assert (h.shape, h.dtype, int(h), int(w)) == ((), np.int64, 6, 5)
    assert (half.dtype, float(half)) == (np.float32, 0.5)
    _validated_on(converted, model, (_x(1, 3, 12, 10, seed=2),))


def test_tensor_outputs_only_refuses_naming_the_non_tensor_outputs():
    config = circle.CircleConfig(tensor_outputs_only=True)
    with pytest.raises(circle.UnsupportedOpsError, match=r"output 1 = 6, output 2 = 5"):
        circle.convert(EmbedWithSize().eval(), (_x(1, 3, 12, 10),), config=config)


class BatchSize(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0]


def test_the_size_of_a_dynamic_dim_is_computed_in_the_file():
    model = BatchSize().eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    converted = circle.convert(model, (_x(3, 4),), dynamic_shapes={"x": {0: batch}})
    assert {"SHAPE", "GATHER"} <= set(converted.op_counts)
    with Session(converted.bytes) as session:
        _, size = session.run([_x(7, 4, seed=1)])
    assert size.dtype == np.int64 and int(size) == 7
    _validated_on(converted, model, (_x(5, 4, seed=2),))


class AddmmZeroBeta(nn.Module):
    def forward(self, bias, a, b):
        return torch.addmm(bias, a, b, beta=0, alpha=2.0)


def test_addmm_with_beta_zero_ignores_nan_in_the_bias_as_torch_does():
    model = AddmmZeroBeta().eval()
    bias = torch.tensor([1.0, float("nan"), float("inf")])
    converted = circle.convert(model, (bias, _x(2, 4), _x(4, 3, seed=1)))
    assert converted.validation.validated and converted.validation.max_abs_error < 1e-4
    _validated_on(converted, model, (torch.full((3,), float("nan")), _x(2, 4, seed=2), _x(4, 3)))


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(6, 12), nn.Linear(6, 12), nn.Linear(12, 6)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RepeatRows(nn.Module):
    def forward(self, x):
        return x.repeat(3, 1, 2)


DYNAMIC = {  # name → (module, example, dynamic dim of input 0, other size)
    "gated_mlp_batch": (GatedMLP(), (2, 5, 6), 0, 7),
    "repeat_dynamic_width": (RepeatRows(), (1, 4), 1, 9),
}


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_a_dynamic_dim_validates_at_another_size(name):
    """A FULLY_CONNECTED's 2-D result and the binary op after it: a dynamic batch is 1 in
    ``shape``, so a pass that took those 1s for leading 1s wrote a file onert refused."""
    module, shape, dim, other = DYNAMIC[name]
    model = module.eval()
    dynamic = {"x": {dim: torch.export.Dim("d", min=1, max=64)}}
    converted = circle.convert(model, (_x(*shape),), dynamic_shapes=dynamic)
    assert converted.validation.validated, converted.validation.message
    resized = list(shape)
    resized[dim] = other
    _validated_on(converted, model, (_x(*resized, seed=3),))


class Restrided(nn.Module):
    """``as_strided`` as timm's pooling leaves it (a channels-last re-stride of a pooled
    value: the same order), and as a selection (overlapping windows: another order)."""

    def forward(self, x):
        pooled = x.mean((-1, -2), keepdim=True)  # [n, c, 1, 1]
        n, c = pooled.shape[:2]
        same = pooled.as_strided((n, c, 1, 1), (c, 1, c, c)).flatten(1)
        flat = (x * 2).flatten()
        windows = flat.as_strided((5, 3), (2, 1), 1)
        return same, windows


def test_as_strided_is_a_reshape_or_a_gather_of_its_offsets():
    model = Restrided().eval()
    converted = circle.convert(model, (_x(2, 4, 3, 3),))
    assert "GATHER" in converted.op_counts and converted.validation.validated
    _validated_on(converted, model, (_x(2, 4, 3, 3, seed=5),))


class Cancelling(nn.Module):
    """``(x A) B - x (A B)``: zero in exact arithmetic, float32 rounding of ~1e-3 here, in
    eager as in any file (the fixed 1e-4 refuses eager float32 itself)."""

    def __init__(self):
        super().__init__()
        a, b = _x(48, 48, seed=1) * 8, _x(48, 48, seed=2) * 8
        self.register_buffer("a", a)
        self.register_buffer("b", b)
        self.register_buffer("ab", a @ b)

    def forward(self, x):
        return (x @ self.a) @ self.b - x @ self.ab


def test_a_file_past_the_fixed_tolerance_is_judged_against_float64():
    model = Cancelling().eval()
    x = _x(4, 48, seed=3)
    with torch.no_grad():
        eager = model(x)
        exact = model.double()(x.double())
        model.float()
    assert float((eager.double() - exact).abs().max()) > 1e-3  # eager misses 1e-4 itself
    converted = circle.convert(model, (x,))
    assert converted.validation.validated
    assert "within float32's own rounding" in converted.validation.message


class QuotientAndRemainder(nn.Module):
    def forward(self, x, y):
        return x / y, torch.remainder(x, y)


def test_an_output_read_by_later_operators_is_kept_alive_for_onert():
    """onert 0.1.0 gave ``x / y``'s buffer to a later operator once FLOOR had read it:
    the first file fails validation, the second re-produces the output at the end."""
    model = QuotientAndRemainder().eval()
    x, y = _x(3, 4) * 5, torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    converted = circle.convert(model, (x, y))
    assert converted.validation.validated
    assert any("copy_read_outputs" in note for note in converted.report["notes"])
    _validated_on(converted, model, (_x(3, 4, seed=2) * 5, y + 1))
    from_program = circle.convert_from_exported_program(torch.export.export(model, (x, y)))
    assert from_program.validation.validated and from_program.operators == converted.operators


class FloorDivide(nn.Module):
    def forward(self, x, y):
        return x // y


def test_integer_floor_division_is_floor_div_on_int32_and_refused_on_int64():
    model = FloorDivide().eval()
    x, y = torch.tensor([[-7, 7, -8], [9, 0, -1]]), torch.tensor([[2, 2, 3], [-4, 3, 5]])
    converted = circle.convert(model, (x.int(), y.int()))
    assert converted.op_counts == {"FLOOR_DIV": 1} and converted.validation.validated
    _validated_on(converted, model, ((x * 7 - 3).int(), (y - 7).int()))
    with pytest.raises(circle.UnsupportedOpsError, match="floor division of int64"):
        circle.convert(model, (x, y))
