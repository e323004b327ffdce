"""The speed preset's choice between MKL's and oneDNN's packed GEMM, timed per linear shape
(fxopt.passes.gemm_timing), and the kernels each choice emits."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from fxopt.capture import trace
from fxopt.passes import PassManager, cpu_kernels, gemm_timing
from fxopt.passes.fuse_kernels import FuseKernels

pytestmark = [
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN"),
    pytest.mark.skipif(not torch._C.has_mkl, reason="this PyTorch build has no MKL"),
]
_LINEAR = torch.ops.mkldnn._linear_pointwise.default
_MKL = torch.ops.mkl._mkl_linear.default


@pytest.fixture
def timed(monkeypatch):
    """The timed choice, from a fresh cache (conftest forces MKL for other tests)."""
    monkeypatch.setattr(gemm_timing, "FORCED", None)
    monkeypatch.setattr(gemm_timing, "_chosen", {})


def test_the_faster_gemm_is_chosen_once_per_shape_rows_and_threads(timed, monkeypatch):
    calls = []

    def fake(weight, rows, cold, shared):  # (MKL's seconds, oneDNN's)
        calls.append((tuple(weight.shape), rows))
        return (1.0, 0.5) if rows > 1 else (1.0, 2.0)

    monkeypatch.setattr(gemm_timing, "_timed", fake)
    weight = torch.randn(16, 8)
    assert gemm_timing.faster_gemm(weight, rows=8) == "onednn"
    assert gemm_timing.faster_gemm(weight, rows=1) == "mkl"
    assert gemm_timing.faster_gemm(torch.randn(16, 8), rows=8) == "onednn"  # cached
    assert gemm_timing.choice(weight, 8) == ("onednn", 0.5)
    assert calls == [((16, 8), 8), ((16, 8), 1)]
    # Rows beyond ROWS_TIMED are timed at ROWS_TIMED (one entry for both).
    gemm_timing.faster_gemm(weight, rows=10_000)
    gemm_timing.faster_gemm(weight, rows=20_000)
    assert calls[-1] == ((16, 8), gemm_timing.ROWS_TIMED) and len(calls) == 3


def test_onednn_must_win_by_the_margin(timed, monkeypatch):
    monkeypatch.setattr(gemm_timing, "_timed", lambda w, r, cold, shared: (1.0, 0.97))
    assert gemm_timing.faster_gemm(torch.randn(4, 4), rows=2) == "mkl"


def test_the_real_timing_returns_a_kernel_and_a_ratio(timed):
    kernel, ratio = gemm_timing.choice(torch.randn(64, 32), rows=4)
    assert kernel in ("mkl", "onednn") and ratio > 0
    assert (kernel == "onednn") == (ratio < gemm_timing.MARGIN)


def test_cold_timing_rotates_copies_that_fill_twice_the_cache(timed, monkeypatch):
    monkeypatch.setattr(gemm_timing, "cache_bytes", lambda: 2**20)
    packed = []
    real = torch.ops.mkldnn._reorder_linear_weight

    class Counting:  # counts oneDNN's packed copies
        def __call__(self, weight, rows):
            packed.append(weight.nbytes)
            return real(weight, rows)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", Counting())
    weight = torch.randn(64, 256)  # 64 KiB: 32 copies fill 2 MiB
    kernel, ratio = gemm_timing.choice(weight, rows=2, cold=True)
    assert kernel in ("mkl", "onednn") and ratio > 0
    assert len(packed) == 32
    assert gemm_timing.choice(weight, rows=2, cold=True) == (kernel, ratio)  # cached
    assert gemm_timing.weights_stream(2**20 + 1) and not gemm_timing.weights_stream(2**20)


def test_the_cache_size_is_read_or_assumed():
    assert gemm_timing.cache_bytes() >= 2**20


class SwiGLU(nn.Module):
    """A Llama MLP: down(silu(gate(x)) * up(x)) + x."""

    def __init__(self, hidden: int = 16, inner: int = 40):
        super().__init__()
        self.gate = nn.Linear(hidden, inner, bias=False)
        self.up = nn.Linear(hidden, inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x)) + x


def _lowered(model, x, mode):
    from fxopt.passes import pipelines

    gm = trace(model.eval(), (x,), mode=mode, dynamic="batch")
    if mode == "export":  # Wᵀ folded to a constant: mm(x, Wᵀ) binds as a linear
        gm = pipelines.get("speed").run(gm).module
    result = PassManager([FuseKernels()]).run(gm)
    return result.module, result.records[0]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _eager_or_close(model, lowered, x):
    with torch.no_grad():
        torch.testing.assert_close(lowered(x), model(x), rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_where_onednn_wins_it_runs_the_linears_and_their_post_ops(monkeypatch, mode):
    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    model, x = SwiGLU(), torch.randn(3, 5, 16)
    lowered, record = _lowered(model, x, mode)
    targets = _targets(lowered)
    assert _MKL not in targets and targets.count(_LINEAR) >= 2
    assert record.stats["gemms"] == "onednn: 3"
    _eager_or_close(model, lowered, x)
    _eager_or_close(model, lowered, torch.randn(7, 5, 16))  # another batch
    special = torch.randn(2, 5, 16)
    special[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    special[1, 1] = -0.0
    _eager_or_close(model, lowered, special)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_where_mkl_wins_the_post_ops_run_after_it(monkeypatch, mode):
    monkeypatch.setattr(gemm_timing, "FORCED", "mkl")
    model, x = SwiGLU(), torch.randn(3, 5, 16)
    lowered, record = _lowered(model, x, mode)
    assert _LINEAR not in _targets(lowered)
    assert record.stats["gemms"] == "mkl: 3"
    _eager_or_close(model, lowered, torch.randn(7, 5, 16))


def test_timed_choices_compute_eagers_answer(timed):
    # Whatever this machine times, the lowered module is eager's function.
    model, x = SwiGLU(64, 160), torch.randn(1, 4, 64)
    lowered, record = _lowered(model, x, "export")
    assert sum(int(n.split(": ")[1]) for n in record.stats["gemms"].split(", ")) == 3
    _eager_or_close(model, lowered, torch.randn(3, 4, 64))  # another batch
    assert cpu_kernels._mkl_is_faster(model.up.weight, 4, False) == (
        gemm_timing.faster_gemm(model.up.weight, 4) == "mkl"
    )


def test_at_one_row_onednn_must_win_by_more(timed, monkeypatch):
    # Timed alone, oneDNN's GEMM looks faster at one row than it runs in a decode step.
    monkeypatch.setattr(gemm_timing, "_timed", lambda w, r, cold, shared: (1.0, 0.7))
    weight = torch.randn(8, 8)
    assert gemm_timing.faster_gemm(weight, rows=1) == "mkl"
    assert gemm_timing.faster_gemm(weight, rows=2) == "onednn"


# -- shared weights: no packed copy ---------------------------------------------------------


def _lowered_shared(model, x, mode):
    from fxopt.passes import pipelines

    gm = trace(model.eval(), (x,), mode=mode, dynamic="batch")
    if mode == "export":
        gm = pipelines.get("speed").run(gm).module
    result = PassManager([FuseKernels(share_weights=True)]).run(gm)
    return result.module, result.records[0]


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_shared_weights_run_onednn_on_the_models_own_weights(monkeypatch, mode):
    from fxopt.passes.cpu_kernels import PackedWeight

    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    model, x = SwiGLU(), torch.randn(3, 5, 16)
    lowered, record = _lowered_shared(model, x, mode)
    assert record.stats["gemms"] == "onednn on the dense weight: 3"
    packed = [m for m in lowered.modules() if isinstance(m, PackedWeight)]
    owned = {p.data_ptr() for p in model.parameters()}
    if mode == "fx":  # (export's weights are the same storages, transposed twice)
        assert {p.packed.data_ptr() for p in packed} == owned
    assert all(p.packed is p.dense for p in packed)  # no copy beside the dense weight
    _eager_or_close(model, lowered, torch.randn(7, 5, 16))
    special = torch.randn(2, 5, 16)
    special[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    _eager_or_close(model, lowered, special)
    copied = copy.deepcopy(lowered)  # and pickled: the dense weight is the packed one
    restored = pickle.loads(pickle.dumps(lowered))
    _eager_or_close(model, copied, x)
    _eager_or_close(model, restored, x)


def test_shared_weights_leave_linears_where_torchs_own_is_faster(monkeypatch):
    monkeypatch.setattr(gemm_timing, "FORCED", "mkl")
    model, x = SwiGLU(), torch.randn(3, 5, 16)
    lowered, record = _lowered_shared(model, x, "fx")
    assert not record.changed or "gemms" not in record.stats
    assert any("the weights are shared" in s.reason for s in record.skipped)
    _eager_or_close(model, lowered, x)


def test_shared_weights_leave_convolutions_alone(monkeypatch):
    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(1, 3, 8, 8)
    gm = trace(model, (x,))
    record = PassManager([FuseKernels(share_weights=True)]).run(gm).records[0]
    assert any("needs a packed copy" in s.reason for s in record.skipped)


def test_the_layout_step_builds_onednn_without_a_copy_where_one_is_not_paid_for(monkeypatch):
    import fxopt
    from fxopt import layout
    from fxopt.passes.cpu_kernels import PackedWeight

    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    monkeypatch.setattr(layout, "COPY_NEEDS_GAIN_BYTES", 0)  # every copy must be paid for
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)  # and none is sampled
    model, x = SwiGLU(32, 64).eval(), torch.randn(2, 4, 32)
    result = fxopt.optimize(model, (x,), benchmark_runs=0, layout="onednn")
    packed = [m for m in result.module.modules() if isinstance(m, PackedWeight)]
    assert packed and all(p.packed is p.dense for p in packed)
    assert result.report["layout"]["gemms"] == f"onednn on the dense weight: {len(packed)}"
    owned = {p.data_ptr() for p in model.parameters()}
    assert {p.dense.data_ptr() for p in packed} <= owned
    _eager_or_close(model, result.module, torch.randn(2, 4, 32))
