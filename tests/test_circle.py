"""fxopt.circle end to end: zoo models in onert, layout (transpose counts), builder details,
config, dynamic shapes, errors, and the ``fxopt convert`` command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from circle_schema.v0_10.circle.Model import Model, ModelT
from torch import nn

from fxopt import circle, zoo
from fxopt.circle.converter import example_outputs
from fxopt.circle.runtime import litert_available, onert_available
from fxopt.cli import main
from fxopt.errors import UnsupportedOpError, UserInputError

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
needs_litert = pytest.mark.skipif(not litert_available(), reason="LiteRT is not installed")


def _parse(data: bytes) -> ModelT:
    return ModelT.InitFromObj(Model.GetRootAsModel(data, 0))


# Small configs: the whole zoo converts and runs in seconds.
ZOO = {
    "mlp": "mlp",
    "cnn_bn": "cnn_bn",
    "resnet18": "resnet18?image=32",
    "mobilenet_v2": "mobilenet_v2?image=32&width=0.5",
    "bert": "bert?config=tiny&seq=8",
    "gpt": "gpt?config=tiny&seq=8",
}


@pytest.fixture(scope="module")
def converted():
    """Each zoo model converted once for the tests below."""
    out = {}
    for key, spec in ZOO.items():
        name, options = zoo.parse_spec(spec)
        entry = zoo.create(name, **options)
        out[key] = (entry, circle.convert(entry.model, entry.example_inputs))
    return out


@needs_onert
@pytest.mark.parametrize("key", sorted(ZOO))
def test_zoo_model_matches_torch_in_onert(converted, key):
    entry, model = converted[key]
    expected = example_outputs(entry.model, entry.example_inputs)
    result = circle.validate(model, entry.example_inputs, expected, rtol=1e-4, atol=1e-4)
    assert result.validated, result.message
    assert result.max_abs_error < 1e-4


@pytest.mark.parametrize("key", ["cnn_bn", "resnet18", "mobilenet_v2"])
def test_cnn_has_transposes_only_at_the_boundary(converted, key):
    _, model = converted[key]
    # One TRANSPOSE (the NCHW input); the NHWC → flatten point is a RESHAPE, because only
    # size-1 dims move after the global average pool.
    assert model.transposes == 1, model.op_counts
    counts = model.op_counts
    assert "RELU" not in counts and "RELU6" not in counts  # fused into CONV_2D / ADD
    assert "MUL" not in counts  # BatchNorm folded into the conv weights


def test_naive_layout_wraps_every_conv(converted):
    entry, propagated = converted["resnet18"]
    config = circle.CircleConfig(propagate_nhwc=False)
    naive = circle.convert(entry.model, entry.example_inputs, config=config)
    assert naive.transposes > 20 * propagated.transposes


def test_tied_weights_share_one_buffer(converted):
    entry, model = converted["gpt"]
    tied = entry.model.lm_head.weight
    assert tied.data_ptr() == entry.model.wte.weight.data_ptr()
    size = tied.numel() * tied.element_size()
    parsed = _parse(model.bytes)
    same_size = [b for b in parsed.buffers if b.data is not None and len(b.data) == size]
    assert len(same_size) == 1
    users = [
        t for t in parsed.subgraphs[0].tensors if t.buffer == parsed.buffers.index(same_size[0])
    ]
    assert len(users) == 1  # one tensor for both the GATHER and the FULLY_CONNECTED


def test_operator_codes_above_127_clamp_the_deprecated_field(converted):
    _, model = converted["bert"]
    codes = {c.builtinCode: c.deprecatedBuiltinCode for c in _parse(model.bytes).operatorCodes}
    assert codes[150] == 127  # GELU
    assert all(dep == min(code, 127) for code, dep in codes.items())


def test_file_has_signature_and_aligned_buffers(converted, tmp_path):
    _, model = converted["mlp"]
    path = model.save(tmp_path / "mlp.circle")
    data = path.read_bytes()
    assert data[4:8] == b"CIR0"
    parsed = _parse(data)
    signature = parsed.signatureDefs[0]
    assert signature.signatureKey == b"serving_default"
    assert [t.name for t in signature.inputs] == [n.encode() for n in model.input_names]
    assert parsed.buffers[0].data is None  # the empty sentinel
    assert "FULLY_CONNECTED" in model.summary()


def test_constants_the_passes_made_move_into_the_file():
    # A weight numpy computed (fold-affine's scaled weights) is not held beside the file:
    # its tensor reads the file's copy. The model's own weights (torch views) stay theirs.
    from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT

    from fxopt.circle.build import build_file
    from fxopt.circle.graph import CircleGraph

    own = torch.randn(3, 4)
    made = np.arange(12, dtype=np.float32).reshape(3, 4) * np.float32(0.5)  # numpy's
    g = CircleGraph()
    x = g.add_tensor("x", (2, 4), np.float32)
    w_model = g.add_tensor("w_model", (3, 4), np.float32, own.numpy(), buffer_key="own")
    w_made = g.add_tensor("w_made", (3, 4), np.float32, made.copy())
    y, z = g.add_tensor("y", (2, 3), np.float32), g.add_tensor("z", (2, 3), np.float32)
    g.add_op("FULLY_CONNECTED", [x, w_model, -1], [y], FullyConnectedOptionsT())
    g.add_op("FULLY_CONNECTED", [x, w_made, -1], [z], FullyConnectedOptionsT())
    g.inputs, g.outputs = [x], [y, z]
    file = build_file(g)
    in_memory = np.frombuffer(file._data, np.uint8)  # the file's own memory
    moved, kept = g.tensors[w_made].data, g.tensors[w_model].data
    np.testing.assert_array_equal(moved, made)
    assert np.shares_memory(moved, in_memory)
    assert np.shares_memory(kept, own.numpy())  # read where it lies, not moved
    parsed = _parse(file.read())
    buffers = [parsed.buffers[t.buffer].data for t in parsed.subgraphs[0].tensors[1:3]]
    assert buffers[0].tobytes() == own.numpy().tobytes()
    assert buffers[1].tobytes() == made.tobytes()
    assert not np.shares_memory(kept, in_memory)


@needs_onert
def test_a_folded_llama_style_norm_moves_into_the_file_and_validates():
    # RMSNorm-style γ before two linears: fold-affine scales both weights (numpy-made);
    # they move into the file, and the file still runs to torch's answer on a new input.
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(torch.rand(16) + 0.5)
            self.q, self.k = nn.Linear(16, 8), nn.Linear(16, 8)

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gamma
            return self.q(h) + self.k(h)

    model = Block().eval()
    converted = circle.convert(model, (torch.randn(2, 16),))
    assert converted.validation.validated
    folds = [p for p in converted.report["passes"] if p["name"] == "fold-affine"]
    assert folds and folds[0]["stats"]["folded"] == 1  # γ into both weights
    other = torch.randn(2, 16) * 3
    with torch.no_grad():
        result = circle.validate(converted, (other,), [model(other)], rtol=1e-4, atol=1e-4)
    assert result.validated, result.message


@needs_litert
def test_external_buffers_hold_offsets_into_the_file_and_validate_in_litert(tmp_path):
    # The form a file over 2 GiB takes: weights after the FlatBuffer. onert 0.1.0 cannot
    # read it; its LiteRT twin (TFL3, version 3, the same offsets' layout) is run instead.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    config = circle.CircleConfig(external_buffer_threshold=0)
    converted = circle.convert(model, (torch.randn(2, 4),), config=config)
    assert converted.validation.validated and converted.validation.runtime == "litert"
    assert "offset buffers" in converted.validation.message
    assert not converted.file.in_memory  # written to disk weight by weight
    parsed = _parse(converted.bytes)
    external = [b for b in parsed.buffers[1:]]
    assert all(b.data is None and b.offset > 0 for b in external)
    weight = next(b for b in external if b.size == 8 * 4 * 4)
    stored = np.frombuffer(converted.bytes[weight.offset : weight.offset + weight.size], np.float32)
    np.testing.assert_array_equal(stored, model[0].weight.detach().numpy().reshape(-1))
    other = torch.randn(2, 4)
    with torch.no_grad():
        result = circle.validate(converted, (other,), [model(other)])
    assert result.validated and result.runtime == "litert"
    saved = converted.save(tmp_path / "big.circle")
    assert saved.read_bytes() == converted.bytes
    without_twin = circle.CircleModel(converted.bytes, converted.operators, report=converted.report)
    result = circle.validate(without_twin, (other,), [model(other)])
    assert result.message.startswith("converted, not validated: onert 0.1.0 cannot read offset")


@needs_onert
def test_dynamic_batch_is_minus_one_in_the_signature_and_runs():
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU()).eval()
    batch = torch.export.Dim("batch")
    converted = circle.convert(model, (torch.randn(3, 4),), dynamic_shapes=({0: batch},))
    tensor = (
        _parse(converted.bytes).subgraphs[0].tensors[_parse(converted.bytes).subgraphs[0].inputs[0]]
    )
    assert list(tensor.shapeSignature) == [-1, 4]
    x = (torch.randn(5, 4),)
    assert circle.validate(converted, x, example_outputs(model, x)).validated


class FixedBatch(nn.Module):
    def forward(self, x):
        return x.reshape(3, 4) * 2


def test_dynamic_dim_that_the_model_fixes_is_an_error():
    batch = torch.export.Dim("batch")
    with pytest.raises(circle.DynamicShapeError, match="marked dynamic"):
        circle.convert(FixedBatch().eval(), (torch.randn(3, 4),), dynamic_shapes=({0: batch},))


def test_training_mode_is_an_error_that_says_call_eval():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    with pytest.raises(circle.TrainingModeError, match=r"call model\.eval\(\)"):
        circle.convert(model, (torch.randn(2, 4),))


class TwoUnsupported(nn.Module):
    def forward(self, x, y):
        a = torch.atan2(x, y)
        b = torch.atan2(y, x)
        return a + b + torch.sort(x).values


def test_unsupported_ops_are_all_listed_with_counts_and_source_lines():
    with pytest.raises(circle.UnsupportedOpsError) as info:
        circle.convert(TwoUnsupported().eval(), (torch.randn(3), torch.randn(3)))
    error = info.value
    assert isinstance(error, UnsupportedOpError) and isinstance(error, UserInputError)
    by_op = {u.op: u for u in error.unsupported}
    assert set(by_op) == {"atan2", "sort"}
    assert by_op["atan2"].count == 2 and by_op["sort"].count == 1
    assert by_op["atan2"].where.endswith(f"test_circle.py:{_line_of('torch.atan2(x, y)')}")
    assert "atan2 ×2" in str(error) and "sort ×1" in str(error)
    assert "add" not in by_op  # downstream of a failure: not a separate problem


class ChainedUnsupported(nn.Module):
    """Two unknown ops in a chain: the second reads the first through a supported op."""

    def forward(self, x):
        return torch.erf(torch.relu(torch.atan(x))) * 2


def test_unsupported_ops_in_a_chain_are_all_listed():
    with pytest.raises(circle.UnsupportedOpsError) as info:
        circle.convert(ChainedUnsupported().eval(), (torch.randn(3),))
    by_op = {u.op: u for u in info.value.unsupported}
    assert set(by_op) == {"atan", "erf"}, by_op  # relu and mul follow: not listed
    assert all(u.reason == "no Circle lowering" for u in by_op.values())


def _line_of(code: str) -> int:
    with open(__file__) as file:
        return next(i for i, line in enumerate(file, 1) if code in line and "def " not in line)


def test_unknown_config_key_is_an_error(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("version: 1\nfuse_activation: false\n")
    with pytest.raises(circle.ConfigError, match="did you mean 'fuse_activations'"):
        circle.load_config(path)
    with pytest.raises(circle.ConfigError, match="version 2"):
        circle.CircleConfig.from_dict({"version": 2})
    with pytest.raises(circle.ConfigError, match="must be bool"):
        circle.CircleConfig.from_dict({"fold_bn": "yes"})


def test_config_toggles_change_the_pipeline():
    model = zoo.create("cnn_bn").model
    x = (torch.randn(1, 3, 16, 16),)
    plain = circle.convert(
        model, x, config=circle.CircleConfig(fold_bn=False, fuse_activations=False)
    )
    assert "RELU" in plain.op_counts and "MUL" in plain.op_counts  # BN lowered, not folded
    assert [p["name"] for p in plain.report["passes"]] == [
        "remove-nops",
        "fold-constants",
        "cse",
        "dce",
        "fold-affine",
        "merge-concatenations",
        "merge-reshapes",
        "share-duplicates",
        "skip-reshapes-into-fc",
        "broadcast-past-reshapes",
        "remove-dead-ops",
        "copy-aliased-outputs",
    ]


def test_missing_pt2_file_is_a_user_error(tmp_path):
    with pytest.raises(UserInputError, match="PT2 file not found"):
        circle.convert_from_pt2(tmp_path / "missing.pt2")


def test_convert_from_exported_program_matches_convert():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = (torch.randn(2, 4),)
    ep = torch.export.export(model, x)
    assert circle.convert_from_exported_program(ep).operators == circle.convert(model, x).operators


@needs_onert
def test_cli_convert_json(tmp_path, capsys):
    out = tmp_path / "cnn.circle"
    code = main(["convert", "zoo:cnn_bn?image=16", "-o", str(out), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in (
        "output",
        "bytes",
        "operators",
        "op_counts",
        "validated",
        "max_abs_error",
        "time_ms",
    ):
        assert key in report
    assert report["validated"] is True and out.stat().st_size == report["bytes"]
    assert report["runtime"] == "onert" and "validate" in report["stages_ms"]


def test_cli_errors_exit_2_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nope: 1\n")
    assert main(["convert", "zoo:mlp", "-o", str(tmp_path / "m.circle"), "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'nope'" in err and "Traceback" not in err
    missing = str(tmp_path / "missing.yaml")
    assert main(["convert", "zoo:mlp", "-o", str(tmp_path / "m.circle"), "--config", missing]) == 2


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_cli_wrong_input_shape_is_one_line_naming_the_op(tmp_path, capfd):
    out = str(tmp_path / "m.circle")
    assert main(["convert", "zoo:mlp", "--input", "1x3x5", "-o", out]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "aten.addmm on float32[256], float32[3, 5], float32[784, 256]" in line
    assert "module 'fc1' (Linear)" in line and "control flow" not in line


def test_cli_int64_example_into_a_float_model_is_a_user_error(tmp_path, capfd):
    from tests.models import mistakes

    out = tmp_path / "m.circle"
    assert main(["convert", f"{mistakes.SPEC}:int64_into_float", "-o", str(out)]) == 2
    assert "int64[2, 4]" in _one_line(capfd.readouterr().err)
    assert not out.exists()  # export accepted it: without the check a broken file was written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_becomes_a_float32_file_with_a_note(dtype):
    from tests.models import mistakes

    model, (x,) = mistakes.bfloat16_model()
    model, x = model.to(dtype), x.to(dtype)
    weight = model[0].weight
    converted = circle.convert(model, (x,))
    assert converted.validation.validated and converted.op_counts == {
        "FULLY_CONNECTED": 1
    }  # (ReLU fused)
    name = str(dtype).removeprefix("torch.")
    assert converted.report["widened_from"] == name
    assert any(
        f"the model is {name}: the file computes in float32" in n for n in converted.report["notes"]
    )
    # The user's model is untouched, and the file computes what its float32 copy does.
    assert model[0].weight is weight and weight.dtype == dtype
    other = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.relu(other @ weight.float().T + model[0].bias.float())
    got = torch.from_numpy(converted.run(other)[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_float64_input_is_refused():
    from tests.models import mistakes

    model, inputs = mistakes.bfloat16_model()
    with pytest.raises(UserInputError, match="input 0 is float64"):
        circle.convert(model.float(), (inputs[0].double(),))


def test_cli_binary_config_is_a_user_error(tmp_path, capfd):
    config = tmp_path / "config.yaml"
    config.write_bytes(bytes(range(128, 256)))  # not UTF-8
    out = str(tmp_path / "m.circle")
    assert main(["convert", "zoo:mlp", "-o", out, "--config", str(config)]) == 2
    assert "is not a text file" in _one_line(capfd.readouterr().err)
    with pytest.raises(circle.ConfigError, match="not a text file"):
        circle.load_config(config)


@pytest.mark.parametrize("where", ["folder_is_a_file", "a_directory"])
def test_cli_unwritable_output_fails_before_converting(where, tmp_path, capfd):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    out = blocker / "m.circle" if where == "folder_is_a_file" else tmp_path
    # A spec that could not even be loaded: the path check must come first.
    assert main(["convert", "zoo:no_such_model", "-o", str(out)]) == 2
    assert _one_line(capfd.readouterr().err).startswith(f"fxopt: error: -o {out}:")


def test_dump_after_a_circle_pass_and_after_lowering():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval()
    x = (torch.randn(2, 4),)
    lowered = circle.convert(model, x, dump_after="lower").report["dumps"]["lower"]
    fused = circle.convert(model, x, dump_after="fuse-activations").report["dumps"]
    assert "= RELU(" in lowered and "fused" not in lowered
    assert "fused=RELU" in fused["fuse-activations"] and "= RELU(" not in fused["fuse-activations"]


class _LinearAndItsRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 8)

    def forward(self, x):
        h = self.fc(x)
        return h, torch.relu(h)


def test_the_report_says_why_an_activation_was_not_fused():
    from fxopt.report import explain

    report = circle.convert(_LinearAndItsRelu().eval(), (torch.randn(2, 4),)).report
    lines = [line for line in explain(report) if line.startswith("fuse-activations")]
    assert len(lines) == 1 and "inside the match is returned" in lines[0]


def test_cli_explain_lists_the_circle_passes_skips(tmp_path, capfd):
    spec = "zoo:mlp"
    out = str(tmp_path / "m.circle")
    assert main(["convert", spec, "-o", out, "--explain"]) == 0
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert "skipped site" in text or "no site was skipped" in text


def test_cli_unknown_dump_after_lists_the_valid_names(tmp_path, capfd):
    out = str(tmp_path / "m.circle")
    assert main(["convert", "zoo:no_such_model", "-o", out, "--dump-after", "bogus"]) == 2
    line = _one_line(capfd.readouterr().err)
    assert "'bogus'" in line and "valid names: decompose, quantized-weights, remove-nops" in line
    assert (
        "lower, fuse-activations, fold-affine, propagate-quantization, quantize-operators" in line
    )
    model = nn.Linear(4, 2).eval()
    with pytest.raises(UserInputError, match="cse: false"):
        circle.convert(
            model, (torch.randn(1, 4),), config=circle.CircleConfig(cse=False), dump_after="cse"
        )


class ScaledSum(nn.Module):
    """Non-tensor arguments of every kind, and non-tensor outputs."""

    def forward(self, x, scale: float, dim: int, shift: bool = True, bias=None):
        out = (x * scale).sum(dim)
        if shift:
            out = out + 1
        if bias is not None:
            out = out + bias
        return out, None, dim


@needs_onert
def test_non_tensor_arguments_are_baked_in_and_reported():
    model = ScaledSum().eval()
    x = torch.randn(2, 3, 4)
    converted = circle.convert(model, (x, 2.5, 1, True, None))
    assert converted.report["baked_inputs"] == {
        "scale": "2.5",
        "dim": "1",
        "shift": "True",
        "bias": "None",
    }
    assert converted.report["constant_outputs"] == {1: "None", 2: "1"}
    # the int output is a constant scalar output of the file; None is left out
    assert converted.input_names == ["x"] and len(converted.output_names) == 2
    assert "baked in (not inputs of the file): scale=2.5" in converted.summary()
    assert converted.validation.validated, converted.validation.message
    other = torch.randn(2, 3, 4) * 3  # another value of the tensor input: same file
    np.testing.assert_allclose(
        converted.run(other)[0], model(other, 2.5, 1)[0].numpy(), rtol=1e-5, atol=1e-5
    )
    # Other baked values are another file: the one above keeps 2.5 and dim 1.
    assert circle.convert(model, (x, -1.0, 2, False, None)).operators == ["MUL", "SUM", "RESHAPE"]


def test_a_model_returning_no_tensor_is_refused():
    class Shape(nn.Module):
        def forward(self, x):
            return x.shape[0]

    with pytest.raises(UnsupportedOpError, match="the model returns no tensor"):
        circle.convert(Shape().eval(), (torch.randn(2, 3),))


def _wrong_relu(monkeypatch):
    """Make the relu lowering emit TANH: a converter bug the validation must catch."""
    from fxopt.circle import layout
    from fxopt.circle.lower import LOWERINGS, Lowering, elementwise

    monkeypatch.setitem(LOWERINGS, "relu", Lowering(elementwise.unary("TANH"), layout.FOLLOWS))


@needs_onert
def test_a_file_that_differs_from_torch_is_an_error_not_a_file(monkeypatch, tmp_path, capsys):
    _wrong_relu(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).eval()
    with pytest.raises(circle.CircleValidationError, match="does not match PyTorch") as raised:
        circle.convert(model, (torch.randn(2, 4),))
    assert raised.value.validation.runtime == "onert"
    assert raised.value.validation.max_abs_error > 0.01
    assert "further from a float64 run than eager float32 is" in str(raised.value)
    out = tmp_path / "m.circle"
    assert main(["convert", "zoo:mlp", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "CircleValidationError" in err and "Traceback" not in err
    assert not out.exists()
    # Asked not to validate: the (wrong) file is written, and says it was not checked.
    assert main(["convert", "zoo:mlp", "-o", str(out), "--no-validate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert out.exists() and report["validated"] is None
    assert report["validation"] == "not requested"


class ValueGate(nn.Module):
    """Right on any input whose first value is positive; a lowering that baked the
    example's branch in would pass the example and fail elsewhere."""

    def forward(self, x):
        return torch.where(x > 0, x * 2, x - 1)


@needs_onert
def test_validation_runs_a_second_input_with_other_values():
    from fxopt.ir.sampling import other_values

    ids = torch.tensor([[1, 2, 3]])
    x = torch.full((2, 3), 0.5)
    again = other_values([x, ids, 2.0])
    assert again[0].shape == x.shape and not torch.equal(again[0], x)
    assert again[1] is ids and again[2] == 2.0  # ids and non-tensors keep their meaning
    assert (again[0] < 0).any()  # a constant example still gets both signs
    converted = circle.convert(ValueGate().eval(), (x,))
    assert converted.validation.validated


class KVCache(nn.Module):
    """Writes its buffer in place (an index assignment at a baked-in position)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keys", torch.zeros(1, 8, 4))

    def forward(self, x, position: int):
        self.keys[:, position : position + 2] = x
        return self.keys.sum(1)


@needs_onert
def test_buffer_writes_are_functionalized_and_reported():
    model = KVCache().eval()
    x = torch.randn(1, 2, 4)
    converted = circle.convert(model, (x, 3))
    assert converted.report["state_writes"] == ["keys"]
    assert converted.report["baked_inputs"] == {"position": "3"}
    assert "CONCATENATION" in converted.op_counts
    assert converted.validation.validated, converted.validation.message
    assert torch.equal(model.keys, torch.zeros(1, 8, 4))  # the user's model is not touched
    other = torch.randn(1, 2, 4)  # the file computes one call from the buffer at conversion
    expected = KVCache().eval()(other, 3)
    np.testing.assert_allclose(converted.run(other)[0], expected.numpy(), atol=1e-6)


class WritesItsInput(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


def test_writing_into_an_input_is_a_clear_error():
    x = torch.randn(2, 3)
    before = x.clone()
    with pytest.raises(UserInputError, match="writes into its input 'x' in place"):
        circle.convert(WritesItsInput().eval(), (x,))
    assert torch.equal(x, before)  # the example input is not written either


def test_supported_ops_match_the_documented_list():
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "circle.md").read_text()
    section = text.split("## Supported ops", 1)[1].split("\n## ", 1)[0]
    bullets = section[section.index("\n- ") :].split("\n\n", 1)[0]  # the list itself
    documented = set(re.findall(r"`([a-z_0-9]+)`", bullets))
    documented -= {"instance_norm"}  # named as what batch_norm covers, not an op of its own
    assert documented == set(circle.supported_ops())


@needs_onert
def test_a_large_file_goes_to_disk_and_is_validated_from_there(monkeypatch, tmp_path):
    from fxopt.circle import converter

    monkeypatch.setattr(converter, "SPILL_BYTES", 0)  # every file is "large"
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 2)).eval()
    converted = circle.convert(model, (torch.randn(3, 6),))
    assert converted.validation.validated and converted.validation.runtime == "onert"
    assert not converted.file.in_memory
    saved = converted.save(tmp_path / "model.circle")
    assert saved.read_bytes() == converted.bytes and converted.nbytes == saved.stat().st_size
    other = torch.randn(3, 6)  # other values (the file's shapes are the example's)
    with torch.no_grad():
        expected = model(other).numpy()
    np.testing.assert_allclose(converted.run(other)[0], expected, rtol=1e-5, atol=1e-6)
    report = converted.report["memory"]
    assert {"export", "build", "validate"} <= set(report["phases_peak_bytes"])
