"""Inference latency on the CPU: fxopt against eager, torch.fx, TorchScript, torch.compile, ORT.

ResNet-50, MobileNetV2 (224×224 images) and BERT-base (128 tokens) from ``fxopt.zoo``, at
batch 1 and 8, one torch thread; ``--models hf_bert`` times transformers' own BertModel
(bert-base, an attention mask) instead, which only torch.export captures, and
``hf_llama_prefill`` / ``hf_llama_decode`` a Llama-shaped LlamaForCausalLM's prefill of a
128-token prompt and its decode step against a 128-token cache (cache tensors in and out,
the wrapper of decoder_speed.py, which times more rows). In one process,
per (model, batch), these variants are warmed up and then timed interleaved round-robin
(per-call ``time.process_time``, medians):

    eager                     the zoo model, eval mode
    fx fuse                   torch.fx.experimental.optimization.fuse(model)
    fx optimize_for_inference torch.fx.experimental.optimization.optimize_for_inference(model)
    jit trace+freeze          torch.jit.freeze(torch.jit.trace(model, inputs).eval())
    fxopt fx / fxopt export   fxopt.optimize(model, inputs, preset="speed", mode=M,
                              benchmark_runs=0): the speed preset's passes (see below)
    fxopt fx/export +autotune the same call's result.module when fxopt.optimize accepts
                              ``autotune``: the passes, then the fastest verified layout

Each of these runs in its own subprocess (compiled variants share caches), which times
the eager model interleaved with it, so its speedup is against its own eager:

    fxopt own process         fxopt fx +autotune, built and timed as the compilers are: the
                              like-for-like comparison (a process that built and ran many
                              other variants runs the same kernels up to 15% slower)
    torch.compile             torch.compile(model)
    torch.compile freezing    the same with torch._inductor.config.freezing = True
    onnxruntime               torch.onnx.export(..., dynamo=False), ORT_ENABLE_ALL, 1 thread

Every variant's outputs are compared with eager's (``fxopt.verify.compare``); one-time
costs (tracing, optimizing, compiling, exporting) are reported apart from latency. A
variant that cannot be built or run is recorded as failed with the first line of its error.

    python benchmarks/inference.py            # full sizes: about 25-35 min on 2 loaded cores
    python benchmarks/inference.py --quick    # image 112, seq 64, fewer runs
    python benchmarks/inference.py --models hf_bert hf_llama_prefill hf_llama_decode \
        --out results/inference_hf.json
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.utils import _pytree as pytree

import fxopt
from common import RESULTS, command_line, machine_info, steady_allocator, timed, write_json
from fxopt import verify, zoo

console = Console()

MODELS = {
    "resnet50": "ResNet-50",
    "mobilenet_v2": "MobileNetV2",
    "bert": "BERT-base",
    "hf_bert": "transformers BertModel",
    "hf_llama_prefill": "transformers Llama prefill",
    "hf_llama_decode": "transformers Llama decode",
}
#: Run by default; ``--models hf_bert`` (the ``hf`` extra) writes its own results file.
ZOO_MODELS = ("resnet50", "mobilenet_v2", "bert")
IN_PROCESS = (
    "eager",
    "fx fuse",
    "fx optimize_for_inference",
    "jit trace+freeze",
    "fxopt fx",
    "fxopt fx +autotune",
    "fxopt export",
    "fxopt export +autotune",
    "fxopt fx +autotune fast_math",
)
WORKERS = {
    "fxopt own process": "fxopt",
    "fxopt own process fast_math": "fxopt-fast",
    "torch.compile": "compile",
    "torch.compile freezing": "compile-freezing",
    "onnxruntime": "ort",
}
VARIANT_NOTES = {
    "eager": "the model in eval mode",
    "fx fuse": "torch.fx.experimental.optimization.fuse(model)",
    "fx optimize_for_inference": "torch.fx.experimental.optimization."
    "optimize_for_inference(model) (conv/BN fusion, mkldnn layout)",
    "jit trace+freeze": "torch.jit.freeze(torch.jit.trace(model, inputs).eval())",
    "fxopt fx": "fxopt.optimize(..., preset='speed', mode='fx'): the preset's passes only "
    "(result.pipeline.module: the graph before the layout step; setup excludes autotuning)",
    "fxopt fx +autotune": "the same call's result.module: passes, then autotune=True "
    "picks the fastest verified layout (plain, the original model, the fused kernels the tiler "
    "chose on NCHW or channels-last activations)",
    "fxopt export": "as fxopt fx, captured with torch.export (mode='export')",
    "fxopt export +autotune": "as fxopt fx +autotune, mode='export'",
    "fxopt own process": "fxopt fx +autotune (export for transformers models) run as the "
    "compilers are: in its own "
    "subprocess, against eager timed there, setup = fxopt.optimize (passes, verification, "
    "layout timing); the like-for-like comparison with torch.compile and ONNX Runtime",
    "fxopt fx +autotune fast_math": "as fxopt fx +autotune, with fast_math=True: also the "
    "rewrites exact for finite inputs only (oneDNN's fused ReLU, attention on SDPA unchecked, "
    "x + 0 → x); the rows above it are exact by default",
    "fxopt own process fast_math": "fxopt own process with fast_math=True",
    "torch.compile": "torch.compile(model), own subprocess; setup = compile + first call",
    "torch.compile freezing": "torch.compile(model) with torch._inductor.config.freezing = "
    "True, own subprocess",
    "onnxruntime": "torch.onnx.export(..., dynamo=False) then an ORT session "
    "(ORT_ENABLE_ALL, 1 intra-op thread), own subprocess; setup = export + session",
}


@dataclass(frozen=True)
class Sizes:
    image: int
    seq: int
    bert_config: str
    warmup: int  # rounds before timing
    budget_s: float  # CPU seconds of timed rounds per (model, batch), per process
    min_runs: int
    max_runs: int
    #: per-call CPU time with one thread (steadier under load); wall time with more, where
    #: CPU time would add up the threads' work.
    wall_clock: bool = False


FULL = Sizes(
    image=224, seq=128, bert_config="base", warmup=2, budget_s=60.0, min_runs=5, max_runs=30
)
QUICK = Sizes(
    image=112, seq=64, bert_config="base", warmup=2, budget_s=20.0, min_runs=5, max_runs=15
)
#: TorchScript's profiling executor specializes and optimizes a frozen graph over its
#: first calls: these variants get this many extra warm-up calls.
JIT_EXTRA_WARMUP = 4


class _Tensors(torch.nn.Module):
    """transformers' BertModel as users get it, returning its two tensors as a tuple (the
    TorchScript exporter ONNX Runtime needs takes no ModelOutput)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return out.last_hidden_state, out.pooler_output


def _hf_bert(batch: int, seq: int, config: str) -> zoo.ZooModel:
    """transformers' BertModel from ``BertConfig()`` (bert-base; random weights), ids and
    an attention mask whose last row is padded by a quarter (attention takes a mask)."""
    import transformers

    if config != "base":
        raise SystemExit(f"hf_bert is bert-base only, not --bert-config {config}")
    torch.manual_seed(0)
    model = _Tensors(transformers.BertModel(transformers.BertConfig())).eval()
    ids = torch.randint(0, 30522, (batch, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - seq // 4 :] = 0
    return zoo.ZooModel("hf_bert", model, (ids, mask), "transformers BertModel (bert-base)")


def _hf_llama(step: str, batch: int, seq: int) -> zoo.ZooModel:
    """decoder_speed's Llama-shaped LlamaForCausalLM (hidden 512, 4 layers, GQA 8/2,
    vocabulary 32000) behind its tensors-in, tensors-out wrapper: a ``seq``-token prompt
    (prefill) or one token against a ``seq``-token cache given as tensors (decode)."""
    from decoder_speed import CONFIG, _Flat, build_model

    model = build_model()
    layers = CONFIG["num_hidden_layers"]
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=generator)
    if step == "prefill":
        inputs: tuple = (prompt,)
    else:
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
        token = torch.randint(0, CONFIG["vocab_size"], (batch, 1), generator=generator)
        keys = [layer.keys for layer in cache.layers]
        inputs = (token, *keys, *[layer.values for layer in cache.layers])
    name = f"hf_llama_{step}"
    what = f"transformers LlamaForCausalLM (hidden 512, {layers} layers), {step}"
    return zoo.ZooModel(name, _Flat(model, layers).eval(), inputs, what)


def capture_mode(model: str) -> str:
    """fxopt's capture for the own-process column: fx for the zoo, export for transformers
    (fx cannot trace it)."""
    return "export" if model.startswith("hf_") else "fx"


def create(model: str, batch: int, sizes: Sizes) -> zoo.ZooModel:
    if model == "hf_bert":
        return _hf_bert(batch, sizes.seq, sizes.bert_config)
    if model.startswith("hf_llama_"):
        return _hf_llama(model.removeprefix("hf_llama_"), batch, sizes.seq)
    if model == "bert":
        return zoo.create("bert", config=sizes.bert_config, batch=batch, seq=sizes.seq)
    return zoo.create(model, image=sizes.image, batch=batch)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# --------------------------------------------------------------------------- variants


@dataclass
class Variant:
    name: str
    fn: Callable | None = None
    status: str = "ok"  # ok | mismatch (outputs differ beyond tolerance) | failed
    error: str | None = None
    setup_s: float | None = None  # wall seconds
    setup_cpu_s: float | None = None
    extra: dict = field(default_factory=dict)
    samples_ms: list[float] = field(default_factory=list)
    max_abs_error: float | None = None
    verified: bool | None = None
    warmup_extra: int = 0
    #: Another variant's name when both are the same module object (autotune kept the
    #: plain graph): it is timed once and its figures are copied here.
    same_as: str | None = None


def _quiet(fn: Callable) -> Callable:
    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()

    return run


def build_in_process(model, inputs, wanted: set[str], say: Callable[[str], None]) -> list:
    """The in-process variants in ``wanted``, each built once (its one-time cost timed)."""
    from torch.fx.experimental import optimization

    variants = [Variant("eager", model, setup_s=0.0, setup_cpu_s=0.0)]

    def add(name: str, build: Callable, **kw) -> None:
        if name not in wanted:
            return
        say(f"set up {name}")
        try:
            module, cpu, wall = timed(_quiet(build))
            variants.append(Variant(name, module, setup_s=wall, setup_cpu_s=cpu, **kw))
        except Exception as error:
            variants.append(Variant(name, status="failed", error=first_line(error)))

    add("fx fuse", lambda: optimization.fuse(model))
    add("fx optimize_for_inference", lambda: optimization.optimize_for_inference(model))
    add(
        "jit trace+freeze",
        lambda: torch.jit.freeze(torch.jit.trace(model, inputs).eval()),
        warmup_extra=JIT_EXTRA_WARMUP,
    )
    autotune = "autotune" in inspect.signature(fxopt.optimize).parameters
    for mode in ("fx", "export"):
        names = {f"fxopt {mode}", f"fxopt {mode} +autotune"}
        if names & wanted:
            say(f"set up fxopt {mode}")
            variants += [
                v for v in fxopt_variants(model, inputs, mode, autotune, wanted) if v.name in wanted
            ]
    fast = "fxopt fx +autotune fast_math"
    if fast in wanted and "fast_math" in inspect.signature(fxopt.optimize).parameters:
        say(f"set up {fast}")
        kwargs = {"preset": "speed", "mode": "fx", "benchmark_runs": 0, "fast_math": True}
        try:
            result, cpu, wall = timed(_quiet(lambda: fxopt.optimize(model, inputs, **kwargs)))
            extra = {"layout": result.report.get("layout"), "fast_math": result.report["fast_math"]}
            variants.append(
                Variant(fast, result.module, setup_s=wall, setup_cpu_s=cpu, extra=extra)
            )
        except Exception as error:
            variants.append(Variant(fast, status="failed", error=first_line(error)))
    return variants


def fxopt_variants(model, inputs, mode: str, autotune: bool, wanted: set[str]) -> list[Variant]:
    """``fxopt <mode>`` and, when fxopt.optimize takes ``autotune``, ``+autotune``: from one
    call, as ``result.pipeline.module`` is the graph the passes left, before the layout step
    (what ``autotune=False`` returns)."""
    name = f"fxopt {mode}"
    kwargs: dict[str, Any] = {"preset": "speed", "mode": mode, "benchmark_runs": 0}
    if autotune:
        kwargs["autotune"] = True
    try:
        result, cpu, wall = timed(_quiet(lambda: fxopt.optimize(model, inputs, **kwargs)))
    except Exception as error:
        failed = [Variant(name, status="failed", error=first_line(error))]
        if autotune:
            failed.append(Variant(f"{name} +autotune", status="failed", error=first_line(error)))
        return failed
    report = result.report
    passes = {"passes": [p.get("name") for p in report.get("passes", []) if p.get("changed")]}
    if not autotune:
        return [Variant(name, result.module, setup_s=wall, setup_cpu_s=cpu, extra=passes)]
    layout = report.get("layout")
    tuning = float((layout or {}).get("autotune_s") or 0.0)
    same = result.module is result.pipeline.module
    return [
        Variant(
            name,
            result.pipeline.module,
            setup_s=max(wall - tuning, 0.0),
            setup_cpu_s=None,
            extra=passes | {"setup_note": "optimize() wall time minus layout autotune_s"},
        ),
        Variant(
            f"{name} +autotune",
            result.module,
            setup_s=wall,
            setup_cpu_s=cpu,
            extra=passes | {"layout": layout},
            same_as=name if same and name in wanted else None,
        ),
    ]


# --------------------------------------------------------------------------- timing


def check_against(expected, variant: Variant, call: Callable[[], Any]) -> None:
    """Run the variant once and compare its outputs with eager's (marks failures)."""
    try:
        with torch.inference_mode():
            got = call()
        comparison = verify.compare(expected, got)
    except Exception as error:
        variant.status, variant.error, variant.fn = "failed", first_line(error), None
        return
    variant.max_abs_error = comparison.max_abs_error
    variant.verified = comparison.ok
    if not comparison.ok:
        variant.status = "mismatch"
        variant.error = comparison.message


def interleave(
    variants: list[Variant], sizes: Sizes, calls: dict[str, Callable[[], Any]], on_round=None
) -> int:
    """Warm up, then time every live variant once per round; returns the number of rounds."""
    live = [v for v in variants if v.status != "failed" and v.same_as is None]
    with torch.inference_mode():
        for v in live:
            for _ in range(v.warmup_extra):
                calls[v.name]()
        last: dict[str, float] = {}
        for _ in range(sizes.warmup):
            for v in list(live):
                try:
                    _, cpu, wall = timed(calls[v.name])
                    last[v.name] = wall if sizes.wall_clock else cpu
                except Exception as error:
                    v.status, v.error = "failed", first_line(error)
                    live.remove(v)
        per_round = sum(last.values()) or 1e-3
        runs = int(max(sizes.min_runs, min(sizes.max_runs, sizes.budget_s / per_round)))
        if on_round:
            on_round(0, runs)
        for index in range(runs):
            for v in live:
                _, cpu, wall = timed(calls[v.name])
                v.samples_ms.append((wall if sizes.wall_clock else cpu) * 1e3)
            if on_round:
                on_round(index + 1, runs)
    return runs


#: Ops that only move data between layouts (a reorder between kernels).
REORDER_OPS = ("aten::copy_", "aten::contiguous", "aten::to_dense", "aten::to_mkldnn")


def profile(call: Callable[[], Any], calls: int = 3, top: int = 5) -> dict:
    """Where a variant's time goes, from the torch profiler: the ``top`` ops by self CPU
    time (share of the total) and the layout reorders per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch.inference_mode():
        call()
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                call()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: -e.self_cpu_time_total)
    return {
        "top_ops": [
            {
                "op": e.key,
                "share": round(e.self_cpu_time_total / total, 4),
                "calls": e.count // calls,
            }
            for e in ranked[:top]
        ],
        "reorders_per_call": sum(e.count for e in events if e.key in REORDER_OPS) / calls,
    }


def profile_fxopt(variants: list[Variant], calls: dict, say: Callable[[str], None]) -> None:
    """:func:`profile` each autotuned fxopt variant (into its ``extra``)."""
    for v in variants:
        if v.name.endswith("+autotune") and v.status == "ok" and v.same_as is None:
            say(f"profile {v.name}")
            v.extra["profile"] = profile(calls[v.name])


def median_ms(v: Variant) -> float | None:
    return statistics.median(v.samples_ms) if v.samples_ms and v.status != "failed" else None


# --------------------------------------------------------------------------- workers


def run_worker(kind: str, model_name: str, batch: int, sizes: Sizes, threads: int) -> dict:
    """Body of a subprocess: eager and one compiled/exported variant, interleaved."""
    torch.set_num_threads(threads)
    zm = create(model_name, batch, sizes)
    model, inputs = zm.model, zm.example_inputs
    with torch.inference_mode():
        expected = model(*inputs)
    eager = Variant("eager", model, setup_s=0.0)
    name = {v: k for k, v in WORKERS.items()}[kind]
    variant = Variant(name)
    calls: dict[str, Callable[[], Any]] = {"eager": lambda: model(*inputs)}
    first_call: Callable[[], Any] | None = None
    try:
        if kind in ("fxopt", "fxopt-fast"):
            fast = {"fast_math": True} if kind == "fxopt-fast" else {}

            def first_call():
                result = fxopt.optimize(
                    model,
                    inputs,
                    preset="speed",
                    mode=capture_mode(model_name),
                    benchmark_runs=0,
                    autotune=True,
                    **fast,
                )
                calls[name] = lambda m=result.module: m(*inputs)
                variant.extra["layout"] = result.report.get("layout")
                variant.extra["fast_math"] = result.report.get("fast_math")
                return None

            variant.extra["setup_note"] = "fxopt.optimize(preset='speed', autotune=True)"
        elif kind in ("compile", "compile-freezing"):
            if kind == "compile-freezing":
                torch._inductor.config.freezing = True
            compiled = torch.compile(model)

            def first_call():
                with torch.inference_mode():
                    return compiled(*inputs)

            calls[name] = lambda: compiled(*inputs)
            variant.extra["setup_note"] = "torch.compile + the first call (which compiles)"
        elif kind == "ort":
            import onnxruntime as ort

            variant.extra["onnxruntime"] = ort.__version__
            tmp = tempfile.TemporaryDirectory()
            path = Path(tmp.name) / "model.onnx"
            names = [f"input{i}" for i in range(len(inputs))]

            def first_call():
                torch.onnx.export(model, inputs, str(path), input_names=names, dynamo=False)
                options = ort.SessionOptions()
                options.intra_op_num_threads = threads
                options.inter_op_num_threads = 1
                options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
                session = ort.InferenceSession(
                    str(path), options, providers=["CPUExecutionProvider"]
                )
                feed = {n: x.numpy() for n, x in zip(names, inputs)}
                _, spec = pytree.tree_flatten(expected)
                calls[name] = lambda: session.run(None, feed)
                variant.extra["unflatten"] = lambda outs: pytree.tree_unflatten(
                    [torch.from_numpy(o) for o in outs], spec
                )
                return None

            variant.extra["setup_note"] = "ONNX export + InferenceSession"
        else:
            raise ValueError(f"unknown worker {kind}")
        _, cpu, wall = timed(_quiet(first_call))
        variant.setup_s, variant.setup_cpu_s = wall, cpu
        unflatten = variant.extra.pop("unflatten", lambda out: out)
        check_against(expected, variant, lambda: unflatten(calls[name]()))
    except Exception as error:
        variant.status, variant.error = "failed", first_line(error)
    interleave([eager, variant], sizes, calls)
    if kind in ("fxopt", "fxopt-fast") and variant.status == "ok":
        variant.extra["profile"] = profile(calls[name])
    return {"eager": _variant_json(eager, None), "variant": _variant_json(variant, eager)}


def spawn_worker(kind: str, model_name: str, batch: int, args: argparse.Namespace) -> dict:
    """Run one worker in a fresh interpreter; a crash or timeout is a failed variant."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        # A fresh compile cache: setup_s is a cold compile, whatever ran before.
        cache = {"TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            kind,
            "--models",
            model_name,
            "--batches",
            str(batch),
            "--worker-out",
            str(out),
            *_size_args(args),
        ]
        threads = str(args.threads)
        env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} | cache
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.worker_timeout, env=env
            )
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.worker_timeout:g} s (whole subprocess)"}
        if out.exists():
            data = json.loads(out.read_text())
            data["wall_s"] = round(time.perf_counter() - started, 1)
            return data
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln.split(":", 1)[0]]
        reason = (errors or lines or [f"exit code {proc.returncode}"])[-1].strip()
        return {"error": f"subprocess died (exit code {proc.returncode}): {reason[:300]}"}


def _size_args(args: argparse.Namespace) -> list[str]:
    out = ["--image", str(args.image), "--seq", str(args.seq), "--bert-config", args.bert_config]
    out += ["--budget", str(args.budget), "--min-runs", str(args.min_runs)]
    out += ["--max-runs", str(args.max_runs), "--warmup", str(args.warmup)]
    out += ["--threads", str(args.threads)]
    return out + (["--quick"] if args.quick else [])


def _variant_json(v: Variant, eager: Variant | None) -> dict:
    median = median_ms(v)
    eager_median = median_ms(eager) if eager is not None else median
    speedup = eager_median / median if median and eager_median else None
    extra = {k: val for k, val in v.extra.items() if not callable(val)}
    return {
        "status": v.status,
        "error": v.error,
        "median_ms": median,
        "speedup": speedup,
        "max_abs_error": v.max_abs_error,
        "verified": v.verified,
        "setup_s": v.setup_s,
        "setup_cpu_s": v.setup_cpu_s,
        "runs": len(v.samples_ms),
        "samples_ms": [round(s, 4) for s in v.samples_ms],
        **({"extra": extra} if extra else {}),
    }


def onnxruntime_missing() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as error:
        return f"onnxruntime not installed ({first_line(error)}); pip install 'fxopt[peers]'"
    return None


# --------------------------------------------------------------------------- one config


def measure_config(model_name: str, batch: int, args, sizes: Sizes, progress, task) -> list:
    label = f"{MODELS[model_name]} b{batch}"

    def say(what: str) -> None:
        progress.update(task, description=f"{label}: {what}")

    say("build")
    zm = create(model_name, batch, sizes)
    model, inputs = zm.model, zm.example_inputs
    with torch.inference_mode():
        expected = model(*inputs)

    def step(what: str) -> None:
        say(what)
        progress.advance(task)

    variants = build_in_process(model, inputs, set(args.variants), step)
    calls = {v.name: (lambda f=v.fn: f(*inputs)) for v in variants if v.fn is not None}
    for v in variants:
        if v.status != "failed" and v.name != "eager" and v.same_as is None:
            check_against(expected, v, calls[v.name])

    def on_round(done: int, total: int) -> None:
        say(f"timing, round {done}/{total}")

    say("warm-up")
    interleave(variants, sizes, calls, on_round)
    progress.advance(task)
    by_name = {v.name: v for v in variants}
    for v in variants:
        if v.same_as in by_name:
            source = by_name[v.same_as]
            v.status, v.error, v.samples_ms = source.status, source.error, source.samples_ms
            v.max_abs_error, v.verified = source.max_abs_error, source.verified
            v.extra["same_module_as"] = v.same_as
    profile_fxopt(variants, calls, say)
    eager = variants[0]
    rows = []
    for v in variants:
        rows.append(
            {
                "model": model_name,
                "label": MODELS[model_name],
                "batch": batch,
                "variant": v.name,
                "process": "main",
                **_variant_json(v, eager),
            }
        )
    del variants, calls
    gc.collect()

    for name, kind in WORKERS.items():
        if name not in args.variants:
            continue
        say(f"{name} (subprocess)")
        missing = onnxruntime_missing() if kind == "ort" else None
        data = {"error": missing} if missing else spawn_worker(kind, model_name, batch, args)
        row = {
            "model": model_name,
            "label": MODELS[model_name],
            "batch": batch,
            "variant": name,
            "process": "subprocess",
        }
        if "error" in data:
            row |= {
                "status": "failed",
                "error": data["error"],
                "median_ms": None,
                "speedup": None,
                "max_abs_error": None,
                "verified": None,
                "setup_s": None,
            }
        else:
            row |= data["variant"] | {
                "eager_median_ms": data["eager"]["median_ms"],
                "eager_samples_ms": data["eager"]["samples_ms"],
                "subprocess_wall_s": data.get("wall_s"),
            }
        rows.append(row)
        progress.advance(task)
    return rows


# --------------------------------------------------------------------------- report


def print_table(result: dict) -> None:
    rows = result["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    configs = list(dict.fromkeys((r["label"], r["batch"]) for r in rows))
    by_key = {(r["label"], r["batch"], r["variant"]): r for r in rows}
    table = Table(
        title=f"Speedup vs eager (median, {result['config']['torch_threads']} thread(s)); "
        "dim: one-time setup",
        title_justify="left",
    )
    table.add_column("variant")
    for label, batch in configs:
        table.add_column(f"{label} b{batch}", justify="right")
    for v in variants:
        cells = []
        for label, batch in configs:
            r = by_key.get((label, batch, v))
            if r is None:
                cells.append("—")
            elif r["status"] == "failed":
                cells.append(f"[red]fails[/]: {(r['error'] or '')[:70]}")
            elif v == "eager":
                cells.append(f"{r['median_ms']:.1f} ms")
            else:
                mark = "" if r["status"] == "ok" else " [yellow](differs)[/]"
                speedup = "—" if r["speedup"] is None else f"{r['speedup']:.2f}×"
                cells.append(f"{speedup}{mark} [dim]{_setup(r['setup_s'])}[/]")
        table.add_row(v, *cells)
    console.print(table)


def _setup(s: float | None) -> str:
    return "" if s is None else f"{s:.0f} s"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["variant"] != "eager"))
    configs = list(dict.fromkeys((r["label"], r["batch"]) for r in rows))
    by_key = {(r["label"], r["batch"], r["variant"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(14, 6.5))
    width = 0.86 / max(len(variants), 1)
    cmap = plt.get_cmap("tab20")
    top = max([1.0, *(r["speedup"] for r in rows if r.get("speedup"))])
    for i, v in enumerate(variants):
        xs, ys = [], []
        for c, (label, batch) in enumerate(configs):
            r = by_key.get((label, batch, v))
            x = c - 0.43 + width * (i + 0.5)
            if r and r.get("speedup") and r["status"] != "failed":
                xs.append(x)
                ys.append(r["speedup"])
                ax.text(
                    x,
                    r["speedup"] + top * 0.01,
                    f"{r['speedup']:.2f}",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=6,
                )
            elif r:
                ax.text(
                    x,
                    top * 0.02,
                    "fails",
                    ha="center",
                    va="bottom",
                    rotation=90,
                    fontsize=7,
                    color="firebrick",
                )
        hatch = "//" if v.startswith("fxopt") else None
        ax.bar(xs, ys, width, label=v, color=cmap(i), edgecolor="black", linewidth=0.3, hatch=hatch)
    ax.axhline(1.0, linestyle="--", color="black", linewidth=1)
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{label}\nbatch {batch}" for label, batch in configs])
    ax.set_ylim(0, top * 1.15)
    ax.set_ylabel("speedup vs eager (median CPU time)")
    cfg = result["config"]
    images = any(m in ("resnet50", "mobilenet_v2") for m in cfg["models"])
    sizes = f"{cfg['image']}×{cfg['image']} images, " if images else ""
    sizes += f"{cfg['seq']} tokens"
    quick = ", --quick" if cfg["quick"] else ""
    threads = result["config"]["torch_threads"]
    ax.set_title(
        f"CPU inference, {threads} thread(s) ({sizes}{quick}): speedup over eager (hatched: fxopt)"
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="image 112, seq 64, fewer runs")
    parser.add_argument("--models", nargs="+", default=list(ZOO_MODELS), choices=list(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[*IN_PROCESS, *WORKERS],
        choices=[*IN_PROCESS, *WORKERS],
        metavar="VARIANT",
        help="run only these (eager always runs)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch / ORT threads (default 1)")
    parser.add_argument("--image", type=int, help="image side (default 224, --quick 112)")
    parser.add_argument("--seq", type=int, help="BERT tokens (default 128, --quick 64)")
    parser.add_argument("--bert-config", default=None, help="zoo BERT config (default base)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds before timing")
    parser.add_argument(
        "--budget", type=float, help="CPU s of timed rounds per (model, batch) and process"
    )
    parser.add_argument("--min-runs", type=int)
    parser.add_argument("--max-runs", type=int)
    parser.add_argument(
        "--worker-timeout", type=float, default=1200.0, help="limit per subprocess (s)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "inference.json")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the plot and table from --out"
    )
    parser.add_argument("--worker", choices=list(WORKERS.values()), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    for arg, attr in (
        ("image", "image"),
        ("seq", "seq"),
        ("bert_config", "bert_config"),
        ("warmup", "warmup"),
        ("budget", "budget_s"),
        ("min_runs", "min_runs"),
        ("max_runs", "max_runs"),
    ):
        if getattr(args, arg) is None:
            setattr(args, arg, getattr(base, attr))
    if "eager" not in args.variants:
        args.variants.insert(0, "eager")
    return args


def sizes_of(args: argparse.Namespace) -> Sizes:
    return Sizes(
        args.image,
        args.seq,
        args.bert_config,
        args.warmup,
        args.budget,
        args.min_runs,
        args.max_runs,
        args.threads > 1,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    allocator = steady_allocator()
    torch.set_num_threads(args.threads)
    sizes = sizes_of(args)
    if args.replot:
        result = json.loads(args.out.read_text())
        plot(result, args.out.with_suffix(".png"))
        print_table(result)
        return 0
    if args.worker:
        data = run_worker(args.worker, args.models[0], args.batches[0], sizes, args.threads)
        write_json(args.worker_out, data)
        return 0

    started = time.perf_counter()
    configs = [(m, b) for m in args.models for b in args.batches]
    wanted = set(args.variants)
    setups = [
        {"fx fuse"},
        {"fx optimize_for_inference"},
        {"jit trace+freeze"},
        {"fxopt fx", "fxopt fx +autotune"},
        {"fxopt export", "fxopt export +autotune"},
    ]
    steps_per_config = (
        sum(1 for names in setups if names & wanted) + 1 + sum(1 for w in WORKERS if w in wanted)
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    rows: list[dict] = []
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("", total=len(configs) * steps_per_config)
        for model_name, batch in configs:
            rows += measure_config(model_name, batch, args, sizes, progress, task)

    result = {
        "benchmark": "inference",
        "machine": machine_info(),
        "command": command_line(),
        "config": {
            "quick": args.quick,
            "models": {m: MODELS[m] for m in args.models},
            "batches": args.batches,
            "image": args.image,
            "seq": args.seq,
            "bert_config": args.bert_config,
            "torch_threads": torch.get_num_threads(),
            "warmup_rounds": args.warmup,
            "jit_extra_warmup_calls": JIT_EXTRA_WARMUP,
            "budget_s": args.budget,
            "runs": f"budget_s / (CPU s of one warm-up round), clamped to "
            f"[{args.min_runs}, {args.max_runs}]",
            "clock": (
                "time.perf_counter per call (wall ms)"
                if args.threads > 1
                else "time.process_time per call (CPU ms)"
            )
            + ", median of interleaved runs; gc paused while timed; under torch.inference_mode",
            "speedup": "eager median / variant median, both measured in the same process",
            "setup_s": "one-time cost, wall seconds (build, trace, optimize, compile, export)",
            "fxopt_autotune": "autotune" in inspect.signature(fxopt.optimize).parameters,
            "allocator": allocator,
        },
        "variants": {v: VARIANT_NOTES[v] for v in args.variants},
        "rows": rows,
        "runtime_s": round(time.perf_counter() - started, 1),
    }
    write_json(args.out, result)
    png = args.out.with_suffix(".png")
    plot(result, png)
    print_table(result)
    console.print(f"wrote {args.out} and {png} in {result['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
