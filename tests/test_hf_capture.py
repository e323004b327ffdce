"""Hugging Face models (transformers, from configs: random weights, no downloads): the
default mode="auto" captures them (fx cannot), attention stays one SDPA call, and a failing
core-ATen decomposition falls back to export's own ops. Skipped when transformers is not
installed (the ``hf`` extra)."""

from __future__ import annotations

import pytest
import torch

import fxopt

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        vocab_size=100,
        n_positions=64,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2Model(config).eval()


def t5_encoder():
    config = transformers.T5Config(
        num_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=128, vocab_size=100
    )
    return transformers.T5EncoderModel(config).eval()


def hidden(output) -> torch.Tensor:
    return output["last_hidden_state"] if not isinstance(output, torch.Tensor) else output


@pytest.mark.parametrize("make", [gpt2, t5_encoder], ids=["gpt2", "t5"])
def test_auto_mode_captures_hugging_face_models_and_serves_other_batches(make):
    model = make()
    ids = torch.randint(0, 100, (2, 16))
    result = fxopt.optimize(model, (ids,), benchmark_runs=0)
    report = result.report
    assert report["mode"] == "export" and report["requested_mode"] == "auto"
    assert report["verified"] and report["dynamic"] == ["input_ids.shape[0]"]
    assert any(note.startswith("fx cannot capture it") for note in report["notes"])
    other = torch.randint(0, 100, (5, 16))
    with torch.no_grad():
        torch.testing.assert_close(hidden(result.module(other)), hidden(model(other)))


def test_attention_stays_one_sdpa_call_through_the_core_aten_decomposition():
    # Decomposed, SDPA is two matmuls, a softmax and mask handling (and under torch 2.13
    # its decomposition failed on GPT-2's dynamic batch: "Cannot view a tensor ...").
    model, ids = gpt2(), torch.randint(0, 100, (2, 16))
    # (without the layout step, which may hand back the model itself or compiled code)
    result = fxopt.optimize(model, (ids,), mode="export", benchmark_runs=0, autotune=False)
    assert result.report["verified"]
    assert not any("decomposition failed" in n for n in result.report["notes"])
    gm = result.module
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    assert sum(n.target is sdpa for n in gm.graph.nodes) == 2  # one per layer
    assert not any(n.target is torch.ops.aten._softmax.default for n in gm.graph.nodes)
    other = torch.randint(0, 100, (5, 16))
    with torch.no_grad():  # eager runs the same SDPA: the same answer to the bit
        assert torch.equal(hidden(gm(other)), hidden(model(other)))


def test_a_failing_core_aten_decomposition_keeps_exports_own_ops(monkeypatch):
    def fail(self, *args, **kwargs):
        raise RuntimeError("Cannot view a tensor with shape [s0, 16, 64]")

    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", fail)
    result = fxopt.optimize(gpt2(), (torch.randint(0, 100, (2, 16)),), mode="export")
    assert result.report["verified"]
    assert any("core-ATen decomposition failed" in n for n in result.report["notes"])
