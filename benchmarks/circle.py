"""fxopt.circle vs TICO (Samsung's torch → Circle converter) on the same models, same run.

For each model: conversion success and time, operator count, TRANSPOSE count, file size,
onert latency (fxopt / TICO) and max abs error of each Circle file against PyTorch, in onert
or, where onert cannot run the file, in LiteRT (the same rule for both tools), and whether
it validates (rtol = atol = 1e-4). The zoo models, HF BertModel (bert-base), and a set of
third-party architectures from transformers and, where timm is installed (``pip install
--no-deps timm``), timm (benchmarks/circle_models.py). Writes
results/circle.json; benchmarks/make_results.py renders it.

    python benchmarks/circle.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from circle_models import decoder_models, third_party_models, timm_models
from common import RESULTS, command_line, machine_info, write_json
from fxopt import circle, zoo
from fxopt.circle.converter import example_outputs
from fxopt.circle.runtime import LiteRTSession, Session

MODELS = {
    "mlp": "mlp",
    "cnn_bn": "cnn_bn",
    "resnet18": "resnet18?image=64",
    "resnet50": "resnet50?image=64",
    "mobilenet_v2": "mobilenet_v2?image=64",
    "bert": "bert?config=tiny&seq=16",
    "gpt": "gpt?config=tiny&seq=16",
}
DECODERS = {
    f"{family}_{step}": f"llama?family={family}&step={step}&seq=15"
    for family in ("llama", "qwen2", "gemma")
    for step in ("prefill", "decode")
}
QUICK = ("mlp", "cnn_bn", "resnet18", "mobilenet_v2", "bert", "gpt")


class HFBert(torch.nn.Module):
    """transformers' BertModel from the default ``BertConfig()`` (bert-base: 12 layers, hidden
    768, vocab 30522), random weights, with an attention mask."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig()
        torch.manual_seed(0)
        self.bert = BertModel(config, add_pooling_layer=True).eval()

    def forward(self, input_ids, attention_mask):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, out.pooler_output


def hf_bert():
    ids = torch.randint(0, 30522, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    return HFBert().eval(), (ids, mask)


def op_names(data: bytes) -> list[str]:
    from circle_schema.v0_10.circle.BuiltinOperator import BuiltinOperator
    from circle_schema.v0_10.circle.Model import Model, ModelT

    names = {v: k for k, v in vars(BuiltinOperator).items() if not k.startswith("_")}
    model = ModelT.InitFromObj(Model.GetRootAsModel(data, 0))
    codes = [names.get(c.builtinCode, str(c.builtinCode)) for c in model.operatorCodes]
    return [codes[op.opcodeIndex] for op in model.subgraphs[0].operators]


def convert_fxopt(model, inputs) -> bytes:
    # Conversion alone (TICO's convert does not validate); both files run in onert below.
    return circle.convert(model, inputs, validate=False).bytes


def convert_tico(model, inputs) -> bytes:
    import tico

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.circle"
        tico.convert(model, inputs).save(str(path))
        return path.read_bytes()


def measure(tool: str, convert, model, inputs, expected) -> dict:
    row: dict = {"tool": tool}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            data = convert(model, inputs)
    except Exception as error:
        row.update(converted=False, error=error_line(error))
        return row
    ops = op_names(data)
    row.update(
        converted=True,
        convert_s=time.perf_counter() - start,
        operators=len(ops),
        transposes=ops.count("TRANSPOSE"),
        bytes=len(data),
        op_counts=dict(Counter(ops).most_common()),
    )
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    try:
        with Session(data) as session:
            outputs = session.run(tensors)
            row.update(runtime="onert", runs=True, **_compare(outputs, expected))
            row["latency_ms"] = session.latency_ms(tensors, runs=20)
    except Exception as error:
        row.update(runs=False, run_error=error_line(error))
    if not row["runs"]:  # the second runtime, for both tools alike
        try:
            with LiteRTSession(data) as session:
                outputs = session.run(tensors)
            row.update(runtime="litert", runs=True, **_compare(outputs, expected))
        except Exception as error:
            row["litert_error"] = error_line(error)
    row.setdefault("validated", False)
    return row


def error_line(error: BaseException) -> str:
    """``Type: first line of the message``: tracebacks and source paths stay out of the
    results (they name this machine's directories)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _compare(outputs, expected, tol: float = 1e-4) -> dict:
    """Max abs error, and whether every output matches (shape, and values within the
    converter's default rtol = atol = 1e-4)."""
    if len(outputs) != len(expected):
        return {"max_abs_error": None, "validated": False}
    errors, matches, reshaped = [], [], False
    for o, e in zip(outputs, expected):
        e = e.detach().numpy()
        if o.dtype != e.dtype or o.size != e.size:
            errors.append(float("inf"))
            matches.append(False)
            continue
        if o.shape != e.shape:  # the same values in another shape (a squeezed batch dim):
            reshaped = True  # not validated, but its error is still worth knowing
            o = o.reshape(e.shape)
            matches.append(False)
        else:
            matches.append(bool(np.allclose(o, e, rtol=tol, atol=tol)))
        errors.append(float(np.max(np.abs(o.astype(np.float64) - e))) if e.size else 0.0)
    found = {"max_abs_error": max(errors) if errors else None, "validated": all(matches)}
    return found | ({"shape_differs": True} if reshaped else {})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip resnet50")
    parser.add_argument(
        "--no-third-party",
        action="store_true",
        help="skip the Hugging Face architectures (benchmarks/circle_models.py)",
    )
    parser.add_argument(
        "--decoders",
        action="store_true",
        help="only the language models (the zoo's llama, transformers' Llama, Qwen2, "
        "Mistral, Gemma 3; prefill and decode): results/circle_decoders.json",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Warm both converters up (torch.export's first call pays for dynamo's imports), so the
    # first model's conversion time is not charged to whichever tool happens to run first.
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_fxopt(tiny, (torch.randn(1, 4),))
        convert_tico(tiny, (torch.randn(1, 4),))
    started = time.perf_counter()
    rows = []
    cases = [(k, v) for k, v in MODELS.items() if not args.quick or k in QUICK]
    third = {} if args.no_third_party else {**third_party_models(), **timm_models()}
    todo = [*cases, ("hf_bert", None), *((name, name) for name in third)]
    if args.decoders:
        cases = list(DECODERS.items())
        third = decoder_models()
        todo = [*cases, *((name, name) for name in third)]
    for key, spec in todo:
        if key in third:
            model, inputs = third[key]()
        elif spec is None:
            model, inputs = hf_bert()
        else:
            name, options = zoo.parse_spec(spec)
            entry = zoo.create(name, **options)
            model, inputs = entry.model, tuple(entry.example_inputs)
        expected = example_outputs(model, inputs)
        for tool, fn in (("fxopt", convert_fxopt), ("tico", convert_tico)):
            try:
                row = measure(tool, fn, model, inputs, expected)
            except Exception:
                row = {"tool": tool, "converted": False, "error": error_line(sys.exc_info()[1])}
            row["model"] = key
            rows.append(row)
            print(key, tool, {k: v for k, v in row.items() if k != "op_counts"}, flush=True)
    data = {
        "machine": machine_info(),
        "command": command_line(),
        "runtime_s": time.perf_counter() - started,
        "config": {
            "models": {k: v for k, v in cases},
            "hf_bert": "BertModel(BertConfig()), batch 2, seq 16, mask",
            "third_party": sorted(third),
        },
        "rows": rows,
    }
    write_json(RESULTS / ("circle_decoders.json" if args.decoders else "circle.json"), data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
