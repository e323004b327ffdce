"""Quantized Circle files: fxopt (fxopt.quant + fxopt.circle.convert) vs TICO 0.3.0's PTQ
(tico.quantization + tico.convert), same models, same calibration data, same run.

Per model and scheme (uint8, int16), for each tool: converted and validated in a runtime
(fxopt: its own check against the quantized model; TICO: whether onert or LiteRT runs the
file at all), SQNR against the float model on held-out batches (from the runtime; where
no runtime runs TICO's file, from its fake-quantized PyTorch model, marked as such),
top-1 agreement for classifiers, operator and TRANSPOSE counts, file size against the float
file, conversion time (quantization included), onert latency of the float and quantized
files. The PT2E reference (torchao's XNNPACK config, the same calibration batches) gives
the SQNR a standard PT2E flow reaches, and that PT2E model converted by fxopt the SQNR its
integer file keeps (residual ADDs requantized in integers). Writes results/quantize.json and
results/quantize.png; benchmarks/make_results.py renders them.

    python benchmarks/quantize.py [--models cnn_bn,resnet18] [--schemes uint8]
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import tico_quant
from common import RESULTS, command_line, machine_info, write_json
from fxopt import circle
from fxopt.circle.runtime import Session, open_session
from fxopt.quant import quantize

SCHEMES = ("uint8", "int16")
CALIBRATION_BATCHES = 16
HELD_OUT_BATCHES = 8
LATENCY_RUNS = 30


def _outputs(value) -> list[np.ndarray]:
    value = value if isinstance(value, (tuple, list)) else (value,)
    return [torch.as_tensor(v).detach().float().numpy() for v in value]


def _top1(expected: list[list[np.ndarray]], actual: list[list[np.ndarray]]) -> float | None:
    """Share of rows whose argmax agrees, for a model whose first output is 2-D logits."""
    if expected[0][0].ndim != 2 or expected[0][0].shape[1] < 2:
        return None
    agree = sum(int((e[0].argmax(1) == a[0].argmax(1)).sum()) for e, a in zip(expected, actual))
    return agree / sum(e[0].shape[0] for e in expected)


def _sqnr(expected: list[list[np.ndarray]], actual: list[list[np.ndarray]]) -> float:
    return tico_quant.sqnr_db(
        [o for batch in expected for o in batch], [o for batch in actual for o in batch]
    )


def pt2e_reference(model, example, calibration) -> torch.nn.Module:
    """The model quantized by a standard PT2E flow: torchao's XNNPACK symmetric per-channel
    config, calibrated on the same batches."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.testing.pt2e import _xnnpack_quantizer as xnnpack

    quantizer = xnnpack.XNNPACKQuantizer().set_global(
        xnnpack.get_symmetric_quantization_config(is_per_channel=True)
    )
    prepared = prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    return convert_pt2e(prepared)


def measure_fxopt(
    model, scheme, example, calibration, held_out, expected, weights="per_channel"
) -> dict:
    tool = "fxopt" if weights == "per_channel" else "fxopt per-tensor"
    row: dict = {"tool": tool, "scheme": scheme, "weights": weights}
    start = time.perf_counter()
    try:
        quantized = quantize(
            model, example, calibration=calibration, scheme=scheme, weights=weights
        )
        result = circle.convert(quantized, example)  # validated against `quantized`
    except Exception as error:
        row.update(converted=False, error=tico_quant.error_line(error))
        return row
    validate_s = result.report["stages_ms"].get("validate", 0.0) / 1e3
    ops = result.operators
    summary = result.report["quantization"]
    row.update(
        converted=True,
        convert_s=time.perf_counter() - start - validate_s,
        validated=result.validation.validated,
        runtime=result.validation.runtime,
        validation=result.validation.message,
        operators=len(ops),
        transposes=ops.count("TRANSPOSE"),
        bytes=len(result.bytes),
        op_counts=result.op_counts,
        quantized_ops=summary["quantized_ops"],
        float_ops=summary["float_ops"],
    )
    with open_session(result.bytes, result.validation.runtime) as session:
        actual = [session.run(list(batch)) for batch in held_out]
        if result.validation.runtime == "onert":
            row["latency_ms"] = session.latency_ms(list(example), runs=LATENCY_RUNS)
    row["sqnr_db"] = _sqnr(expected, actual)
    row["sqnr_source"] = result.validation.runtime
    row["top1_agreement"] = _top1(expected, actual)
    with torch.no_grad():
        ours = [_outputs(quantized(*batch)) for batch in held_out]
    row["torch_sqnr_db"] = _sqnr(expected, ours)  # the quantized model itself, in PyTorch
    return row


def measure_tico(model, scheme, example, calibration, held_out, expected) -> dict:
    row: dict = {"tool": "tico", "scheme": scheme}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fake_quantized = tico_quant.tico_ptq(model, calibration, scheme)
            data = tico_quant.to_circle(fake_quantized, example)
    except Exception as error:
        row.update(converted=False, error=tico_quant.error_line(error))
        return row
    row["convert_s"] = time.perf_counter() - start
    described = tico_quant.describe(data)
    counts = described["op_counts"]
    row.update(
        converted=True,
        operators=sum(counts.values()),
        transposes=counts.get("TRANSPOSE", 0),
        bytes=len(data),
        op_counts=counts,
        mixed_ops=described.get("mixed_ops"),
    )
    # TICO does not run its file anywhere; here: does onert or LiteRT run it, and how
    # close to float is what runs it.
    found = tico_quant.runs_in(data, held_out[0])
    runtime = next((name for name in ("onert", "litert") if found[name]["runs"]), None)
    row["runtime"] = runtime
    row["runs"] = runtime is not None
    row["run_errors"] = {name: found[name]["error"] for name in ("onert", "litert")}
    if runtime is not None:
        actual = [[np.asarray(o) for o in found[runtime]["outputs"]]]
        row["sqnr_db"] = _sqnr(expected[:1], actual)
        row["sqnr_source"] = f"{runtime} (1 batch)"
        row["top1_agreement"] = _top1(expected[:1], actual)
    else:
        with torch.no_grad():
            fake = [_outputs(fake_quantized(*batch)) for batch in held_out]
        row["sqnr_db"] = _sqnr(expected, fake)
        row["sqnr_source"] = "fake-quant torch model (no runtime runs the file)"
        row["top1_agreement"] = _top1(expected, fake)
    return row


def run_model(name: str, schemes: tuple[str, ...]) -> list[dict]:
    model, make_inputs = tico_quant.MODELS[name]()
    example = make_inputs(0)
    calibration = [make_inputs(100 + i) for i in range(CALIBRATION_BATCHES)]
    held_out = [make_inputs(1000 + i) for i in range(HELD_OUT_BATCHES)]
    with torch.no_grad():
        expected = [_outputs(model(*batch)) for batch in held_out]
    float_file = circle.convert(model, example, validate=False).bytes
    with Session(float_file) as session:
        float_latency = session.latency_ms(list(example), runs=LATENCY_RUNS)
    reference = {}
    try:
        pt2e = pt2e_reference(model, example, calibration)
        with torch.no_grad():
            reference["pt2e_sqnr_db"] = _sqnr(expected, [_outputs(pt2e(*b)) for b in held_out])
    except Exception as error:
        reference["pt2e_error"] = tico_quant.error_line(error)
    else:  # the PT2E model itself through fxopt's converter: what the integer file loses
        try:
            pt2e_file = circle.convert(pt2e, example)
            with open_session(pt2e_file.bytes, pt2e_file.validation.runtime) as session:
                actual = [session.run(list(batch)) for batch in held_out]
            reference["pt2e_file_sqnr_db"] = _sqnr(expected, actual)
        except Exception as error:
            reference["pt2e_file_error"] = tico_quant.error_line(error)
    rows = []
    for scheme in schemes:
        measures = [measure_fxopt, measure_tico]
        if scheme == "uint8":  # per-tensor weights: what onert 0.1.0 runs fast
            measures.insert(1, functools.partial(measure_fxopt, weights="per_tensor"))
        for measure in measures:
            row = measure(model, scheme, example, calibration, held_out, expected)
            row.update(model=name, float_bytes=len(float_file), float_latency_ms=float_latency)
            row.update(reference)
            if row.get("bytes"):
                row["size_vs_float"] = row["bytes"] / len(float_file)
            rows.append(row)
            shown = ("converted", "runtime", "sqnr_db", "operators", "transposes", "bytes")
            print(name, scheme, row["tool"], {k: row.get(k) for k in shown}, flush=True)
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    tools = ("fxopt", "fxopt per-tensor", "tico")
    series = [(tool, scheme) for scheme in SCHEMES for tool in tools]
    series = [s for s in series if any((r["tool"], r["scheme"]) == s for r in rows)]
    by = {(r["model"], r["tool"], r["scheme"]): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(series), 1)
    for i, (tool, scheme) in enumerate(series):
        xs = np.arange(len(models)) + i * width
        sqnr = [by.get((m, tool, scheme), {}).get("sqnr_db") or 0 for m in models]
        size = [by.get((m, tool, scheme), {}).get("size_vs_float") or 0 for m in models]
        ran = [by.get((m, tool, scheme), {}).get("runtime") for m in models]
        hatch = "//" if tool == "tico" else None
        bars = left.bar(xs, sqnr, width, label=f"{tool} {scheme}", hatch=hatch)
        for bar, runtime in zip(bars, ran):
            if runtime is None:  # no runtime runs the file: the SQNR is its torch model's
                bar.set_alpha(0.35)
        right.bar(xs, size, width, label=f"{tool} {scheme}", hatch=hatch)
    for axis, label in ((left, "SQNR vs float (dB)"), (right, "file size / float file")):
        axis.set_xticks(np.arange(len(models)) + width * (len(series) - 1) / 2, models)
        axis.set_ylabel(label)
    left.set_title("accuracy (faded: no runtime runs the file)")
    right.set_title("size")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(tico_quant.MODELS))
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--out", default=str(RESULTS / "quantize.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Warm both up (torch.export's first call pays for dynamo's imports).
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        circle.convert(quantize(tiny, (torch.randn(1, 4),), calibration=1), (torch.randn(1, 4),))
        tico_quant.quantize_tico(tiny, (torch.randn(1, 4),), [(torch.randn(1, 4),)])
    started = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        rows += run_model(name, tuple(args.schemes.split(",")))
    data = {
        "machine": machine_info(),
        "command": command_line(),
        "runtime_s": time.perf_counter() - started,
        "config": {
            "calibration_batches": CALIBRATION_BATCHES,
            "held_out_batches": HELD_OUT_BATCHES,
            "models": list(dict.fromkeys(r["model"] for r in rows)),
        },
        "rows": rows,
    }
    out = Path(args.out)
    write_json(out, data)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
