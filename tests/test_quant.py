"""fxopt.quant: post-training quantization with fxopt's own annotation (CircleQuantizer),
converted to integer Circle files that run in onert, and `fxopt convert --quantize`."""

from __future__ import annotations

import json

import pytest
import torch

from fxopt import circle
from fxopt.circle.runtime import Session, onert_available
from fxopt.cli import main
from fxopt.errors import UserInputError
from tests.quant_models import CASES, _init, pt2e

pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
from fxopt.quant import quantize, sqnr_db

needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")


def _file_output(result, x: torch.Tensor) -> torch.Tensor:
    with Session(result.bytes) as session:
        (out,) = session.run([x.numpy()])
    return torch.from_numpy(out)


@needs_onert
@pytest.mark.parametrize("name", CASES)
def test_own_ptq_file_runs_in_onert_as_accurate_as_pt2e_with_xnnpack(name):
    make, shape, integer_ops = CASES[name]
    torch.manual_seed(0)
    model, example = _init(make()), torch.randn(shape)
    quantized = quantize(model, (example,), calibration=8)
    result = circle.convert(quantized, (example,))  # validated against `quantized`
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


def test_quantize_leaves_the_model_unchanged_and_refuses_bad_arguments():
    model = _init(CASES["cnn"][0]())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    quantize(model, (x,), calibration=[(x,), (x * 2,)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not model.training
    with pytest.raises(UserInputError, match="unknown quantization scheme 'int4'"):
        quantize(model, (x,), scheme="int4")
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
    assert section["size_vs_float"] < 0.5 and section["sqnr_db"][0] > 30
    assert "CONV_2D" in section["quantized_ops"]
    assert main(["convert", "zoo:cnn_bn", "-o", str(out), "--quantize", "uint8",
                 "--calibration", "0"]) == 2  # fmt: skip
    assert "--calibration must be at least 1" in capsys.readouterr().err
