"""Weight-only quantization in ggml's block formats (fxopt.quant.ggml): the blocks follow
ggml's rounding, files with them validate in onert against the quantized model, the
per-kernel check catches a kernel that computes something else, and bad requests are clear
errors."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from fxopt.circle import CircleConfig, convert
from fxopt.circle.ggml_check import check_ggml_kernels, ggml_operators
from fxopt.errors import UserInputError
from fxopt.quant.ggml import GGMLLinear, pack, round_input, unpack, weight_only

pytest.importorskip("onert")


def test_q8_0_rounds_halves_away_from_zero_as_ggml_does():
    block = torch.zeros(1, 32)
    block[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: exact halves
    q = unpack(pack(block, "q8_0"), "q8_0", 1, 32)
    assert q[0, :4].tolist() == [127.0, 1.0, 2.0, -3.0]
    assert pack(block, "q8_0").numel() == 34


def test_q4_0_maps_the_largest_magnitude_to_minus_8_and_packs_low_nibbles_first():
    block = torch.zeros(1, 32)
    block[0, 0], block[0, 1], block[0, 16], block[0, 17] = -8.0, 7.6, 3.0, -0.5
    packed = pack(block, "q4_0")
    assert packed.numel() == 18
    assert packed[2].item() == (0 & 0xF) | ((3 + 8) << 4)  # element 0 low, element 16 high
    # 7.6 clamps to the top of the grid; -0.5 rounds up to 0 (ggml's +8.5, then truncation).
    assert unpack(packed, "q4_0", 1, 32)[0, [0, 1, 16, 17]].tolist() == [-8.0, 7.0, 3.0, 0.0]


def test_the_input_is_rounded_as_onerts_kernel_does_halves_to_even():
    # measured in onert: with amax 127 (scale 1), 2.5 → 2, -2.5 → -2, 3.5 → 4, 0.5 → 0
    x = torch.zeros(1, 32)
    x[0, :5] = torch.tensor([127.0, 2.5, -2.5, 3.5, 0.5])
    assert round_input(x)[0, :5].tolist() == [127.0, 2.0, -2.0, 4.0, 0.0]


@pytest.mark.parametrize(("kind", "steps"), [("q8_0", 0.57), ("q4_0", 1.0)])
def test_packing_errs_by_at_most_a_step(kind, steps):
    # q8_0: half a step, plus the float16 scale's rounding times up to 127 steps; q4_0: a
    # whole step where the grid's top (7 steps) clamps values up to 8 steps the other way.
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))
    back = unpack(pack(w, kind), kind, 16, 96)
    blocks = w.reshape(16, 3, 32)
    step = blocks.abs().amax(-1, keepdim=True) / (127 if kind == "q8_0" else 8)
    error = (back.reshape(16, 3, 32) - blocks).abs()
    assert bool((error <= step * steps).all())
    x = torch.randn(5, 96)
    assert torch.allclose(round_input(x), x, atol=float(x.abs().max()) / 127)


def mlp(bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=bias),
        torch.nn.ReLU(),
        torch.nn.Linear(96, 32, bias=bias),
        torch.nn.GELU(),
        torch.nn.Linear(32, 8),
    ).eval()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 64), (2, 5, 64)], ids=["rank2", "rank3"])
def test_a_packed_model_validates_in_onert_on_other_inputs_too(kind, bias, shape):
    model = mlp(bias)
    quantized, report = weight_only(model, kind)
    assert report["replaced"] == 3
    x = torch.randn(shape)
    circle = convert(quantized, (x,))
    assert circle.validation.validated, circle.validation.message
    assert len(ggml_operators(circle.graph)) == 3
    other = torch.randn(shape, generator=torch.Generator().manual_seed(7)) * 4
    got = circle.run(other)[0]
    expected = quantized(other).detach().numpy()
    # End to end within a rounding step's effect; each kernel exactly ggml's arithmetic.
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()
    found = check_ggml_kernels(circle.graph, [other.numpy()])
    assert found.passed, found.failures
    # The file computes the quantized model, not the float one.
    assert np.abs(got - model(other).detach().numpy()).max() > np.abs(got - expected).max()


def test_an_activation_is_not_fused_into_a_ggml_kernel():
    # measured: onert's kernel for ggml weights ignores a fused RELU (the file was wrong by
    # 1.49 while each kernel matched the arithmetic without the activation)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96, bias=False), torch.nn.ReLU(), torch.nn.Linear(96, 32, bias=False)
    ).eval()
    circle = convert(weight_only(model, "q8_0")[0], (torch.randn(4, 64),))
    assert circle.op_counts.get("RELU") == 1
    assert circle.validation.validated


def test_the_kernel_check_fails_a_kernel_that_computes_something_else():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).eval()
    x = torch.randn(4, 64)
    circle = convert(weight_only(model, "q4_0")[0], (x,))
    graph = copy.deepcopy(circle.graph)
    (fc,) = [graph.operators[i] for i in ggml_operators(graph)]
    from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType

    # The file now says RELU; onert's kernel does not apply it, so it no longer computes
    # what the file states.
    fc.options.fusedActivationFunction = ActivationFunctionType.RELU
    found = check_ggml_kernels(graph, [x.numpy()])
    assert not found.passed and "FULLY_CONNECTED" in found.failures[0]
    assert check_ggml_kernels(circle.graph, [x.numpy()]).passed


def test_weight_only_copies_only_what_it_packs_and_says_what_stayed_float():
    shared = torch.nn.Linear(64, 64)
    model = torch.nn.Sequential(
        shared, torch.nn.ReLU(), shared, torch.nn.Linear(64, 30), torch.nn.Linear(30, 4)
    ).eval()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    quantized, report = weight_only(model, "q8_0")
    assert report["replaced"] == 2  # the shared layer once, then Linear(64, 30)
    assert quantized[0] is quantized[2] and isinstance(quantized[0], GGMLLinear)
    assert report["left_float"] == {"4": "input size 30 is not a multiple of 32"}
    assert quantized[4] is model[4]  # shared, not copied
    assert quantized[0].bias is shared.bias
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    assert all(type(m) is torch.nn.Linear for m in (model[0], model[3], model[4]))
    assert report["packed_bytes"] == (64 * 64 + 30 * 64) // 32 * 34


def test_bad_requests_are_clear_errors():
    with pytest.raises(UserInputError, match="unknown weight-only format 'q5_0'"):
        weight_only(mlp(True), "q5_0")
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    with pytest.raises(UserInputError, match="no linear layer can be packed"):
        convert(conv, (torch.randn(1, 3, 8, 8),), config=CircleConfig(weight_only="q8_0"))
    with pytest.raises(UserInputError, match="exclude each other"):
        convert(
            mlp(True),
            (torch.randn(2, 64),),
            config=CircleConfig(weight_only="q8_0", quantize="uint8"),
        )


def test_cli_writes_a_weight_only_file_with_its_accuracy(tmp_path, capsys):
    from fxopt.cli import main

    out = tmp_path / "llama.circle"
    assert main(["convert", "zoo:llama", "-o", str(out), "--weight-only", "q8_0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    section = data["weight_only"]
    assert data["validated"] and section["kind"] == "q8_0" and section["replaced"] > 0
    assert section["packed_bytes"] * 3 < section["float_bytes"]
    assert min(section["vs_float"]["sqnr_db"]) > 25
    assert out.stat().st_size > section["packed_bytes"]
