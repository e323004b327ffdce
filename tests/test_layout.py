import pytest
import torch
from torch import nn

from fxopt import layout
from fxopt.capture import trace
from fxopt.ir.copying import may_change_state
from fxopt.verify import check_outputs
from tests.models.stateful import CountsCalls


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_channels_last_keeps_values_and_returns_contiguous_outputs(mode):
    model, x = _cnn(), torch.randn(2, 3, 8, 8)
    converted = layout.to_channels_last(trace(model, x, mode))
    weights = [p for p in converted.parameters() if p.dim() == 4]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    out = converted(x)
    assert out.is_contiguous()  # callers may .view() it
    assert check_outputs(model, converted, (x,)).ok


def test_mkldnn_is_refused_for_aten_graphs_with_a_reason():
    model, x = _cnn(), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="module-level"):
        layout.to_mkldnn(trace(model, x, "export"))
    choice = layout.autotune(
        trace(model, x, "export"),
        model,
        (x,),
        budget_s=0.05,
        candidates=layout.CANDIDATES,
        fast_math=True,  # without it mkldnn is not built at all (its ReLU maps NaN to 0)
    )
    assert "mkldnn" in choice.rejected and "module-level" in choice.rejected["mkldnn"]
    exact = layout.autotune(
        trace(model, x, "export"), model, (x,), budget_s=0.05, candidates=layout.CANDIDATES
    )
    assert exact.rejected["mkldnn"].startswith("fast_math only")


def test_graph_without_kernels_is_timed_only_against_the_original():
    model, x = nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(2, 4)
    gm = trace(model, x)
    choice = layout.autotune(gm, model, (x,), budget_s=0.05)
    assert choice.name in ("plain", "original")
    assert {"plain", "original"} <= set(choice.median_ms)
    assert choice.rejected["channels_last"] == "no convolutions"
    assert "nothing to lower" in choice.rejected["onednn"]


def test_a_linear_only_graph_times_only_the_prepacked_candidate():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(2, 4)
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert set(choice.rejected) >= {"channels_last", "onednn_channels_last"}
    assert choice.rejected["onednn_channels_last"] == "no convolutions"
    assert {"plain", "original", "onednn"} <= set(choice.median_ms)


def test_autotune_returns_a_verified_candidate_and_reports_timings():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert {"plain", "original", "onednn", "onednn_channels_last"} <= set(choice.median_ms)
    assert choice.rejected["channels_last"].startswith("not measured")
    assert choice.name in choice.median_ms
    first = choice.median_ms[choice.name] / choice.median_ms["original"]
    if choice.name != "original" and first > 1 - layout.CLEAR_GAIN:  # a small win is re-timed
        assert f"{choice.name} (confirmation)" in choice.median_ms
    assert check_outputs(model, choice.module, (x,)).ok
    report = choice.to_dict()
    assert report["chosen"] == choice.name and report["autotune_s"] > 0


def test_the_model_itself_is_kept_unless_a_candidate_is_clearly_faster():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    # With an impossible required gain, nothing can displace the unmodified model.
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05, min_gain=1.0)
    assert choice.name == "original"
    assert choice.to_dict()["note"].startswith("no candidate was faster than the model")
    assert check_outputs(model, choice.module, (x,)).ok


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return {"y": y, "pair": (y.relu(), y.sum())}


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_the_original_candidate_calls_the_model_with_the_graphs_inputs(mode):
    model, x = _TwoOutputs().eval(), torch.randn(2, 3, 8, 8)
    gm = trace(model, x, mode)
    original = layout.calling_original(gm, model)
    called = [n for n in original.graph.nodes if n.op == "call_module"]
    assert [n.target for n in called] == [layout.ORIGINAL_NAME]
    assert not any(isinstance(m, nn.Conv2d) and m is model.conv for m in original.modules())
    for inputs in ((x,), (torch.randn(5, 3, 10, 9),)):
        assert check_outputs(model, original, inputs, random_sets=0).ok


def test_never_slower_than_the_model_the_original_is_a_candidate():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert "original" in choice.median_ms
    # Whatever wins, it was timed against the unmodified model in the same rounds.
    assert choice.median_ms[choice.name] <= choice.median_ms["original"] or (choice.name == "plain")


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_candidates_that_write_state_are_timed_on_copies_and_others_as_built(mode):
    x = torch.randn(1, 3, 8, 8)
    pure = trace(_cnn(), x, mode)
    assert not may_change_state(pure)
    assert not may_change_state(layout.to_onednn(pure))
    if mode == "export":  # fx capture does not record the buffer update at all
        assert may_change_state(trace(CountsCalls().eval(), x, mode))
    # The model itself may keep any Python state: always copied.
    assert may_change_state(layout.calling_original(pure, _cnn()))


def test_timing_leaves_every_built_candidate_as_it_was():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    gm = trace(model, x)
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    choice = layout.autotune(gm, model, (x,), budget_s=0.05)
    after = choice.module.state_dict() if choice.name == "plain" else gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_original_that_wins_is_handed_back_unrun_and_the_model_is_untouched(monkeypatch):
    # The built `original` runs in its check and in the race (no copy of its model made
    # for either): the module handed back is built again and has never run.
    model, x = CountsCalls().eval(), torch.randn(1, 3, 8, 8)
    gm = trace(model, x, "export")

    def original_fastest(timed, inputs, runs, *rest):
        for module in timed.values():
            module(*inputs)  # the race calls each candidate
        return {name: [1.0 if name == "original" else 2.0] * 3 for name in timed}

    monkeypatch.setattr(layout, "_race", original_fastest)
    choice = layout.autotune(gm, model, (x,), candidates=("original",), budget_s=0.05)
    assert choice.name == "original"
    assert choice.module.get_submodule(layout.ORIGINAL_NAME).calls.item() == 0
    assert model.calls.item() == 0
    assert torch.equal(choice.module(x), model(x))


def test_fused_candidates_are_not_built_when_their_kernels_lose_on_a_sample():
    from fxopt.passes.cpu_kernels import sampled_gain

    # Tiny convolutions: oneDNN's packed kernel takes several times torch's (3.6x
    # measured on 2 channels of 4x4): building the candidate would be wasted setup.
    blocks = [nn.Sequential(nn.Conv2d(2, 2, 1), nn.ReLU()) for _ in range(64)]
    model, x = nn.Sequential(*blocks).eval(), torch.randn(1, 2, 4, 4)
    gm = trace(model, x)
    gain = sampled_gain(gm)
    assert gain is not None and gain.sites == 64 and gain.shapes == 1
    call_s = abs(gain.saved_s)  # a call as long as the loss: clearly a loss
    choice = layout.autotune(gm, model, (x,), budget_s=0.05, _call_s=call_s)
    assert choice.rejected["onednn"].startswith("not built: on a sample of its 1 conv/linear")
    assert torch.equal(choice.module(x), model(x))


def test_a_small_or_unknown_sampled_loss_is_left_to_the_race():
    from fxopt.passes.cpu_kernels import SampledGain

    small = SampledGain(saved_s=-0.001, sites=3, shapes=1, worst="conv")
    assert layout._losing(small, call_s=0.1) is None  # 1% of a call: the race decides
    assert layout._losing(small, call_s=None) is None  # no call time: nothing to compare
    assert layout._losing(None, call_s=0.1) is None  # no conv/linear site was sampled
    assert layout._losing(small, call_s=0.005).startswith("not built")
