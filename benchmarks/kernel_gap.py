"""Where fxopt's gap to ONNX Runtime on the CNNs comes from: each runtime's own profiler.

For MobileNetV2 and ResNet-50 (224×224, batch 1 and 8, one thread), in one process under
the pinned allocator: fxopt's ``speed`` result (``fxopt.optimize(..., autotune=True)``)
profiled with the torch profiler, and an ONNX Runtime session (the model exported with
``torch.onnx.export(..., dynamo=False)``, ``ORT_ENABLE_ALL``, one intra-op thread)
profiled with ORT's own (``SessionOptions.enable_profiling``). Each groups its time by
kind of op: convolutions (with whatever each runtime fused into them), layout reorders,
everything else. Both run ``--calls`` times after warm-up; a profiler adds its own cost
per op to both, so the table compares shares and the per-call conv time, not latency
(benchmarks/inference.py measures that).

A second measurement takes the profilers out: each convolution of the model alone, on
oneDNN's fused kernel as fxopt calls it (channels-last input, weights packed once),
timed in a loop, summed over the model's convolutions. That sum is a floor for what any
fxopt graph calling these kernels can reach (hot caches, no Python between ops).

    python benchmarks/kernel_gap.py            # about 3 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import fxopt
from common import RESULTS, command_line, machine_info, steady_allocator, write_json
from fxopt import zoo

MODELS = {"mobilenet_v2": "MobileNetV2", "resnet50": "ResNet-50"}
#: torch profiler event names (self time) → kind
TORCH_KINDS = {
    "mkldnn::_convolution_pointwise": "conv",
    "aten::mkldnn_convolution": "conv",
    "aten::convolution": "conv",
    "aten::_convolution": "conv",
    "aten::copy_": "reorder",
    "aten::contiguous": "reorder",
    "aten::to_dense": "reorder",
    "aten::to_mkldnn": "reorder",
}
#: ORT node op types → kind (NCHWc convolutions are ORT's blocked-layout kernels)
ORT_KINDS = {
    "Conv": "conv",
    "FusedConv": "conv",
    "NchwcConv": "conv",
    "ReorderInput": "reorder",
    "ReorderOutput": "reorder",
    "Transpose": "reorder",
}


def torch_profile(module, inputs, calls: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(3):
            module(*inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                module(*inputs)
    by_kind: dict[str, float] = defaultdict(float)
    conv_calls = 0
    for event in prof.key_averages():
        kind = TORCH_KINDS.get(event.key, "other")
        by_kind[kind] += event.self_cpu_time_total / 1e3 / calls
        if kind == "conv":
            conv_calls += event.count // calls
    return {"ms_per_call": dict(by_kind), "conv_calls": conv_calls}


def ort_session(model, inputs, folder: Path, profiling: bool):
    import onnxruntime as ort

    path = folder / "model.onnx"
    if not path.exists():
        torch.onnx.export(model, inputs, str(path), input_names=["input0"], dynamo=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if profiling:
        options.enable_profiling = True
        options.profile_file_prefix = str(folder / "ort_profile")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_profile(model, inputs, calls: int, folder: Path, warmup: int = 3) -> dict:
    session = ort_session(model, inputs, folder, profiling=True)
    feed = {"input0": inputs[0].numpy()}
    for _ in range(warmup + calls):
        session.run(None, feed)
    trace = json.loads(Path(session.end_profiling()).read_text())
    # Each call is one "model_run" event; node events before the end of the last warm-up
    # call are left out.
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "model_run")
    if len(runs) != warmup + calls:
        raise RuntimeError(
            f"ORT profile has {len(runs)} model_run events, expected {warmup + calls}"
        )
    cutoff = runs[warmup - 1][1]
    by_kind: dict[str, float] = defaultdict(float)
    conv_nodes = set()
    for event in trace:
        args = event.get("args") or {}
        if event.get("cat") != "Node" or "op_name" not in args:
            continue
        if not event["name"].endswith("_kernel_time") or event["ts"] < cutoff:
            continue
        kind = ORT_KINDS.get(args["op_name"], "other")
        by_kind[kind] += event["dur"] / 1e3 / calls
        if kind == "conv":
            conv_nodes.add(event["name"])
    return {"ms_per_call": dict(by_kind), "conv_calls": len(conv_nodes)}


def conv_floor(model, inputs, reps: int) -> dict:
    """Sum over the model's convolutions of one call of oneDNN's fused kernel (channels-last
    input, packed weights), each timed alone in a loop: median of ``reps`` CPU ms."""
    shapes = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: shapes.append((mod, args[0].shape)))
        for m in model.modules()
        if isinstance(m, torch.nn.Conv2d)
    ]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    total_ms = 0.0
    with torch.inference_mode():
        for conv, shape in shapes:
            args = (list(conv.padding), list(conv.stride), list(conv.dilation), conv.groups)
            packed = torch.ops.mkldnn._reorder_convolution_weight(
                conv.weight.detach(), *args, list(shape)
            )
            bias = conv.bias.detach() if conv.bias is not None else None
            x = torch.randn(shape).contiguous(memory_format=torch.channels_last)

            def run(x=x, packed=packed, bias=bias, args=args):
                return torch.ops.mkldnn._convolution_pointwise(
                    x, packed, bias, *args, "relu", [], ""
                )

            total_ms += latency(run, reps)
    return {"convs": len(shapes), "ms": total_ms}


def latency(fn, calls: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn()
        samples = []
        for _ in range(calls):
            start = time.process_time()
            fn()
            samples.append((time.process_time() - start) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def measure(name: str, batch: int, calls: int) -> dict:
    zm = zoo.create(name, image=224, batch=batch)
    model, inputs = zm.model, zm.example_inputs
    result = fxopt.optimize(model, inputs, preset="speed", benchmark_runs=0, autotune=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        session = ort_session(model, inputs, folder, profiling=False)
        feed = {"input0": inputs[0].numpy()}
        row = {
            "model": name,
            "label": MODELS[name],
            "batch": batch,
            "layout": result.report["layout"]["chosen"],
            "kernels": result.report["layout"].get("kernels"),
            "latency_ms": {
                "eager": latency(lambda: model(*inputs), calls),
                "fxopt": latency(lambda: result.module(*inputs), calls),
                "onnxruntime": latency(lambda: session.run(None, feed), calls),
            },
            "fxopt_profile": torch_profile(result.module, inputs, calls),
            "ort_profile": ort_profile(model, inputs, calls, folder),
            "onednn_conv_floor": conv_floor(model, inputs, reps=max(20, calls)),
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel_gap.json")
    args = parser.parse_args(argv)
    allocator = steady_allocator()
    torch.set_num_threads(1)
    try:
        import onnxruntime
    except ImportError as error:
        print(f"onnxruntime is needed: pip install 'fxopt[peers]' ({error})", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows = []
    for name in args.models:
        for batch in args.batches:
            print(f"{MODELS[name]} b{batch}", flush=True)
            rows.append(measure(name, batch, args.calls))
    write_json(
        args.out,
        {
            "benchmark": "kernel_gap",
            "machine": machine_info(),
            "command": command_line(),
            "config": {
                "image": 224,
                "torch_threads": 1,
                "calls": args.calls,
                "onnxruntime": onnxruntime.__version__,
                "allocator": allocator,
                "clock": "latency: median CPU ms per call (time.process_time); profiles: "
                "self time per call by kind of op, from each runtime's profiler",
            },
            "rows": rows,
            "runtime_s": round(time.perf_counter() - started, 1),
        },
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
