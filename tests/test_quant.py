"""fxopt.quant: post-training quantization with fxopt's own annotation (CircleQuantizer),
converted to integer Circle files that run in onert, and `fxopt convert --quantize`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fxopt import circle
from fxopt.circle.runtime import (
    LiteRTSession,
    Session,
    litert_available,
    onert_available,
    open_session,
)
from fxopt.cli import main
from fxopt.errors import UserInputError
from tests.quant_models import CASES, Head, _init, pt2e

pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
from fxopt.quant import quantize, sqnr_db
from tests.extras import needs_circle

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
needs_litert = pytest.mark.skipif(not litert_available(), reason="LiteRT is not installed")


def _file_output(result, x: torch.Tensor) -> torch.Tensor:
    with Session(result.bytes) as session:
        (out,) = session.run([x.numpy()])
    return torch.from_numpy(out)


def _converted_case(name: str, scheme: str):
    """(model, example, its quantized graph, the validated file) for a CASES model."""
    make, shape, _ = CASES[name]
    torch.manual_seed(0)
    model, example = _init(make()), torch.randn(shape)
    quantized = quantize(model, (example,), calibration=8, scheme=scheme)
    return model, example, quantized, circle.convert(quantized, (example,))


@needs_onert
@pytest.mark.parametrize("name", CASES)
def test_own_ptq_file_runs_in_onert_as_accurate_as_pt2e_with_xnnpack(name):
    model, example, _, result = _converted_case(name, "uint8")
    make, shape, integer_ops = CASES[name]
    assert result.validation.validated and result.validation.runtime == "onert"
    summary = result.report["quantization"]
    assert integer_ops <= set(summary["quantized_ops"])
    # ReLU / ReLU6 after conv and add are annotated with them: nothing fusable is left float
    assert not {"RELU", "RELU6"} & set(summary["float_ops"])
    other = torch.randn(shape, generator=torch.Generator().manual_seed(5))  # not the example
    with torch.no_grad():
        ours = sqnr_db(model(other), _file_output(result, other))
        reference = sqnr_db(model(other), pt2e(_init(make()), example)(other))
    assert ours > 20.0 and ours >= reference - 1.5, (ours, reference)


@needs_litert
@pytest.mark.parametrize("name", CASES)
@needs_circle
def test_int16_file_is_validated_in_litert_as_accurate_as_its_model(name):
    model, _, quantized, result = _converted_case(name, "int16")
    shape = CASES[name][1]
    # onert 0.1.0 has no int16 kernel: LiteRT checks the file, and the report says why
    assert result.validation.validated and result.validation.runtime == "litert"
    assert "onert cannot run int16" in result.validation.message
    summary = result.report["quantization"]
    assert summary["tensor_dtypes"].get("int16", 0) > 0 and "uint8" not in summary["tensor_dtypes"]
    assert {"CONV_2D", "FULLY_CONNECTED", "DEPTHWISE_CONV_2D"} & set(summary["quantized_ops"])
    other = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    with LiteRTSession(result.bytes) as session:
        (out,) = session.run([other.numpy()])
    with torch.no_grad():
        ours, reference = (
            sqnr_db(model(other), torch.from_numpy(out)),
            sqnr_db(model(other), quantized(other)),
        )
    assert ours >= reference - 1.0 and ours > 40.0, (ours, reference)  # 8 bits give 27-40 dB


@pytest.mark.parametrize(
    "scheme, runtime", [pytest.param("uint8", "onert", marks=needs_onert),
                        pytest.param("int16", "litert", marks=needs_litert)]
)  # fmt: skip
@needs_circle
def test_fixed_range_and_shared_parameter_kernels_run_on_integers(scheme, runtime):
    torch.manual_seed(0)
    model, example = Head().eval(), torch.randn(2, 4, 6, 6)
    result = circle.convert(quantize(model, (example,), scheme=scheme), (example,))
    assert result.validation.validated and result.validation.runtime == runtime
    integer = set(result.report["quantization"]["quantized_ops"])
    assert {"PAD", "AVERAGE_POOL_2D", "MAX_POOL_2D", "CONCATENATION", "MEAN"} <= integer
    assert {"SOFTMAX", "LOGISTIC", "TANH"} <= integer
    assert result.report["quantization"]["float_ops"] == {}
    # a second input with another batch size: the file's batch is fixed, so it is refused
    # by the runtime rather than answered wrongly
    with open_session(result.bytes, runtime) as session, pytest.raises(RuntimeError):
        session.run([torch.randn(3, 4, 6, 6).numpy()])


@needs_onert
def test_per_tensor_weights_give_one_scale_per_weight_and_still_validate():
    make, shape, _ = CASES["depthwise"]
    torch.manual_seed(0)
    model, example = _init(make()), torch.randn(shape)
    config = circle.CircleConfig(quantize="uint8", quantize_weights="per_tensor", calibration=4)
    result = circle.convert(model, (example,), config=config)
    assert result.validation.validated and result.validation.runtime == "onert"
    from circle_schema.v0_10.circle.Model import Model, ModelT

    file = ModelT.InitFromObj(Model.GetRootAsModel(result.bytes, 0))
    weights = [
        t for t in file.subgraphs[0].tensors if t.quantization is not None and t.buffer
        and t.type == 3  # UINT8 constants: the weights
        and file.buffers[t.buffer].data is not None
    ]  # fmt: skip
    assert weights and all(len(t.quantization.scale) == 1 for t in weights)
    per_channel = circle.convert(model, (example,), config=circle.CircleConfig(quantize="uint8"))
    # per-channel scales are at least as accurate (depthwise channels differ in range)
    assert (
        per_channel.report["quantization"]["vs_float"]["sqnr_db"][0]
        >= result.report["quantization"]["vs_float"]["sqnr_db"][0] - 0.5
    )


@needs_circle
def test_quantize_leaves_the_model_unchanged_and_refuses_bad_arguments():
    model = _init(CASES["cnn"][0]())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    quantize(model, (x,), calibration=[(x,), (x * 2,)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    with pytest.raises(UserInputError, match="unknown quantization scheme 'int4'"):
        quantize(model, (x,), scheme="int4")
    with pytest.raises(UserInputError, match="unknown weight granularity 'per_row'"):
        quantize(model, (x,), weights="per_row")
    with pytest.raises(UserInputError, match="no batches"):
        quantize(model, (x,), calibration=[])
    with pytest.raises(UserInputError, match="training mode"):
        quantize(model.train(), (x,))


@needs_onert
def test_cli_convert_quantize_reports_accuracy_and_size(tmp_path, capsys):
    out = tmp_path / "cnn.circle"
    code = main(["convert", "zoo:cnn_bn", "-o", str(out), "--quantize", "uint8", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["validated"] is True
    section = report["quantization"]
    assert section["scheme"] == "uint8" and section["float_ops"] == {}
    assert section["size_vs_float"] < 0.5 and section["vs_float"]["sqnr_db"][0] > 30
    assert section["vs_float"]["top1_agreement"][0] >= 0.9  # zoo:cnn_bn classifies
    assert "CONV_2D" in section["quantized_ops"]
    assert main(["convert", "zoo:cnn_bn", "-o", str(out), "--quantize", "uint8",
                 "--calibration", "0"]) == 2  # fmt: skip
    assert "--calibration must be at least 1" in capsys.readouterr().err
    assert main(["convert", "zoo:cnn_bn", "-o", str(out), "--calibration", "4"]) == 2
    assert "--calibration needs --quantize" in capsys.readouterr().err


@needs_litert
@needs_circle
def test_config_keys_and_a_calibration_file_quantize_as_the_flags_do(tmp_path, capsys):
    (tmp_path / "data.py").write_text(
        "import torch\n"
        "def batches():\n"
        "    g = torch.Generator().manual_seed(3)\n"
        "    return [(torch.randn(2, 3, 32, 32, generator=g),) for _ in range(4)]\n"
    )
    config = tmp_path / "q.yaml"
    config.write_text(f"version: 1\nquantize: int16\ncalibration: {tmp_path}/data.py:batches\n")
    out = tmp_path / "cnn.circle"
    code = main(["convert", "zoo:cnn_bn", "-o", str(out), "--config", str(config), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["validated"] is True and report["runtime"] == "litert"
    assert report["quantization"]["scheme"] == "int16"
    assert "int16" in report["quantization"]["tensor_dtypes"]
    # bad values: one readable line each, exit 2
    config.write_text("version: 1\nquantize: int4\n")
    assert main(["convert", "zoo:cnn_bn", "-o", str(out), "--config", str(config)]) == 2
    assert "must be one of none, uint8, int16, got 'int4'" in capsys.readouterr().err
    config.write_text(f"version: 1\nquantize: uint8\ncalibration: {tmp_path}/data.py:nope\n")
    assert main(["convert", "zoo:cnn_bn", "-o", str(out), "--config", str(config)]) == 2
    assert "has no attribute 'nope'" in capsys.readouterr().err


@needs_onert
def test_integer_arithmetic_on_ids_is_not_quantized():
    class Positions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(2000, 16)  # 128 kB in float: the file's bulk
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, ids):
            return self.fc(self.embed(ids + 1))  # an int64 add: no scale makes sense

    model, ids = Positions().eval(), torch.randint(0, 1999, (2, 5))
    result = circle.convert(quantize(model, (ids,), calibration=[(ids,), (ids.flip(1),)]), (ids,))
    assert result.validation.validated
    # the table is stored as uint8 and looked up on the integers; the linear runs on them
    assert {"GATHER", "CONV_2D"} <= set(result.report["quantization"]["quantized_ops"])
    float_file = circle.convert(model, (ids,), validate=False)
    assert len(result.bytes) < 0.3 * len(float_file.bytes)
    other = torch.randint(0, 1999, (2, 5), generator=torch.Generator().manual_seed(3))
    with Session(result.bytes) as session:
        (out,) = session.run([other.numpy()])
    with torch.no_grad():
        reference = quantize(model, (ids,), calibration=[(ids,), (ids.flip(1),)])(other)
    assert np.max(np.abs(out - reference.numpy())) <= 2 * result.report["output_steps"][0]


@needs_onert
def test_arithmetic_with_a_constant_operand_is_left_in_float_without_rounding():
    class Shifted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.offset = torch.nn.Parameter(torch.randn(8, 1, 1))

        def forward(self, x):
            return (torch.relu(self.conv(x)) - 0.5) * self.offset  # scalar, parameter

    model, x = Shifted().eval(), torch.randn(1, 3, 8, 8)
    result = circle.convert(quantize(model, (x,), calibration=4), (x,))
    summary = result.report["quantization"]
    assert summary["quantized_ops"].get("CONV_2D") == 1
    assert {"SUB", "MUL"} <= set(summary["float_ops"])
    assert summary["quantize_ops"] == 1  # the input's only: no rounding after SUB or MUL


@needs_circle
def test_calibration_that_does_not_fit_the_model_is_a_clear_error():
    model, x = _init(CASES["mlp"][0]()), torch.randn(4, 16)
    with pytest.raises(UserInputError, match="calibration batch 0 does not fit the model"):
        quantize(model, (x,), calibration=[(torch.randn(4, 5),)])
    with pytest.raises(UserInputError, match="not an iterable of batches"):
        quantize(model, (x,), calibration="tests/quant_models.py:MLP")
