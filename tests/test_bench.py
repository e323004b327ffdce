import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxopt.bench import (
    StorageTracker,
    graph_stats,
    measure_latency,
    paired_ratio,
    peak_memory,
    summarize,
)


def test_summary_statistics():
    stats = summarize([3.0, 1.0, 2.0, 4.0, 100.0])
    assert stats["median_ms"] == 3.0 and stats["min_ms"] == 1.0 and stats["max_ms"] == 100.0
    assert stats["p95_ms"] == 100.0 and stats["runs"] == 5


def test_latency_measures_every_variant_interleaved():
    calls = []

    def a(x):
        calls.append("a")
        return x

    def b(x):
        calls.append("b")
        return x

    stats = measure_latency({"a": a, "b": b}, (torch.ones(1),), runs=3, warmup=1)
    assert set(stats) == {"a", "b"} and stats["a"]["runs"] == 3
    assert calls == ["a", "b"] * 4  # warm-up round, then strictly alternating


def test_peak_memory_counts_live_intermediates_not_inputs_or_weights():
    # Linear output (8x1000 float32) and relu output live together: 2 × 32000 bytes.
    model = nn.Sequential(nn.Linear(100, 1000), nn.ReLU(), nn.Linear(1000, 10))
    assert peak_memory(model, (torch.randn(8, 100),))["peak_bytes"] == 2 * 8 * 1000 * 4

    class Chain(nn.Module):
        def forward(self, x):
            for _ in range(4):
                x = torch.sin(x)  # each step frees the previous intermediate
            return x

    assert peak_memory(Chain(), (torch.randn(256),))["peak_bytes"] == 2 * 256 * 4


def test_storage_tracker_ignores_views():
    x = torch.randn(64)
    with StorageTracker([x]) as tracker:
        y = x * 2
        y.view(8, 8).t()
    assert tracker.peak == 64 * 4


def test_graph_stats_counts_canonical_ops():
    gm = fx.symbolic_trace(lambda x: F.relu(x) + torch.relu(x).sum())
    stats = graph_stats(gm)
    assert stats["ops"] == {"relu": 2, "add": 1, "sum": 1}
    assert stats["compute_nodes"] == 4 and stats["nodes"] == 6


def test_a_time_budget_stops_timing_slow_calls_after_the_minimum_runs():
    import time

    from fxopt.bench import MIN_RUNS

    calls = {"slow": 0}

    def slow(x):
        calls["slow"] += 1
        time.sleep(0.02)
        return x

    stats = measure_latency({"slow": slow}, (torch.ones(1),), runs=50, warmup=5, budget_s=0.05)
    assert stats["slow"]["runs"] == MIN_RUNS
    assert calls["slow"] == MIN_RUNS + 1  # one warm-up round took over a tenth of the budget
    unbounded = measure_latency({"slow": slow}, (torch.ones(1),), runs=7, warmup=0)
    assert unbounded["slow"]["runs"] == 7


def test_the_report_says_how_many_calls_were_timed():
    import fxopt

    model = nn.Sequential(nn.Linear(4, 4)).eval()
    report = fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=6, autotune=False).report
    assert report["latency_runs"] == 6
    assert fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=0).report["latency_runs"] == 0


def test_paired_ratio_is_the_median_of_round_ratios_not_of_medians():
    # The machine slows down in the second half: the medians' ratio (~1.7 here) is
    # drift, each round's ratio is 1.1.
    ours = [1.1] * 5 + [11.0] * 6
    theirs = [1.0] * 5 + [10.0] * 6
    r = paired_ratio(ours, theirs)
    assert abs(r["median"] - 1.1) < 1e-12 and r["rounds"] == 11
    assert r["ci95"][0] <= r["median"] <= r["ci95"][1]
    assert paired_ratio([1.0, 3.0], [1.0, 1.0])["ci95"] == [1.0, 3.0]


def test_paired_ratio_refuses_unpaired_samples():
    with pytest.raises(ValueError, match="equal"):
        paired_ratio([1.0, 2.0], [1.0])
