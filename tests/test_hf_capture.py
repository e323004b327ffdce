"""Hugging Face models (transformers, from configs: random weights, no downloads): the
default mode="auto" captures them (fx cannot), and GPT-2's failing core-ATen decomposition
falls back to export's own ops. Skipped when transformers is not installed (the ``hf``
extra)."""

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


def test_gpt2_decomposition_failure_keeps_exports_own_ops():
    # torch 2.13: "Cannot view a tensor with shape [s0, 16, 64] and strides (64, 64*s0, 1)"
    result = fxopt.optimize(gpt2(), (torch.randint(0, 100, (2, 16)),), mode="export")
    assert result.report["verified"]
    assert any("core-ATen decomposition failed" in n for n in result.report["notes"])
