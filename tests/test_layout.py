import pytest
import torch
from torch import nn

from fxopt import layout
from fxopt.capture import trace
from fxopt.verify import check_outputs


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
    choice = layout.autotune(trace(model, x, "export"), model, (x,), budget_s=0.05)
    assert "mkldnn" in choice.rejected and "module-level" in choice.rejected["mkldnn"]


def test_graph_without_convolutions_or_linears_stays_plain_without_timing():
    model, x = nn.Sequential(nn.ReLU(), nn.Tanh()), torch.randn(2, 4)
    gm = trace(model, x)
    choice = layout.autotune(gm, model, (x,))
    assert choice.name == "plain" and choice.module is gm
    assert choice.median_ms == {}
    assert choice.rejected["channels_last"] == "no convolutions or linears"


def test_a_linear_only_graph_times_only_the_prepacked_candidate():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(2, 4)
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert set(choice.rejected) >= {"channels_last", "mkldnn"}
    assert choice.rejected["channels_last"] == "no convolutions"
    assert {"plain", "onednn"} <= set(choice.median_ms)


def test_autotune_returns_a_verified_candidate_and_reports_timings():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert {"plain", "channels_last", "mkldnn", "onednn"} <= set(choice.median_ms)
    assert choice.name in choice.median_ms
    if choice.name != "plain":  # a winner is confirmed in a second round
        assert f"{choice.name} (confirmation)" in choice.median_ms
    assert check_outputs(model, choice.module, (x,)).ok
    report = choice.to_dict()
    assert report["chosen"] == choice.name and report["autotune_s"] > 0


def test_plain_is_kept_unless_a_candidate_is_clearly_faster():
    model, x = _cnn(), torch.randn(1, 3, 16, 16)
    # With an impossible required gain, nothing can displace the plain graph.
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05, min_gain=1.0)
    assert choice.name == "plain"
