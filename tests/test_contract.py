"""Issue 13: an optimized module is right for every input it accepts, and refuses the rest.

One test per kind of defect found by calling optimized modules on a second input (the table
of the issue); each fails on the code before the input contract existed.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch import nn

import fxopt
from fxopt.errors import InputMismatchError
from fxopt.ir import contract as contracts

MODES = ["fx", "export"]
PRESETS = ["speed", "cleanup", "none"]


def optimized(model, example, *, mode="fx", preset="speed", **kwargs):
    return fxopt.optimize(
        model, example, mode=mode, preset=preset, benchmark_runs=0, autotune=False, **kwargs
    )


def eager_or_refused(model: nn.Module, module: nn.Module, *inputs) -> str:
    """'same' when the module computes eager's answer, 'refused' when it raises
    InputMismatchError; anything else fails the test."""
    expected = model(*inputs)
    try:
        actual = module(*inputs)
    except InputMismatchError:
        return "refused"
    torch.testing.assert_close(actual, expected, equal_nan=True)
    return "same"


# -- a shape fact of the example is not a rule ------------------------------------------------


class FlattenThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x.reshape(-1, 8))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_reshape_kept_for_other_ranks_or_refused(mode, preset):
    model = FlattenThenLinear().eval()
    result = optimized(model, torch.randn(4, 8), mode=mode, preset=preset)
    # Another batch: the contract lets dim 0 vary, and the answer is eager's.
    assert eager_or_refused(model, result.module, torch.randn(7, 8)) == "same"
    # Another rank: the graph was proved for rank 2 only.
    with pytest.raises(InputMismatchError, match=r"\[2, 5, 8\]"):
        result.module(torch.randn(2, 5, 8))


def test_static_contract_refuses_another_batch_with_a_hint():
    model = FlattenThenLinear().eval()
    result = optimized(model, torch.randn(4, 8), dynamic=None)
    with pytest.raises(InputMismatchError, match="dynamic"):
        result.module(torch.randn(3, 8))
    assert torch.allclose(result.module(torch.randn(4, 8) * 0), model(torch.zeros(4, 8)))


# -- a dtype fact of the example is not a rule ------------------------------------------------


class HashIds(nn.Module):
    def forward(self, ids):
        return (ids.long() * 2654435761) % 1000


class SumAsFloat(nn.Module):
    def forward(self, x):
        return x.float().sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_cast_removed_only_for_the_dtype_the_contract_fixes(mode):
    ids = torch.randint(0, 10**9, (4,))
    result = optimized(HashIds(), ids, mode=mode)
    assert eager_or_refused(HashIds(), result.module, torch.randint(0, 10**9, (6,))) == "same"
    with pytest.raises(InputMismatchError, match=r"int32.*int64"):
        result.module(ids.int())
    result = optimized(SumAsFloat(), torch.randn(2, 3), mode=mode)
    with pytest.raises(InputMismatchError, match=r"int64.*float32"):
        result.module(torch.randint(0, 5, (2, 3)))


# -- a stride fact of the example is not a rule -----------------------------------------------


class ConvThenView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x).contiguous()
        return y.view(y.shape[0], -1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", ["speed", "cleanup"])
def test_contiguous_kept_or_layout_pinned(mode, preset):
    model = ConvThenView().eval()
    result = optimized(model, torch.randn(2, 3, 8, 8), mode=mode, preset=preset)
    channels_last = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    outcome = eager_or_refused(model, result.module, channels_last)
    if outcome == "refused":
        assert result.contract.layout_pinned
    assert eager_or_refused(model, result.module, torch.randn(5, 3, 8, 8)) == "same"


class RotaryThenView(nn.Module):
    """A decode step's shape: positions (a slice of a cumulative mask when a user builds
    them) feed a rotary-like term whose sum with x is copied and flattened."""

    def __init__(self):
        super().__init__()
        self.freq = nn.Parameter(torch.randn(8))

    def forward(self, x, positions):
        angles = positions.unsqueeze(-1).float() * self.freq
        y = (x + angles.cos()).contiguous()
        return y.view(y.shape[0], -1)


@pytest.mark.parametrize("mode", MODES)
def test_strided_view_example_accepts_contiguous_inputs(mode):
    # Issue 38: positions sliced from a cumulative tensor (strides (12, 1)) made the export
    # graph valid for those strides only, and a contiguous copy of the example was refused.
    model = RotaryThenView().eval()
    cumulative = torch.arange(24).view(2, 12)
    result = optimized(model, (torch.randn(2, 4, 8), cumulative[:, -4:]), mode=mode)
    assert any("positions is a strided view" in note for note in result.contract.notes)
    other = torch.randint(0, 50, (5, 4))  # other values, another batch, contiguous
    assert eager_or_refused(model, result.module, torch.randn(5, 4, 8), other) == "same"
    contiguous = cumulative[:, -4:].contiguous()
    assert eager_or_refused(model, result.module, torch.randn(2, 4, 8), contiguous) == "same"
    # The strided view itself, as a generation loop builds it each step: passed on as a
    # contiguous copy (the graph relies on that layout), eager's answer; before, refused.
    view = (cumulative + 3)[:, -4:]
    assert eager_or_refused(model, result.module, torch.randn(2, 4, 8), view) == "same"
    assert view.stride() == (12, 1)  # the caller's tensor is not changed


class CopyOfOneInput(nn.Module):
    def forward(self, x, z):
        return x.contiguous().view(-1) * z.sum()


def test_only_the_inputs_a_rewrite_relied_on_are_pinned():
    model = CopyOfOneInput()
    result = optimized(model, (torch.randn(4, 6), torch.randn(3, 5)), preset="cleanup")
    pinned = {
        name: spec.memory_format for name, spec in zip(result.contract.names, result.contract.specs)
    }
    assert pinned == {"x": "contiguous", "z": None}  # remove-nops relied on x's layout only
    transposed = torch.randn(5, 3).t()  # z in another layout: still eager's answer
    assert eager_or_refused(model, result.module, torch.randn(4, 6), transposed) == "same"
    # x in another layout: passed on as a contiguous copy, not refused
    assert eager_or_refused(model, result.module, torch.randn(6, 4).t(), transposed) == "same"


# -- torch.export's guards survive --------------------------------------------------------------


class MeanOverBatch(nn.Module):
    def forward(self, x):
        return x.sum(0) / x.shape[0]


def test_export_guard_kept_with_static_shapes():
    model = MeanOverBatch()
    result = optimized(model, torch.ones(2, 3), mode="export", preset="none", dynamic=None)
    with pytest.raises(InputMismatchError, match="dim 0 is static"):
        result.module(torch.ones(4, 3))


def test_export_with_dynamic_batch_reads_the_batch_at_run_time():
    result = optimized(MeanOverBatch(), torch.ones(2, 3), mode="export", preset="none")
    torch.testing.assert_close(result.module(torch.ones(4, 3)), torch.ones(3))


class BranchOnOne(nn.Module):
    def forward(self, x):
        if x.shape[0] == 1:
            return x * 2
        return x * 3


def test_export_size_one_branch_is_refused_not_miscomputed():
    # torch.export's own module answers x * 3 for batch 1 here (its range check lets 1
    # through); fxopt keeps the guard x.shape[0] != 1.
    result = optimized(BranchOnOne(), torch.ones(4, 3), mode="export", preset="none")
    assert eager_or_refused(BranchOnOne(), result.module, torch.ones(3, 3)) == "same"
    with pytest.raises(InputMismatchError):
        result.module(torch.ones(1, 3))


def test_export_guard_failures_become_input_mismatch_errors():
    class ViewFour(nn.Module):
        def forward(self, x):
            return x.view(4, -1)

    result = optimized(ViewFour(), torch.ones(4, 3), mode="export", preset="none")
    assert eager_or_refused(ViewFour(), result.module, torch.ones(8, 3)) == "same"
    with pytest.raises(InputMismatchError):
        result.module(torch.ones(3, 3))  # 9 elements cannot be viewed as (4, -1)


# -- outputs keep eager's aliasing --------------------------------------------------------------


class TwoRelus(nn.Module):
    def forward(self, x):
        return x.relu(), x.relu()


class CloneReturned(nn.Module):
    def forward(self, x):
        return x.clone(), x * 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("preset", PRESETS)
def test_outputs_that_eager_keeps_apart_stay_apart(mode, preset):
    for model in (TwoRelus(), CloneReturned()):
        result = optimized(model, torch.randn(3), mode=mode, preset=preset)
        x = torch.randn(5)
        a, b = result.module(x)
        assert a.data_ptr() != b.data_ptr()
        assert a.data_ptr() != x.data_ptr() and b.data_ptr() != x.data_ptr()
        a.add_(100)
        torch.testing.assert_close(b, model(x)[1])


# -- a copy that materializes a broadcast stays ------------------------------------------------


class ExpandPlusZero(nn.Module):
    def forward(self, x):
        return (x.expand(3, 4) + 0).view(-1) * 2  # the view needs the copy + 0 makes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 4), (4,)])
def test_copy_of_a_broadcast_is_kept(mode, shape):
    # Before: "+ 0" was removed and view(-1) failed on the expanded tensor (internal error).
    model = ExpandPlusZero()
    result = optimized(model, torch.randn(shape), mode=mode, preset="cleanup")
    assert eager_or_refused(model, result.module, torch.randn(shape)) == "same"


# -- the verifier does not cry wolf --------------------------------------------------------------


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class MaskNegInf(nn.Module):
    def forward(self, x):
        return x.masked_fill(x > 0, float("-inf"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model_type", [Log, MaskNegInf])
def test_nan_and_inf_in_the_same_places_verify(mode, model_type):
    result = optimized(model_type(), torch.randn(6), mode=mode, preset="none")
    assert result.report["verified"]
    assert eager_or_refused(model_type(), result.module, torch.randn(9)) == "same"


# -- blame the stage that broke -------------------------------------------------------------------


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return x * self.count


class SeedsItself(nn.Module):
    def forward(self, x):
        torch.manual_seed(0)
        return nn.functional.dropout(x, 0.5, training=True)


@pytest.mark.parametrize("model_type", [Counter, SeedsItself])
def test_fx_capture_that_differs_is_blamed_and_export_suggested(model_type):
    with pytest.raises(fxopt.CaptureError, match="mode='fx' does not capture") as info:
        optimized(model_type(), torch.randn(4), mode="fx", preset="cleanup")
    assert "mode='export'" in str(info.value)


def test_auto_mode_captures_a_buffer_update_with_export():
    result = optimized(Counter(), torch.randn(4), mode="auto", preset="cleanup")
    assert result.report["mode"] == "export"
    assert result.report["verified"]
    assert any("fx graph does not compute" in note for note in result.report["notes"])


def test_auto_mode_says_when_no_capture_is_faithful():
    with pytest.raises(fxopt.CaptureError, match="neither capture computes what SeedsItself"):
        optimized(SeedsItself(), torch.randn(4), mode="auto", preset="cleanup")


# -- the layout step and training mode ------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


@pytest.mark.parametrize("mode", MODES)
def test_training_model_gets_no_freezing_pass_no_layout_and_keeps_its_state(mode):
    model = ConvBN().train()
    result = fxopt.optimize(model, torch.randn(4, 3, 8, 8), mode=mode, benchmark_runs=0)
    report = result.report
    assert report["training"] and report["layout"] is None and "layout_skipped" in report
    assert {s["name"] for s in report["skipped_passes"]} == {"fold-bn", "fold-constants"}
    assert "gradients of inputs and parameters" in report["checked"]
    module = result.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    for key, value in module.state_dict().items():  # verification ran copies, not it
        assert torch.equal(value, before[key]), key
    x = torch.randn(2, 3, 8, 8)
    module(x).sum().backward()
    assert all(p.grad is not None for p in module.parameters())


def test_explicit_freezing_pass_on_a_training_model_is_an_error():
    with pytest.raises(fxopt.UserInputError, match=r"training mode; call model\.eval"):
        fxopt.optimize(ConvBN().train(), torch.randn(2, 3, 8, 8), passes=["fold-bn"])


def test_eval_model_layout_step_leaves_the_returned_module_unrun():
    from tests.models.stateful import CountsCalls

    model = CountsCalls().eval()
    result = fxopt.optimize(model, torch.randn(1, 3, 8, 8), mode="export", benchmark_runs=0)
    assert result.report["layout"] is not None
    # Wherever the chosen candidate keeps the counter (the graph's own buffer, or the
    # model copy inside the "original" candidate), it has never been incremented.
    counters = [b for name, b in result.module.named_buffers() if name.endswith("calls")]
    assert counters and all(float(c) == 0.0 for c in counters)


# -- the contract itself ------------------------------------------------------------------------


def test_contract_describes_itself_and_names_what_a_call_got_wrong():
    model = nn.Sequential(nn.Linear(8, 3)).eval()
    result = optimized(model, torch.randn(4, 8))
    assert result.contract.describe() == (
        "input: float32[s0 >= 1, 8] on cpu\nin eval mode, autocast off"
    )
    assert result.report["dynamic"] == ["input.shape[0]"]
    with pytest.raises(InputMismatchError, match=r"input 'input' has shape \[4, 9\]"):
        result.module(torch.randn(4, 9))
    with pytest.raises(InputMismatchError, match="takes 1 inputs"):
        contracts.guard_of(result.module).contract.check(())
    with pytest.raises(InputMismatchError, match="is a list"):
        result.module([1, 2])


def test_inputs_sharing_a_dim_must_agree():
    class AddTwo(nn.Module):
        def forward(self, x, y):
            return x + y

    result = optimized(AddTwo(), (torch.randn(4, 3), torch.randn(4, 3)))
    assert eager_or_refused(AddTwo(), result.module, torch.randn(6, 3), torch.randn(6, 3))
    with pytest.raises(InputMismatchError, match="equal"):
        result.module(torch.randn(6, 3), torch.randn(5, 3))


def test_guarded_module_pickles_and_still_checks():
    model = nn.Sequential(nn.Linear(8, 3)).eval()
    for mode in MODES:
        result = optimized(model, torch.randn(4, 8), mode=mode)
        buffer = io.BytesIO()
        torch.save(result.module, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        torch.testing.assert_close(loaded(torch.randn(2, 8) * 0), model(torch.zeros(2, 8)))
        with pytest.raises(InputMismatchError):
            loaded(torch.randn(2, 9))
        assert pickle.loads(pickle.dumps(result.contract)).describe() == (
            result.contract.describe()
        )


def test_guard_is_kept_by_passes_run_on_an_optimized_module():
    from fxopt.passes import PassManager

    model = nn.Sequential(nn.Linear(8, 3), nn.ReLU()).eval()
    result = optimized(model, torch.randn(4, 8))
    again = PassManager(["remove-nops", "cse", "dce"]).run(result.module).module
    with pytest.raises(InputMismatchError):
        again(torch.randn(4, 7))


# -- dynamic_shapes: torch.export's Dim spec, at both capture levels ------------------------


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_shapes_with_named_dims_and_ranges(mode):
    from torch.export import Dim

    class AddTwo(nn.Module):
        def forward(self, x, y):
            return (x + y).relu()

    batch = Dim("batch", min=2, max=16)
    spec = ({0: batch}, {0: batch})  # one name: the two batches are one dim
    example = (torch.randn(4, 3), torch.randn(4, 3))
    result = optimized(AddTwo(), example, mode=mode, dynamic_shapes=spec)
    assert "2 <= s0 <= 16" in result.contract.describe()
    for size in (2, 9, 16):
        inputs = (torch.randn(size, 3), torch.randn(size, 3))
        assert eager_or_refused(AddTwo(), result.module, *inputs) == "same"
    for size in (1, 17):  # outside the declared range
        with pytest.raises(InputMismatchError):
            result.module(torch.randn(size, 3), torch.randn(size, 3))


def test_dynamic_shapes_mistakes_are_named():
    from torch.export import Dim

    model, x = nn.Linear(3, 2).eval(), torch.randn(4, 3)
    with pytest.raises(fxopt.UserInputError, match="has 2 dims, no dim 5"):
        optimized(model, x, dynamic_shapes=({5: Dim.AUTO},))
    with pytest.raises(fxopt.UserInputError, match="outside its dynamic range"):
        optimized(model, x, dynamic_shapes=({0: Dim("b", min=8)},))
    with pytest.raises(fxopt.UserInputError, match="unknown dynamic="):
        optimized(model, x, dynamic="sometimes")


class ReturnsItsInput(nn.Module):
    def forward(self, x):
        return x, x.flatten()


@pytest.mark.parametrize("mode", MODES)
def test_an_input_an_output_may_alias_is_not_copied_into_another_layout(mode):
    # A copy would be returned where eager returns the caller's tensor (and, for a strided
    # input, a flatten of its own that shares nothing): storage shared otherwise.
    model = ReturnsItsInput().eval()
    result = optimized(model, (torch.randn(4, 6),), mode=mode, preset="cleanup")
    transposed = torch.randn(6, 4).t()
    if result.contract.layout_pinned:
        with pytest.raises(InputMismatchError, match="is not contiguous"):
            result.module(transposed)
    else:
        assert eager_or_refused(model, result.module, transposed) == "same"
