"""merge-linears: linears of one input on MKL's packed GEMM, run as one GEMM over their
stacked weights (fxopt.passes.merge_linears), and its timing (gemm_timing)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture import trace
from fxopt.ir import ops
from fxopt.passes import PassManager, gemm_timing, pipelines
from fxopt.passes.fuse_kernels import FuseKernels
from fxopt.passes.merge_linears import MergeLinears, PackedLinears, packed_linears

pytestmark = [
    pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN"),
    pytest.mark.skipif(not torch._C.has_mkl, reason="this PyTorch build has no MKL"),
]
_MKL = torch.ops.mkl._mkl_linear.default
_MERGED = torch.ops.fxopt.packed_linears.default


class Attention(nn.Module):
    """A decoder layer's projections: q, k, v of one input (GQA widths), then SwiGLU."""

    def __init__(self, hidden: int = 32, bias: bool = False):
        super().__init__()
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, hidden // 4, bias=bias)
        self.v = nn.Linear(hidden, hidden // 4, bias=bias)
        self.gate = nn.Linear(hidden, 48, bias=False)
        self.up = nn.Linear(hidden, 48, bias=False)
        self.down = nn.Linear(48, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = q + torch.cat([k, v, k, v], -1)
        return self.down(nn.functional.silu(self.gate(h)) * self.up(h)), k


@pytest.fixture
def stacking(monkeypatch):
    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", True)


def _merged(model, x, mode):
    gm = trace(model.eval(), (x,), mode=mode, dynamic="batch")
    if mode == "export":  # Wᵀ folded to a constant: mm(x, Wᵀ) binds as a linear
        gm = pipelines.get("speed").run(gm).module
    result = PassManager([FuseKernels(), MergeLinears()]).run(gm)
    return result.module, result.records[-1]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _with_special_values(x):
    x = x.clone()
    x.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    return x


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("bias", [False, True])
def test_linears_of_one_input_run_as_one_gemm_with_eagers_answers(stacking, mode, bias):
    model = Attention(bias=bias).eval()
    x = torch.randn(1, 1, 32)
    merged, record = _merged(model, x, mode)
    # q/k/v and gate/up: two GEMMs for five linears; down and the others' readers unchanged.
    assert record.stats == {"merged": 2, "linears": 5}
    assert _targets(merged).count(_MERGED) == 2 and _targets(merged).count(_MKL) == 1
    with torch.no_grad():
        # The packed row count, other values, NaN/±inf; then other row counts, which run
        # each linear on its own dense weight.
        for other in (x, torch.randn(1, 1, 32) * 9, _with_special_values(x)):
            want, have = model(other), merged(other)
            for w, h in zip(want, have):
                torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5, equal_nan=True)
                assert h.is_contiguous()
        # (the exported graph's sequence length is static: one token, as in decoding)
        for rows in ((3, 1, 32), (2, 5, 32))[: 2 if mode == "fx" else 1]:
            other = torch.randn(rows)
            for w, h in zip(model(other), merged(other)):
                torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)


def test_the_merged_weights_are_the_models_own_and_only_their_packed_form_is_new(stacking):
    model = Attention().eval()
    merged, _ = _merged(model, torch.randn(1, 32), "fx")
    holders = [m for m in merged.modules() if isinstance(m, PackedLinears)]
    assert len(holders) == 2
    qkv = next(h for h in holders if h.count == 3)
    for mine, theirs in zip(qkv.weights(), (model.q.weight, model.k.weight, model.v.weight)):
        assert mine.data_ptr() == theirs.data_ptr()
    # Copies share the packed form; pickling packs again from the dense weights.
    twin = copy.deepcopy(merged)
    twin_qkv = next(m for m in twin.modules() if isinstance(m, PackedLinears) and m.count == 3)
    assert twin_qkv.packed is qkv.packed
    loaded = pickle.loads(pickle.dumps(merged))
    x = torch.randn(1, 32)
    with torch.no_grad():
        for w, h in zip(model(x), loaded(x)):
            torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)
    assert set(qkv.state_dict()) == {"weight_0", "weight_1", "weight_2"}


def test_an_input_written_between_its_linears_keeps_them_apart(stacking):
    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            x = x * 1
            first = self.a(x)
            x.add_(1)
            return first, self.b(x)

    model = Written().eval()
    merged, record = _merged(model, torch.randn(1, 8), "fx")
    assert not record.changed
    assert any("written in place" in s.reason for s in record.skipped)
    x = torch.randn(1, 8)
    for w, h in zip(model(x), merged(x)):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)


def test_linears_stay_apart_where_one_gemm_is_not_timed_faster(monkeypatch):
    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", False)
    merged, record = _merged(Attention(), torch.randn(1, 32), "fx")
    assert not record.changed and _MERGED not in _targets(merged)
    assert any("not faster here (timed)" in s.reason for s in record.skipped)


def test_the_stacking_timing_is_real_and_kept_per_shapes(monkeypatch):
    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", None)
    monkeypatch.setattr(gemm_timing, "_stacked", {})
    calls = []
    real = gemm_timing._timed_stacking

    def counting(weights, rows, cold):
        calls.append([tuple(w.shape) for w in weights])
        return real(weights, rows, cold)

    monkeypatch.setattr(gemm_timing, "_timed_stacking", counting)
    weights = [torch.randn(64, 32), torch.randn(16, 32)]
    answer = gemm_timing.stacked_is_faster(weights, rows=1)
    assert answer in (True, False)
    assert gemm_timing.stacked_is_faster([torch.randn(64, 32), torch.randn(16, 32)], 1) is answer
    assert calls == [[(64, 32), (16, 32)]]
    ratio = gemm_timing._stacked[next(iter(gemm_timing._stacked))]
    assert ratio > 0 and answer == (ratio < gemm_timing.MARGIN)
    # Past ELEMENTS_TIMED the weights are timed on their first rows, in proportion.
    monkeypatch.setattr(gemm_timing, "ELEMENTS_TIMED", 1024)
    gemm_timing.stacked_is_faster([torch.randn(96, 32), torch.randn(32, 32)], rows=2)
    assert calls[-1] == [(24, 32), (8, 32)]


def test_the_op_is_pure_and_known_to_the_op_table(stacking):
    merged, _ = _merged(Attention(), torch.randn(1, 32), "fx")
    node = next(n for n in merged.graph.nodes if n.target is _MERGED)
    info = ops.info(node, merged)
    assert info.known and info.pure and not info.view


def test_the_function_falls_back_to_each_linear_at_other_row_counts():
    weights, bias = [torch.randn(8, 4), torch.randn(3, 4)], torch.randn(11)
    holder = PackedLinears(weights, bias, rows=2)
    for x in (torch.randn(2, 4), torch.randn(5, 4), torch.randn(0, 4)):
        pieces = packed_linears(x, holder.packed, weights, bias, 2)
        want = nn.functional.linear(x, torch.cat(weights), bias).split([8, 3], -1)
        for w, h in zip(want, pieces):
            torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5)


def test_the_layout_step_merges_and_compiles_the_whole_graph(stacking, monkeypatch):
    from fxopt import layout

    # Built whatever the packed kernels' sampled time here (tiny shapes: slower).
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)
    model = nn.Sequential(*[_Layer() for _ in range(3)]).eval()
    x = torch.randn(1, 1, 32)
    result = fxopt.optimize(model, (x,), benchmark_runs=0, layout="onednn_inductor")
    report = result.report["layout"]
    assert report["merged_linears"] == "6 in 3 GEMMs"
    assert report["inductor_regions"]["whole_graph"] == "compiled"
    with torch.no_grad():
        for other in (torch.randn(1, 1, 32) * 3, _with_special_values(x)):
            torch.testing.assert_close(
                result.module(other), model(other), rtol=1e-4, atol=1e-5, equal_nan=True
            )


class _Layer(nn.Module):
    """RMSNorm then a SwiGLU MLP with a residual: gate and up read one input."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.gate, self.up = nn.Linear(width, 64, bias=False), nn.Linear(width, 64, bias=False)
        self.down = nn.Linear(64, width, bias=False)

    def forward(self, x):
        h = self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


# -- one-row linears as reductions, in a graph Inductor compiles whole (row_reductions) --


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_gemms_as_reductions_compute_eagers_answer(monkeypatch, mode, bias):
    from fxopt.passes import row_reductions

    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", True)
    model = Attention(bias=bias).eval()
    x = torch.randn(1, 1, 32)
    merged, _ = _merged(model, x, mode)  # two stacked GEMMs and one plain one
    assert row_reductions.one_row_linears(merged) == 3
    rows = row_reductions.as_reductions(merged)
    assert row_reductions.one_row_linears(rows) == 0
    assert not {_MKL, _MERGED} & set(_targets(rows))
    assert _targets(merged).count(_MERGED) == 2  # the graph it was copied from is unchanged
    with torch.no_grad():
        for other in (x, torch.randn(1, 1, 32) * 9, _with_special_values(x)):
            for w, h in zip(model(other), rows(other)):
                torch.testing.assert_close(h, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_gemms_packed_for_more_rows_stay_gemms():
    from fxopt.passes import row_reductions

    merged, _ = _merged(Attention(), torch.randn(4, 1, 32), "fx")
    assert row_reductions.one_row_linears(merged) == 0


@pytest.mark.parametrize("faster", ["reductions", "gemms"])
def test_the_whole_graph_keeps_reductions_only_where_timed_faster(stacking, monkeypatch, faster):
    from fxopt import layout
    from fxopt.passes import inductor_regions

    times = (
        {"reductions": 1.0, "gemms": 2.0}
        if faster == "reductions"
        else {"reductions": 2.0, "gemms": 1.99}
    )
    monkeypatch.setattr(inductor_regions, "_timed_calls", lambda calls, leaves: times)
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)
    # Reductions are tried where the weights stream from memory: here, a 1 KiB cache.
    monkeypatch.setattr(gemm_timing, "cache_bytes", lambda: 1024)
    model = nn.Sequential(*[_Layer() for _ in range(3)]).eval()
    x = torch.randn(1, 1, 32)
    result = fxopt.optimize(model, (x,), benchmark_runs=0, layout="onednn_inductor")
    regions = result.report["layout"]["inductor_regions"]
    assert regions["whole_graph"] == "compiled"
    kept = "as reductions" if faster == "reductions" else "on their GEMMs"
    ms = f"{times['reductions'] * 1e3:.2f}"
    assert regions["one_row_linears"].startswith(f"{kept}: {ms} ms a call as reductions")
    with torch.no_grad():
        for other in (torch.randn(1, 1, 32) * 3, _with_special_values(x), torch.randn(3, 1, 32)):
            torch.testing.assert_close(
                result.module(other), model(other), rtol=1e-4, atol=1e-5, equal_nan=True
            )


def test_a_model_whose_weights_fit_in_the_cache_is_compiled_whole_once(stacking, monkeypatch):
    from fxopt import layout
    from fxopt.passes import inductor_regions

    def never(calls, leaves):
        raise AssertionError("timed: the reductions were compiled")

    monkeypatch.setattr(inductor_regions, "_timed_calls", never)
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)
    model = nn.Sequential(*[_Layer() for _ in range(3)]).eval()  # 74 KiB of weights
    result = fxopt.optimize(
        model, (torch.randn(1, 1, 32),), benchmark_runs=0, layout="onednn_inductor"
    )
    regions = result.report["layout"]["inductor_regions"]
    assert regions["whole_graph"] == "compiled" and "one_row_linears" not in regions
