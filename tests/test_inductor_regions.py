"""inductor-regions: regions of pure ATen ops between kernels, run by Inductor's code, and
the layout step's ``onednn_inductor`` candidate built from them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxopt
from fxopt.capture import trace
from fxopt.ir.compiled import CompiledRegion
from fxopt.passes import inductor_regions
from fxopt.passes.inductor_regions import compile_regions


class RmsNorm(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Block(nn.Module):
    """RMSNorm, a SwiGLU MLP and a residual add: a decoder layer without attention."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm = RmsNorm(width)
        self.gate, self.up = nn.Linear(width, 32, bias=False), nn.Linear(width, 32, bias=False)
        self.down = nn.Linear(32, width, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


def _regions(gm) -> list[CompiledRegion]:
    return [m for m in gm.modules() if isinstance(m, CompiledRegion)]


def _same_special_values(want: torch.Tensor, have: torch.Tensor) -> None:
    assert torch.equal(want.isnan(), have.isnan())
    assert torch.equal(want.signbit()[want == 0], have.signbit()[have == 0])
    torch.testing.assert_close(have, want, equal_nan=True, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_norm_runs_as_one_region_with_eager_answers(mode):
    model = RmsNorm().eval()
    example = (torch.randn(2, 3, 16),)
    gm = trace(model, example, mode=mode)
    report = compile_regions(gm, example)
    assert report.regions == 1 and report.ops >= 5 and not report.left
    (region,) = _regions(gm)
    assert region.shapes is not None  # compiled for the example's sizes
    with torch.no_grad():
        for x in (example[0], torch.randn(2, 3, 16) * 100):
            _same_special_values(model(x), gm(x))
        # Another size is not what the code was compiled for: the region's fx graph runs.
        other = torch.randn(5, 7, 16)
        torch.testing.assert_close(gm(other), model(other))
        # NaN, infinities and negative zeros give eager's answer.
        special = torch.randn(2, 3, 16)
        special[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        special[1] = -0.0
        _same_special_values(model(special), gm(special))


def test_a_region_that_changes_a_sign_of_zero_is_left_eager(monkeypatch):
    """Inductor builds with -fno-signed-zeros: code that turns -0.0 into +0.0 is refused."""
    compile_for = inductor_regions._inductor

    def unsigned_zeros(sub, inputs, dynamic=()):
        code, symbolic = compile_for(sub, inputs, dynamic)
        return (lambda args: [out + 0.0 for out in code(args)]), symbolic  # -0.0 + 0.0 is +0.0

    monkeypatch.setattr(inductor_regions, "_inductor", unsigned_zeros)
    model = RmsNorm().eval()
    example = (torch.randn(2, 16),)
    gm = trace(model, example, mode="export")
    report = compile_regions(gm, example)
    assert report.regions == 0
    assert any("+0.0 where eager has -0.0" in reason for reason in report.left.values())
    assert not _regions(gm)  # the region's ops are back in the graph, eager
    x = -torch.zeros(2, 16)
    with torch.no_grad():
        assert torch.equal(gm(x).signbit(), model(x).signbit())


def test_reduced_precision_random_and_in_place_ops_stay_out():
    class Mixed(nn.Module):
        def forward(self, x, y):
            half = (x.to(torch.bfloat16) * 2 + 1).float()  # rounds after each op in eager
            noisy = torch.nn.functional.dropout(y * 2 + 1, 0.5, training=True)
            written = (y * 3).add_(1)  # in place
            return half, noisy.shape, written

    model, example = Mixed(), (torch.randn(4, 8), torch.randn(4, 8))
    gm = trace(model, example, mode="fx")
    compile_regions(gm, example)
    inside = [n for r in _regions(gm) for n in r.eager.graph.nodes if n.op.startswith("call")]
    assert inside  # y * 2 + 1 and y * 3: float32, pure
    assert not [n for n in inside if n.target in ("to", "add_") or "dropout" in str(n.target)]
    with torch.no_grad():
        half, shape, written = gm(*example)
        want = model(*example)
    assert torch.equal(half, want[0]) and shape == want[1] and torch.equal(written, want[2])


def test_few_ops_are_not_compiled():
    example = (torch.randn(2, 16),)
    gm = trace(RmsNorm().eval(), example, mode="export")
    before = gm.code
    report = compile_regions(gm, example, min_ops=100)
    assert report.regions == 0 and "fewer than 100" in report.left["(graph)"]
    assert gm.code == before


def test_a_view_returned_by_the_graph_stays_outside_its_region():
    class Viewed(nn.Module):
        def forward(self, x):
            y = (x * 2 + 1).relu()
            return y.view(-1), y.transpose(0, 1)

    model, example = Viewed(), (torch.randn(3, 4),)
    gm = trace(model, example, mode="export")
    compile_regions(gm, example)
    for region in _regions(gm):
        names = [str(n.target) for n in region.eager.graph.nodes]
        assert not any("view" in n or "transpose" in n for n in names)
    with torch.no_grad():
        out = gm(example[0])
        assert out[0]._base is not None or out[0].data_ptr() == out[1].data_ptr()
        for have, want in zip(out, model(example[0])):
            torch.testing.assert_close(have, want)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this build")
def test_the_layout_step_builds_and_verifies_the_inductor_candidate():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    example = (torch.randn(2, 5, 16),)
    result = fxopt.optimize(model, example, dynamic="batch", benchmark_runs=0)
    layout = result.report["layout"]
    assert "onednn_inductor" in layout["median_ms"] or (
        "slower" in layout["rejected"].get("onednn_inductor", "")
    ), layout["rejected"]
    with torch.no_grad():
        for x in (torch.randn(2, 5, 16), torch.randn(7, 5, 16)):
            torch.testing.assert_close(result.module(x), model(x))
    if layout["chosen"] == "onednn_inductor":
        assert layout["inductor_regions"]["regions"] >= 4


def test_the_switch_turns_the_candidate_off(monkeypatch):
    monkeypatch.setenv(inductor_regions.ENV_SWITCH, "0")
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    result = fxopt.optimize(model, (torch.randn(2, 5, 16),), benchmark_runs=0)
    rejected = result.report["layout"]["rejected"]
    assert "turned off" in rejected["onednn_inductor"]


def test_a_saved_module_runs_its_regions_eager_once_loaded(tmp_path):
    model, example = RmsNorm().eval(), (torch.randn(2, 3, 16),)
    gm = trace(model, example, mode="export")
    assert compile_regions(gm, example).regions == 1
    torch.save(gm, tmp_path / "gm.pt")
    loaded = torch.load(tmp_path / "gm.pt", weights_only=False)
    (region,) = _regions(loaded)
    assert region.compiled is None
    with torch.no_grad():
        torch.testing.assert_close(loaded(example[0]), model(example[0]))


class AddNormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x, y):
        return torch.nn.functional.gelu(self.norm(x + y)) * 2


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_layer_norm_and_gelu_are_exact_for_finite_inputs_only(mode):
    # LayerNorm returns three tensors at the ATen level: the region takes it with the
    # getitem that picks its output. Inductor's GELU gives NaN for -inf (eager: -0.0) and
    # its LayerNorm loses signs of zero: left eager by default, kept with fast_math.
    model = AddNormGelu().eval()
    example = (torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    gm = trace(model, example, mode=mode)
    report = compile_regions(gm, example)
    assert report.regions == 0
    (reason,) = report.left.values()
    assert "not exact" in reason and "fast_math keeps it" in reason
    fast = trace(model, example, mode=mode)
    report = compile_regions(fast, example, fast_math=True)
    assert report.regions == 1 and len(report.inexact) == 1
    (region,) = _regions(fast)
    if mode == "export":  # (a module-level graph calls nn.LayerNorm, which stays a call)
        assert any("layer_norm" in str(n.target) for n in region.eager.graph.nodes)
    with torch.no_grad():
        x = torch.randn(2, 3, 16)
        torch.testing.assert_close(fast(x, example[1]), model(x, example[1]))


def _whole(model: nn.Module, example: tuple, mode: str):
    """(base graph, its regions graph, compile_whole's result) for ``model``."""
    from fxopt.ir.copying import graph_copy

    base = trace(model, example, mode=mode)
    regions = graph_copy(base)
    report = compile_regions(regions, example)
    return base, regions, report, inductor_regions.compile_whole(base, regions, example)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_graph_whose_regions_are_exact_runs_as_one_compiled_call(mode):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).eval()
    example = (torch.randn(2, 5, 16),)
    _, _, report, (whole, why_not, seconds) = _whole(model, example, mode)
    assert not report.left and whole is not None, why_not
    assert seconds > 0
    calls = [n for n in whole.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == [inductor_regions.WHOLE_NAME]
    region = whole.get_submodule(inductor_regions.WHOLE_NAME)
    assert isinstance(region, CompiledRegion) and region.compiled is not None
    with torch.no_grad():
        special = torch.randn(2, 5, 16)
        special[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
        special[1] = -0.0
        for x in (example[0], torch.randn(2, 5, 16) * 50, special):
            want, have = model(x), whole(x)
            assert torch.equal(want.isnan(), have.isnan())
            torch.testing.assert_close(have, want, equal_nan=True, rtol=1e-4, atol=1e-5)
        # Another size: the regions graph runs it (mode="fx" graphs take any batch).
        if mode == "fx":
            other = torch.randn(7, 3, 16)
            torch.testing.assert_close(whole(other), model(other), rtol=1e-4, atol=1e-5)


def test_a_graph_with_a_region_left_eager_or_a_random_op_is_not_compiled_whole():
    model = AddNormGelu().eval()  # LayerNorm and GELU: inexact for NaN/inf in Inductor
    example = (torch.randn(2, 3, 16), torch.randn(2, 3, 16))
    result = fxopt.optimize(
        nn.Sequential(*[Block() for _ in range(4)]).eval(),
        (torch.randn(2, 5, 16),),
        benchmark_runs=0,
        layout="onednn_inductor",
    )
    assert result.report["layout"]["inductor_regions"]["whole_graph"] == "compiled"
    base = trace(model, example, mode="export")
    from fxopt.layout import INDUCTOR_KEY, _whole_graph

    regions = trace(model, example, mode="export")
    report = compile_regions(regions, example)
    assert report.left  # left eager: not exact
    regions.meta[INDUCTOR_KEY] = report.to_dict()
    kept = _whole_graph(base, regions, report, model, example, [], {})
    assert kept is regions
    assert regions.meta[INDUCTOR_KEY]["whole_graph"].startswith("not tried")

    class Noisy(nn.Module):
        def forward(self, x):
            return Block()(x) + torch.rand_like(x)

    noisy = trace(Noisy().eval(), (torch.randn(2, 5, 16),), mode="export")
    whole, why_not, _ = inductor_regions.compile_whole(noisy, noisy, (torch.randn(2, 5, 16),))
    assert whole is None and "random" in why_not


def test_a_saved_whole_graph_runs_eager_once_loaded(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(2)]).eval()
    example = (torch.randn(2, 5, 16),)
    _, _, _, (whole, why_not, _) = _whole(model, example, "export")
    assert whole is not None, why_not
    torch.save(whole, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert all(r.compiled is None for r in _regions(loaded))
    with torch.no_grad():
        torch.testing.assert_close(loaded(example[0]), model(example[0]))


def test_a_whole_graph_that_fails_leaves_the_regions_candidate(monkeypatch):
    def broken(*args):
        raise RuntimeError("generated code crashed")

    monkeypatch.setattr(inductor_regions, "compile_whole", broken)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    example = (torch.randn(2, 5, 16),)
    result = fxopt.optimize(model, example, benchmark_runs=0, layout="onednn_inductor")
    record = result.report["layout"]["inductor_regions"]
    assert record["whole_graph"] == "RuntimeError: generated code crashed"
    assert record["regions"] >= 4
    with torch.no_grad():
        torch.testing.assert_close(result.module(example[0]), model(example[0]))


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_plain_inductor_compiles_the_plain_graph_and_copies_no_weight(mode):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    example = (torch.randn(2, 5, 16),)
    result = fxopt.optimize(model, example, mode=mode, benchmark_runs=0, layout="plain_inductor")
    assert result.report["layout"]["chosen"] == "plain_inductor"
    record = result.report["layout"]["inductor_regions"]
    assert record["regions"] >= 4 and not record["left_eager"]
    # The model's weights are the module's, not copies (no packing in this candidate).
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {t.untyped_storage().data_ptr() for t in result.module.state_dict().values()}
    assert held <= own
    special = example[0].clone()
    special[0, 0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    with torch.no_grad():
        for x in (example[0], special, torch.randn(2, 5, 16) * 30):
            _same_special_values(model(x), result.module(x))
        if mode == "fx":  # another batch: the regions graph (fx capture takes any batch)
            other = torch.randn(6, 5, 16)
            torch.testing.assert_close(result.module(other), model(other))


def test_generated_code_is_not_kept_by_inductor_after_the_module_is_gone():
    """Inductor lists each module it generates for the life of the process, with the
    weights compiled into it; fxopt's are taken off the list, so they go with the result."""
    import gc
    import weakref

    from torch._inductor.codecache import PyCodeCache

    listed = len(PyCodeCache.modules)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    example = (torch.randn(2, 5, 16),)
    result = fxopt.optimize(model, example, benchmark_runs=0, layout="onednn_inductor")
    assert result.report["layout"]["inductor_regions"]["whole_graph"] == "compiled"
    assert len(PyCodeCache.modules) == listed
    # The packed weights (the module's buffers) were compiled into the whole graph's code.
    params = {id(p) for p in model.parameters()}
    buffers = [t for m in result.module.modules() for t in m._buffers.values() if t is not None]
    held = [weakref.ref(t) for t in buffers if id(t) not in params]
    assert held
    del result, buffers
    gc.collect()
    assert all(ref() is None for ref in held)  # nothing else holds them


def test_a_large_weight_copy_needs_a_sampled_gain(monkeypatch):
    # Where the packed copy is not paid for (10% of a call beyond what oneDNN's linears on
    # the dense weights save), the onednn candidate is built without one.
    from fxopt import layout
    from fxopt.passes import gemm_timing
    from fxopt.passes.cpu_kernels import PackedWeight, SampledGain

    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()
    example = (torch.randn(2, 5, 16),)
    monkeypatch.setattr(layout, "COPY_NEEDS_GAIN_BYTES", 1024)  # these weights: 14 KiB
    # (seconds saved per call by the packed kernels, by the shared ones; a copy is made)
    for packed_s, shared_s, copied in ((0.0, 0.0, False), (10.0, 0.0, True), (10.0, 10.0, False)):

        def sampled(gm, shared=False, packed_s=packed_s, shared_s=shared_s):
            saved = shared_s if shared else packed_s
            return SampledGain(saved, sites=12, shapes=2, worst="linear")

        monkeypatch.setattr(layout, "sampled_gain", sampled)
        result = fxopt.optimize(model, example, benchmark_runs=0, layout="onednn")
        weights = [m for m in result.module.modules() if isinstance(m, PackedWeight)]
        assert weights and all((w.packed is not w.dense) == copied for w in weights), (
            packed_s,
            shared_s,
        )
        with torch.no_grad():
            other = torch.randn(2, 5, 16)
            torch.testing.assert_close(result.module(other), model(other))


def test_a_graph_computing_in_bfloat16_is_not_compiled_whole():
    # Inductor computes bfloat16 in float32 and rounds once; eager rounds after each op.
    model = nn.Sequential(*[Block() for _ in range(2)]).eval().to(torch.bfloat16)
    example = (torch.randn(2, 5, 16, dtype=torch.bfloat16),)
    gm = trace(model, example, mode="export")
    whole, why_not, _ = inductor_regions.compile_whole(gm, gm, example)
    assert whole is None and "computes in torch.bfloat16" in why_not


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_a_whole_graph_compiles_with_onednn_linears_and_their_fused_adds(monkeypatch):
    # oneDNN's linear + add has no fake kernel in torch 2.13: inductor_regions registers
    # one, or Inductor refused every whole graph holding it.
    from fxopt import layout
    from fxopt.passes import gemm_timing

    monkeypatch.setattr(gemm_timing, "FORCED", "onednn")
    # Built whatever the packed kernels' sampled time here (tiny shapes, 1 thread: slower).
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)
    model = nn.Sequential(*[Block() for _ in range(4)]).eval()  # (24 ops: regions are built)
    result = fxopt.optimize(
        model, (torch.randn(2, 5, 16),), benchmark_runs=0, layout="onednn_inductor"
    )
    layout = result.report["layout"]
    assert "linear_add: 4" in layout["kernels"]
    assert layout["inductor_regions"]["whole_graph"] == "compiled"
    with torch.no_grad():
        other = torch.randn(2, 5, 16) * 4
        torch.testing.assert_close(result.module(other), model(other), rtol=1e-4, atol=1e-5)


def test_a_whole_graph_with_sizes_that_vary_is_compiled_for_them_under_guards():
    # A KV cache grows by a token a step: the whole graph is compiled with the sizes the
    # captured graph lets vary symbolic (those of 2 or more in the example) and runs every
    # call its shape environment's guards accept; sizes 0 and 1 run the regions graph.
    from fxopt.ir.compiled import SymbolicLayouts
    from fxopt.ir.copying import graph_copy

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(3)]).eval()
    example = (torch.randn(2, 5, 16),)
    base = trace(model, example, mode="export", dynamic="all")
    regions = graph_copy(base)
    compile_regions(regions, example)
    whole, why_not, _ = inductor_regions.compile_whole(base, regions, example)
    assert whole is not None, why_not
    region = whole.get_submodule(inductor_regions.WHOLE_NAME)
    assert isinstance(region.shapes, SymbolicLayouts)
    assert "2 <= L['t0'].size()[1]" in region.shapes.expression
    eager_calls = []
    hook = region.eager.register_forward_pre_hook(lambda module, args: eager_calls.append(1))
    with torch.no_grad():
        for shape in ((2, 5, 16), (3, 9, 16), (4, 2, 16)):  # compiled code
            x = torch.randn(shape)
            torch.testing.assert_close(whole(x), model(x), rtol=1e-4, atol=1e-5)
        assert not eager_calls
        for shape in ((2, 1, 16), (1, 6, 16)):  # a size 1: the regions graph
            x = torch.randn(shape)
            torch.testing.assert_close(whole(x), model(x), rtol=1e-4, atol=1e-5)
        assert len(eager_calls) == 2
        # Another dtype or rank: never the compiled code.
        assert not region.shapes((torch.randn(2, 5, 16, dtype=torch.float64),))
        assert not region.shapes((torch.randn(2, 5, 16, 1),))
    # Saved and loaded: the generated code is gone, the guards' expression stays.
    import pickle

    hook.remove()
    loaded = pickle.loads(pickle.dumps(whole))
    kept = loaded.get_submodule(inductor_regions.WHOLE_NAME)
    assert kept.compiled is None and kept.shapes.expression == region.shapes.expression
    x = torch.randn(3, 9, 16)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-4, atol=1e-5)
