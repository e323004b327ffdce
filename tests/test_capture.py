import pytest
import torch
from torch import nn

from fxopt.capture import capture_info, trace
from fxopt.errors import CaptureError, UserInputError
from tests.models.seed import ResNetBlock, SimpleMLP

MODES = ["fx", "export"]


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value
            return x
        return -x


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_trace_matches_eager_and_carries_shapes(mode):
    model = ResNetBlock().eval()
    x = torch.randn(2, 4, 8, 8)
    gm = trace(model, x, mode)
    torch.testing.assert_close(gm(x), model(x))
    compute = [n for n in gm.graph.nodes if n.op.startswith("call")]
    assert compute
    assert all("tensor_meta" in n.meta or "val" in n.meta for n in compute)


def test_fx_keeps_call_module_and_export_lowers_to_aten():
    model, x = SimpleMLP(), torch.randn(3, 32)
    fx_ops = {n.op for n in trace(model, x, "fx").graph.nodes}
    assert "call_module" in fx_ops
    export_gm = trace(model, x, "export")
    targets = [n.target for n in export_gm.graph.nodes if n.op == "call_function"]
    assert all(isinstance(t, torch._ops.OpOverload) or t.__name__ == "getitem" for t in targets)
    assert not any(n.op == "call_module" for n in export_gm.graph.nodes)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_capture_never_mutates_the_model(mode):
    model = ResNetBlock().train()  # training BN would update running stats if run
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = trace(model, torch.randn(2, 4, 8, 8), mode)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    # One copy of the weights: the graph reads the model's storage through tensor objects
    # of its own, so replacing or converting its weights leaves the model alone.
    model_storage = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in gm.parameters()} <= model_storage
    assert not {id(p) for p in gm.parameters()} & {id(p) for p in model.parameters()}
    gm.to(torch.float64)
    for name, p in list(gm.named_parameters()):
        owner, _, attribute = name.rpartition(".")
        setattr(gm.get_submodule(owner), attribute, torch.nn.Parameter(torch.zeros_like(p)))
    assert torch.equal(model.conv1.weight, before["conv1.weight"])
    assert model.conv1.weight.dtype == torch.float32


@pytest.mark.parametrize("mode, other", [("fx", "export"), ("export", "fx")])
def test_untraceable_model_names_the_line_and_suggests_the_other_mode(mode, other):
    with pytest.raises(CaptureError) as info:
        trace(DataDependent(), torch.randn(3), mode)
    message = str(info.value)
    assert "DataDependent" in message
    assert "test_capture.py" in message  # the source line of the construct
    assert f"mode='{other}'" in message


def test_bad_arguments_are_user_errors():
    with pytest.raises(UserInputError, match="unknown capture mode"):
        trace(SimpleMLP(), torch.randn(1, 32), "jit")
    with pytest.raises(UserInputError, match=r"nn\.Module"):
        trace(lambda x: x, torch.randn(1), "fx")
    with pytest.raises(UserInputError, match="example_inputs"):
        trace(SimpleMLP(), "not a tensor", "fx")


def test_export_keeps_equal_example_inputs_apart():
    class Two(nn.Module):
        def forward(self, a, b):
            return a - b * 2

    x = torch.ones(3)
    gm = trace(Two(), (x, x), "export")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == 2
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(a, b), a - b * 2)


def test_decomposition_failure_keeps_the_exported_program(monkeypatch):
    # GPT-2 under torch 2.13: torch.export succeeds and run_decompositions raises ("Cannot
    # view a tensor with shape [2,16,64] and strides (64,128,1)").
    def fails(self, *args, **kwargs):
        raise RuntimeError("Cannot view a tensor with shape [2,16,64]")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", fails)
    model, x = SimpleMLP().eval(), torch.randn(3, 32)
    gm = trace(model, x, "export")
    note = capture_info(gm)["notes"][0]
    assert "core-ATen decomposition failed" in note and "Cannot view" in note
    torch.testing.assert_close(gm(torch.randn(3, 32) * 0), model(torch.zeros(3, 32)))


def test_export_failure_does_not_suggest_fx_when_fx_cannot_capture_either():
    with pytest.raises(CaptureError, match="mode='fx' cannot capture it either"):
        trace(DataDependent(), torch.randn(3), "export")


def test_auto_mode_uses_fx_when_faithful_and_says_so():
    gm = trace(SimpleMLP(), torch.randn(3, 32), "auto")
    assert capture_info(gm)["mode"] == "fx" and capture_info(gm)["requested"] == "auto"


def test_untraceable_by_both_names_both_reasons():
    with pytest.raises(CaptureError, match=r"with fx .* or with export"):
        trace(DataDependent(), torch.randn(3), "auto")


class KeywordOnly(nn.Module):
    def forward(self, *, x):
        return x


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x + y


@pytest.mark.parametrize("mode", MODES)
def test_input_mistakes_are_named_before_capture(mode):
    with pytest.raises(UserInputError, match="keyword-only parameters"):
        trace(KeywordOnly(), torch.randn(3), mode)
    with pytest.raises(UserInputError, match=r"takes 2 inputs \(x, y\), but 1 example"):
        trace(TwoInputs(), torch.randn(3), mode)
    with pytest.raises(UserInputError, match="meta device"):
        trace(SimpleMLP(), torch.randn(2, 32, device="meta"), mode)
    with pytest.raises(CaptureError, match="fails on its example inputs"):
        trace(SimpleMLP(), torch.randn(2, 31), mode)


def test_user_frame_filter_uses_the_package_directory(tmp_path, monkeypatch):
    # A checkout named "fxopt" (git clone's default) put every frame under ".../fxopt/":
    # the filter must use fxopt's own package directory, not the substring.
    import fxopt.capture as capture

    frame_file = tmp_path / "fxopt" / "models" / "mine.py"
    frame_file.parent.mkdir(parents=True)
    frame_file.write_text("def f():\n    raise ValueError('boom')\n")
    namespace: dict = {}
    exec(compile(frame_file.read_text(), str(frame_file), "exec"), namespace)
    try:
        namespace["f"]()
    except ValueError as error:
        assert str(frame_file) in capture._user_frame(error)


def test_auto_capture_keeps_the_models_output_for_verification_unless_its_run_changed_it():
    # The model's run on the example (capture runs it anyway) serves verification, so the
    # model is not called again for it; a run that changed the model's state (a counter
    # buffer) is not kept: a second call would differ. The model itself is left as it was.
    from tests.models.stateful import CountsCalls

    model, x = SimpleMLP(), torch.randn(3, 32)
    cache: dict = {}
    trace(model, x, "auto", _expected_cache=cache)
    (expected,) = cache.values()
    with torch.no_grad():
        torch.testing.assert_close(expected, model(x))
    counting: dict = {}
    counter = CountsCalls().eval()
    trace(counter, torch.randn(1, 3, 8, 8), "auto", _expected_cache=counting)
    assert not counting
    assert int(counter.calls) == 0  # every run of the model was isolated
