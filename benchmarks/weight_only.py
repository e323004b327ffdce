"""Weight-only quantization of a language model for onert: fxopt's ggml files (q8_0, q4_0)
against TICO 0.3.0's weight-only path (uint8 and uint4 per-channel weights, activations
left float), same models, same run.

Models: transformers' Llama (random weights), a prefill of 16 tokens returning the logits:
``small`` (hidden 128, 2 layers, vocabulary 1000) and ``medium`` (hidden 512, 4 layers,
vocabulary 8000). Per model and tool:

    fxopt q8_0 / q4_0    convert(model, config=CircleConfig(weight_only=...)): validated in
                         onert against the quantized model it computes
    TICO uint8 / uint4   prepare(PTQConfig(activation=no_quant(), weight=affine(uint8|4),
                         strict_wrap=False)) → one forward (weights need no calibration) →
                         convert → tico.convert

Measured: whether onert loads and runs the file, the file's size against the float file's
(fxopt's float conversion), the SQNR of the logits against the float model on 8 held-out
prompts (from onert where it runs the file, else from the tool's PyTorch model, marked),
and onert's latency against the float file's. Writes results/weight_only.json.

    python benchmarks/weight_only.py [--models small,medium]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from common import RESULTS, command_line, machine_info, write_json
from fxopt import circle
from fxopt.circle.runtime import Session
from fxopt.quant import sqnr_db

MODELS = {
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1000),
    "medium": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, vocab_size=8000),
}
TOKENS = 16
HELD_OUT = 8
LATENCY_RUNS = 20


class Logits(torch.nn.Module):
    """A causal LM's prefill, returning only the logits (what both converters take)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def llama(size: str) -> tuple[torch.nn.Module, int]:
    import transformers

    config = transformers.LlamaConfig(
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        **MODELS[size],
    )
    torch.manual_seed(0)
    return Logits(transformers.LlamaForCausalLM(config)).eval(), config.vocab_size


def prompts(vocab: int, count: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, TOKENS), generator=generator) for _ in range(count)]


def onert_outputs(data: bytes, batches: list[torch.Tensor]) -> tuple[list[np.ndarray], float]:
    """The file's logits on each batch, and its median latency on the first (ms)."""
    session = Session(data)
    try:
        outputs = [session.run([b.numpy()])[0] for b in batches]
        return outputs, session.latency_ms([batches[0].numpy()], runs=LATENCY_RUNS)
    finally:
        session.close()


def sqnr(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    return round(
        sqnr_db(
            torch.from_numpy(np.concatenate([r.ravel() for r in reference])),
            torch.from_numpy(np.concatenate([g.ravel() for g in got])),
        ),
        2,
    )


def fxopt_row(model, example, held_out, reference, fmt: str) -> dict:
    start = time.perf_counter()
    try:
        converted = circle.convert(model, (example,), config=circle.CircleConfig(weight_only=fmt))
    except Exception as error:
        return {"tool": "fxopt", "format": fmt, "status": f"{type(error).__name__}: {error}"}
    seconds = time.perf_counter() - start
    outputs, latency = onert_outputs(converted.bytes, held_out)
    return {
        "tool": "fxopt",
        "format": fmt,
        "status": "ok",
        "loads_in_onert": True,
        "validated": converted.validation.validated,
        "validation": converted.validation.message,
        "bytes": converted.nbytes,
        "sqnr_db": sqnr(reference, outputs),
        "sqnr_from": "onert",
        "latency_ms": latency,
        "convert_s": round(seconds, 2),
        "packed_layers": converted.report["weight_only"]["replaced"],
    }


def tico_row(model, example, held_out, reference, bits: int) -> dict:
    import tico
    from tico.quantization import convert, prepare
    from tico.quantization.config.ptq import PTQConfig
    from tico.quantization.config.specs import affine, no_quant
    from tico.quantization.wrapq.dtypes import DType

    row = {"tool": "TICO", "format": f"uint{bits}"}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = PTQConfig(
                activation=no_quant(), weight=affine(DType.uint(bits)), strict_wrap=False
            )
            prepared = prepare(copy.deepcopy(model), config)
            with torch.no_grad():
                prepared(example)  # weights need no calibration; this fills their observers
            quantized = convert(prepared).eval()
            exported = tico.convert(quantized, (example,))
    except Exception as error:
        return row | {"status": f"{type(error).__name__}: {str(error)[:200]}"}
    seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tico.circle")
        exported.save(path)
        data = Path(path).read_bytes()
    with torch.no_grad():
        torch_outputs = [quantized(b).numpy() for b in held_out]
    row |= {"status": "ok", "bytes": len(data), "convert_s": round(seconds, 2)}
    try:
        outputs, latency = onert_outputs(data, held_out)
        row |= {"loads_in_onert": True, "sqnr_db": sqnr(reference, outputs)}
        row |= {"sqnr_from": "onert", "latency_ms": latency}
    except Exception as error:
        row |= {"loads_in_onert": False, "onert_error": str(error)[:200]}
        row |= {"sqnr_db": sqnr(reference, torch_outputs), "sqnr_from": "TICO's PyTorch model"}
    row["torch_model_sqnr_db"] = sqnr(reference, torch_outputs)
    return row


def measure(size: str) -> dict:
    model, vocab = llama(size)
    example = prompts(vocab, 1, 0)[0]
    held_out = prompts(vocab, HELD_OUT, 1)
    with torch.no_grad():
        reference = [model(b).numpy() for b in held_out]
    float_file = circle.convert(model, (example,))
    _, float_latency = onert_outputs(float_file.bytes, held_out[:1])
    rows = [fxopt_row(model, example, held_out, reference, fmt) for fmt in ("q8_0", "q4_0")]
    rows += [tico_row(model, example, held_out, reference, bits) for bits in (8, 4)]
    for row in rows:
        if "bytes" in row:
            row["size_vs_float"] = round(row["bytes"] / float_file.nbytes, 3)
        if "latency_ms" in row:
            row["latency_vs_float"] = round(row["latency_ms"] / float_latency, 3)
        print(f"  {size} {row['tool']} {row['format']}: {row}", flush=True)
    return {
        "model": size,
        "description": (
            f"transformers Llama, hidden {MODELS[size]['hidden_size']},"
            f" {MODELS[size]['num_hidden_layers']} layers, vocabulary"
            f" {MODELS[size]['vocab_size']}, GQA 8/2; prefill of {TOKENS} tokens"
        ),
        "float_bytes": float_file.nbytes,
        "float_latency_ms": float_latency,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="small,medium")
    parser.add_argument("--out", default=str(RESULTS / "weight_only.json"))
    args = parser.parse_args(argv)
    try:
        import tico  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        print(f"weight_only: {error} (pip install -e '.[hf,peers]')", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    started = time.perf_counter()
    results = [measure(size) for size in args.models.split(",")]
    write_json(
        Path(args.out),
        {
            "machine": machine_info(),
            "command": command_line(),
            "runtime_s": round(time.perf_counter() - started, 1),
            "models": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
