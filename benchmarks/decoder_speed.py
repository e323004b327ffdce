"""Decode-step and prefill latency of a Llama-shaped transformers model: fxopt against eager,
torch.compile with freezing and ONNX Runtime, in the same process, per row.

The model is transformers' ``LlamaForCausalLM`` at hidden 512, 4 layers, 8 query and 2
key/value heads, SwiGLU 1376, vocabulary 32000 (random weights, nothing downloaded). Rows:

    decode    one token against a DynamicCache of 128 or 1024 tokens, batch 1 or 8
    prefill   a 128-token prompt, batch 1 or 8

each at 1 and 2 torch threads, in its own subprocess (thread counts and compiled code do
not leak between rows). Per row, every variant is built, checked against eager, then timed
interleaved round-robin (wall clock per call, medians); each call gets its own copy of the
cache, made outside the timer:

    eager                  the model, eval mode, no_grad
    fxopt                  fxopt.optimize(model, example, dynamic="all"): the speed preset
                           and the layout step, its module called as the model is
    torch.compile          torch.compile(model) with torch._inductor.config.freezing
    onnxruntime            torch.onnx.export (TorchScript exporter) of a wrapper taking the
                           cache as tensors; ORT_ENABLE_ALL, the row's thread count

Decode rows also generate 32 tokens greedily with fxopt's decode step and with eager's
(the recipe of docs/language_models.md) and record whether the tokens are identical, and
the median step of that loop (its cache grows a token a step) for eager, fxopt and
torch.compile.

Outputs: results/decoder_speed.json; RESULTS.md's section is generated from it.

    python benchmarks/decoder_speed.py                # ~25 min on this 2-core machine
    python benchmarks/decoder_speed.py --quick        # batch 1, cache 128, 1 thread
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from common import RESULTS, command_line, machine_info, steady_allocator, write_json

console = Console()
CONFIG = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=32000,
)
VARIANTS = ("eager", "fxopt", "torch.compile", "onnxruntime")
PROMPT = 128
NEW_TOKENS = 32


def build_model():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


class _Flat(torch.nn.Module):
    """A prefill or decode step with the cache as tensors in and out (the ONNX exporter
    takes no ModelOutput and no cache object): the same work as the model's own call."""

    def __init__(self, model, layers: int):
        super().__init__()
        self.model, self.layers = model, layers

    def forward(self, ids, *kv):
        from transformers import DynamicCache

        cache, mask = None, None
        if kv:
            cache = DynamicCache()
            for i in range(self.layers):
                cache.update(kv[i], kv[self.layers + i], i)
        else:
            # Without a mask transformers calls SDPA with enable_gqa, which the TorchScript
            # exporter cannot convert; with one (all ones: the same answer) it repeats heads.
            mask = torch.ones_like(ids)
        out = self.model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        grown = out.past_key_values
        keys = [layer.keys for layer in grown.layers]
        values = [layer.values for layer in grown.layers]
        return (out.logits, *keys, *values)


def _onnx_session(module, inputs: tuple, threads: int, folder: Path):
    import onnxruntime as ort

    path = folder / "model.onnx"
    names = [f"in{i}" for i in range(len(inputs))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, inputs, str(path), input_names=names, dynamo=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # ORT's threads spin after each run by default: on 2 cores they take the CPU from
    # whichever variant is timed next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session, names


def _logits(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out.logits


def _fxopt(model, example: tuple) -> tuple:
    import fxopt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = fxopt.optimize(model, example, dynamic="all", benchmark_runs=0)
    layout = result.report.get("layout") or {}
    changed = {
        r["name"]: r["stats"]
        for r in result.report.get("passes", [])
        if r.get("changed") and r["name"] in ("gqa-attention", "remove-nops")
    }
    notes = {
        "verified": result.report.get("verified"),
        "layout": layout.get("chosen"),
        "kernels": layout.get("kernels"),
        "gemms": layout.get("gemms"),
        "merged_linears": layout.get("merged_linears"),
        "passes": changed,
    }
    regions = layout.get("inductor_regions")
    if regions:
        notes["inductor_regions"] = {
            k: regions[k]
            for k in ("regions", "ops", "compile_s", "whole_graph", "one_row_linears")
            if k in regions
        }
    return (lambda args, m=result.module: m(*args)), notes, result.module


def _compiled(model, first_args: tuple):
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    compiled = torch.compile(model)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(*first_args)
    return lambda args: compiled(*args)


def _onnxruntime(model, example: tuple, cache, threads: int):
    with tempfile.TemporaryDirectory() as folder:
        layers = model.config.num_hidden_layers
        if cache is None:
            flat = example
        else:
            tensors = [layer.keys for layer in cache.layers]
            tensors += [layer.values for layer in cache.layers]
            flat = (example[0], *tensors)
        module = _Flat(model, layers)
        session, names = _onnx_session(module, flat, threads, Path(folder))
    feeds = {n: x.numpy() for n, x in zip(names, flat)}
    # The feeds are the example's (the cache is not grown in place): the same computation.
    return lambda args: (torch.from_numpy(session.run(None, feeds)[0]),)


def _timed_rounds(calls: dict, fresh, rounds: int) -> dict[str, float]:
    """Median ms per variant, interleaved round-robin after two warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.no_grad():
        for _ in range(2):
            for call in calls.values():
                call(fresh())
        for _ in range(rounds):
            for name, call in calls.items():
                args = fresh()
                began = time.perf_counter()
                call(args)
                times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def run_row(step: str, threads: int, batch: int, length: int, rounds: int) -> dict:
    """One row, in this process: build, check and time every variant."""
    torch.set_num_threads(threads)
    model = build_model()
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CONFIG["vocab_size"], (batch, length), generator=generator)
    cache = None
    example: tuple = (prompt,)
    if step == "decode":
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
        token = torch.randint(0, CONFIG["vocab_size"], (batch, 1), generator=generator)
        example = (token, None, None, cache)

    def fresh() -> tuple:  # each call grows its own copy of the cache
        return example if cache is None else (*example[:3], copy.deepcopy(cache))

    with torch.no_grad():
        expected = _logits(model(*fresh()))
    calls = {"eager": lambda args: model(*args)}
    setup, errors, notes, optimized = {}, {}, {}, None
    builders = {
        "fxopt": lambda: _fxopt(model, example),
        "torch.compile": lambda: _compiled(model, fresh()),
        "onnxruntime": lambda: _onnxruntime(model, example, cache, threads),
    }
    for name, build in builders.items():
        started = time.perf_counter()
        try:
            built = build()
        except Exception as error:
            errors[name] = _first_line(error)
            continue
        setup[name] = round(time.perf_counter() - started, 2)
        if name == "fxopt":
            built, notes[name], optimized = built
        try:
            with torch.no_grad():
                torch.testing.assert_close(_logits(built(fresh())), expected, rtol=1e-4, atol=1e-4)
        except Exception as error:
            errors[name] = f"differs from eager: {_first_line(error)}"
            continue
        calls[name] = built
    medians = _timed_rounds(calls, fresh, rounds)
    row: dict = {"step": step, "threads": threads, "batch": batch, "length": length}
    row["variants"] = {}
    for name in VARIANTS:
        entry: dict = {"setup_s": setup.get(name)}
        if name in medians:
            ms = medians[name]
            entry.update(ms=round(ms, 3), speedup=round(medians["eager"] / ms, 3))
        else:
            entry["error"] = errors.get(name, "not built")
        entry.update(notes.get(name, {}))
        row["variants"][name] = entry
    if step == "decode" and optimized is not None:
        row["greedy_tokens_equal"] = _same_greedy_tokens(model, optimized, prompt)
        row["generation_step_ms"] = _generation_steps(model, calls, prompt)
    return row


def _generate(step, model, prompt: torch.Tensor, times: list | None = None) -> torch.Tensor:
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tokens = out.past_key_values, [out.logits[:, -1:].argmax(-1)]
        for _ in range(NEW_TOKENS - 1):
            began = time.perf_counter()
            out = step(tokens[-1], None, None, cache)
            if times is not None:
                times.append(time.perf_counter() - began)
            tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def _same_greedy_tokens(model, optimized, prompt: torch.Tensor) -> bool:
    return bool(torch.equal(_generate(optimized, model, prompt), _generate(model, model, prompt)))


def _generation_steps(model, calls: dict, prompt: torch.Tensor) -> dict[str, float]:
    """Median ms of a decode step in a greedy generation loop, whose cache grows by a token
    each step (unlike the timed rows, which repeat one cache length): per variant that
    takes a cache object, each loop run twice in turn, the second timed."""
    steps = {"eager": model, "fxopt": None, "torch.compile": None}
    medians = {}
    for name in steps:
        if name not in calls:
            continue
        call = calls[name]
        step = steps[name] or (lambda *args, call=call: call(args))
        times: list[float] = []
        _generate(step, model, prompt)
        _generate(step, model, prompt, times)
        medians[name] = round(statistics.median(times) * 1e3, 3)
    return medians


def rows_of(args: argparse.Namespace) -> list[tuple]:
    if args.quick:
        return [("decode", 1, 1, 128), ("prefill", 1, 1, PROMPT)]
    rows = []
    for threads in (1, 2):
        for batch in (1, 8):
            for cache in (128, 1024):
                rows.append(("decode", threads, batch, cache))
            rows.append(("prefill", threads, batch, PROMPT))
    return rows


def spawn(row: tuple, rounds: int) -> dict:
    step, threads, batch, length = row
    command = [
        sys.executable, __file__, "--worker", step, str(threads), str(batch), str(length),
        "--rounds", str(rounds),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        where = {"step": step, "threads": threads, "batch": batch, "length": length}
        return {**where, "error": tail[:300]}
    return json.loads(lines[-1])


def print_table(rows: list[dict]) -> None:
    table = Table(title="Llama-shaped decoder: latency (ms) and speedup over eager")
    for column in ("step", "threads", "batch", "length", *VARIANTS, "greedy = eager"):
        table.add_column(column)
    for row in rows:
        cells = [row["step"], str(row["threads"]), str(row["batch"]), str(row["length"])]
        for name in VARIANTS:
            v = row.get("variants", {}).get(name, {})
            cells.append(f"{v['ms']:.2f} ({v['speedup']:.2f}x)" if "ms" in v else "failed")
        cells.append(str(row.get("greedy_tokens_equal", "")))
        table.add_row(*cells)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two rows, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per row")
    parser.add_argument("--worker", nargs=4, metavar=("STEP", "THREADS", "BATCH", "LENGTH"))
    parser.add_argument("--out", type=Path, default=RESULTS / "decoder_speed.json")
    args = parser.parse_args(argv)
    if args.worker:
        step, threads, batch, length = args.worker
        row = run_row(step, int(threads), int(batch), int(length), args.rounds or 20)
        print(json.dumps(row, default=str))
        return 0
    allocator = steady_allocator()
    try:
        import transformers  # noqa: F401
    except ImportError:
        console.print("transformers is not installed (pip install -e '.[hf]'): skipped")
        return 1
    rounds = args.rounds or (8 if args.quick else 20)
    began = time.perf_counter()
    rows = []
    for row in rows_of(args):
        console.print(f"[dim]{row[0]} threads={row[1]} batch={row[2]} length={row[3]}...[/]")
        rows.append(spawn(row, rounds))
    print_table(rows)
    write_json(
        args.out,
        {
            "benchmark": "decoder_speed",
            "machine": machine_info(),
            "command": command_line(),
            "runtime_s": round(time.perf_counter() - began, 1),
            "config": {
                "model": "LlamaForCausalLM",
                **CONFIG,
                "rounds": rounds,
                "new_tokens": NEW_TOKENS,
                "allocator": allocator,
            },
            "rows": rows,
        },
    )
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
