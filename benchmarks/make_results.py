"""Regenerate RESULTS.md from the JSON files the benchmarks wrote into results/.

    python benchmarks/make_results.py     # re-render only; `make bench` re-runs everything

Each results file has one renderer, ``render_<name>(data) -> markdown``, registered in
RENDERERS; files without one are listed at the end. To add a benchmark: write
``results/<name>.json`` from it, add a renderer here and a line to RENDERERS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from common import RESULTS, ROOT

# --------------------------------------------------------------------------- helpers


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column (l or r), default left."""
    align = align.ljust(len(headers), "l")[: len(headers)]
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [headers, rule, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def machine_line(data: dict) -> str:
    m = data.get("machine", {})
    cpus = m.get("cpus_usable") or m.get("cpu_count")
    return (
        f"Run {m.get('date', '?')} on {m.get('cpu', '?')} ({cpus} CPUs, "
        f"load {_round(m.get('load_avg_1min'))} at the end), Python {m.get('python', '?')}, "
        f"torch {m.get('torch', '?')}, fxopt {m.get('fxopt', '?')}, "
        f"{m.get('torch_threads', '?')} torch thread(s)."
    )


def run_line(data: dict, end: str = ".") -> str:
    """The machine line, then the command and how long it took."""
    return machine_line(data) + (
        f" `{data.get('command', '')}` took {data.get('runtime_s', 0):.0f} s{end}"
    )


def _round(x: object) -> object:
    return round(x, 1) if isinstance(x, float) else x


def short(n: int) -> str:
    """1000 → 1k, 100000 → 100k, 1500 → 1500."""
    for unit, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def rate(r: float | None) -> str:
    if r is None:
        return "—"
    return f"{r / 1e6:.2f}M" if r >= 1e6 else f"{r / 1e3:.0f}k"


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --------------------------------------------------------------------------- renderers


GRAPH_TITLES = {
    "torch": "Graphs of torch functions (torch.relu, operator.add, x.view, torch.sigmoid_ …)",
    "aten": "Graphs of ATen overloads (aten.relu.default, aten.add.Tensor, aten.sigmoid_ …)",
}
#: Rows compared in the summary: (fxopt row, torch row doing the same job).
PAIRS = (
    ("fxopt cse", "torch CSEPass (no recompile)"),
    ("fxopt dce", "torch eliminate_dead_code"),
    ("fxopt cse+dce", "torch CSEPass+DCE (no recompile)"),
)


def render_transform_speed(data: dict) -> str:
    cfg = data["config"]
    sizes = cfg["sizes"]
    rows = {(r["tool"], r["graph"], r["size"]): r for r in data["rows"]}
    ratios = {(g["tool"], g["graph"], g["from"]): g for g in data["growth"]}
    steps = list(itertools.pairwise(sizes))
    repeats = ", ".join(f"{int(s):,}: {n}" for s, n in cfg["repeats"].items())
    out = [
        "## Transform speed: fxopt cse/dce vs torch.fx",
        "",
        "How long each tool takes to rewrite generated fx graphs of "
        + ", ".join(f"{s:,}" for s in sizes)
        + " nodes (placeholders, chains of relu / sigmoid / add / mul / view, "
        f"{cfg['mix']['p_duplicate']:.0%} of steps repeat an earlier subexpression, "
        f"{cfg['mix']['p_dead']:.0%} add an unused branch, a few in-place and random ops). "
        "Every tool gets its own freshly built copy of the same graph. Cells: median CPU "
        f"time ({repeats} repeats) and nodes per second; t(b)/t(a): time ratio between two "
        "sizes (a linear tool gives the size ratio, 10 for 10× more nodes).",
        "",
        run_line(data),
        "",
    ]
    for kind in cfg["graphs"]:
        headers = [
            "tool",
            *[f"{s:,} nodes" for s in sizes],
            *[f"t({short(b)}) / t({short(a)})" for a, b in steps],
        ]
        body = []
        for tool in dict.fromkeys(r["tool"] for r in data["rows"] if r["graph"] == kind):
            cells = [f"**{tool}**" if tool.startswith("fxopt") else tool]
            for s in sizes:
                r = rows.get((tool, kind, s), {})
                if "seconds" in r:
                    cells.append(f"{seconds(r['seconds'])} · {rate(r['nodes_per_s'])}/s")
                else:
                    cells.append(r.get("status", "—"))
            for a, _ in steps:
                g = ratios.get((tool, kind, a))
                cells.append(f"{g['ratio']:.1f}" if g else "—")
            body.append(cells)
        out += [f"### {GRAPH_TITLES.get(kind, kind)}", "", table(headers, body, "l" + "r" * 9), ""]

    out += _transform_speed_summary(data, rows), ""
    if data.get("parity"):
        out += _transform_speed_parity(data["parity"]), ""

    out += ["### What each row times", ""]
    notes = dict.fromkeys((r["tool"], r["note"]) for r in data["rows"])
    out += [f"- **{tool}**: {note}" for tool, note in notes]
    out += [
        "",
        "Timing: `time.process_time()` around the call only (graph building excluded), one "
        "torch thread, the garbage collector paused during the call, tools interleaved "
        "round-robin. On this shared machine medians move by 10–30 % between runs (most at "
        "100k nodes, where graphs no longer fit in cache): judge a fxopt growth ratio against "
        "torch's rows in the same run, not against 10 alone.",
        "",
        "![transform time vs graph size](results/transform_speed.png)",
        "",
        "Raw data: [results/transform_speed.json](results/transform_speed.json). "
        "Details: [benchmarks/README.md](benchmarks/README.md).",
    ]
    return "\n".join(out)


def _transform_speed_summary(data: dict, rows: dict) -> str:
    largest = max(data["config"]["sizes"])
    lines = [f"**At {largest:,} nodes**, fxopt vs torch doing the same job (CPU time):", ""]
    for kind in data["config"]["graphs"]:
        parts = []
        for mine, theirs in PAIRS:
            a, b = rows.get((mine, kind, largest), {}), rows.get((theirs, kind, largest), {})
            if "seconds" in a and "seconds" in b:
                factor = b["seconds"] / a["seconds"]
                if 1 / 1.1 < factor < 1.1:  # run-to-run noise here is ~10 %
                    verdict = "the same within noise"
                elif factor > 1:
                    verdict = f"fxopt {factor:.1f}× faster"
                else:
                    verdict = f"fxopt {1 / factor:.1f}× slower"
                parts.append(
                    f"{mine} {seconds(a['seconds'])} vs {seconds(b['seconds'])} ({verdict})"
                )
        if parts:
            lines.append(f"- {kind} graph: " + "; ".join(parts) + ".")
    slopes = [g for g in data["growth"] if g["tool"].startswith("fxopt") and g["exponent"]]
    if slopes:
        worst = max(slopes, key=lambda g: g["exponent"])
        same_step = [
            g["ratio"]
            for g in data["growth"]
            if not g["tool"].startswith("fxopt")
            and (g["from"], g["to"]) == (worst["from"], worst["to"])
        ]
        context = (
            f"; torch's rows grew ×{min(same_step):.1f} to ×{max(same_step):.1f} over the same step"
            if same_step
            else ""
        )
        lines.append(
            f"- Steepest fxopt growth: {worst['tool']} ({worst['graph']}) "
            f"{worst['from']:,} → {worst['to']:,} nodes, time ×{worst['ratio']:.1f} "
            f"(log-log slope {worst['exponent']:.2f}; 1 is linear){context}."
        )
    return "\n".join(lines)


def _transform_speed_parity(parity: list[dict]) -> str:
    size = parity[0]["size"]
    body = []
    for p in parity:
        same = "yes" if p["match"] else f"**no**: {p['detail']}, by up to {p['max_abs_diff']:.2g}"
        nodes = f"{p['nodes_before']} → {p['nodes_after']}"
        body.append([p["tool"], p["graph"], nodes, p["removed"], same, p.get("why", "")])
    wrong = sorted({p["tool"] for p in parity if not p["match"]})
    verdict = (
        "Every tool's result matched."
        if not wrong
        else "Results that differ from the original: " + ", ".join(wrong) + "."
    )
    intro = (
        "Original and rewritten module run on the same random inputs under the same RNG seed; "
        "outputs (and inputs, which in-place ops may write) compared exactly. "
        f"{verdict} The graphs contain in-place ops on purpose: CSEPass's docstring says it is "
        "safe only on functional graphs, and `eliminate_dead_code` trusts `Node.is_impure`, "
        "which reads ATen schemas but does not know `torch.sigmoid_`."
    )
    headers = ["tool", "graph", "nodes", "removed", "same results", "where it differs"]
    return "\n".join(
        [f"### Correctness at {size:,} nodes", "", intro, "", table(headers, body, "lllr")]
    )


_GRAPH_TOOLS = ("fx fuse", "fx optimize_for_inference", "jit trace+freeze")
_COMPILERS = ("onnxruntime", "torch.compile freezing")


_OWN_PROCESS = "fxopt own process"


def _inference_standing(rows: list[dict]) -> list[str]:
    """Per model and batch: fxopt's best in-process column against the graph tools (timed
    in the same process), and fxopt in its own process against the compilers (each timed
    in its own), when that column was run."""
    speed: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("speedup"):
            speed.setdefault((r["label"], r["batch"]), {})[r["variant"]] = r["speedup"]
    lines = []
    for (label, batch), by_variant in speed.items():
        # fxopt's claim is its exact default: the fast_math columns are beside it, not in it.
        ours = {
            v: x
            for v, x in by_variant.items()
            if v.startswith("fxopt") and not v.startswith(_OWN_PROCESS) and "fast_math" not in v
        }
        tools = {v: by_variant[v] for v in _GRAPH_TOOLS if v in by_variant}
        if not ours or not tools:
            continue
        best_ours = max(ours.values())
        best_tool = max(tools, key=tools.__getitem__)
        verdict = "ahead of" if best_ours >= tools[best_tool] else "behind"
        parts = [
            f"{label} b{batch}: fxopt {best_ours:.2f}× is {verdict} the best graph tool "
            f"({best_tool} {tools[best_tool]:.2f}×)"
        ]
        own = by_variant.get(_OWN_PROCESS)
        if own is not None:
            parts.append(f"in its own process fxopt {own:.2f}×")
        fast = by_variant.get(f"{_OWN_PROCESS} fast_math")
        if own is not None and fast is not None:
            parts.append(f"with fast_math {fast:.2f}× (exactness costs {fast / own:.2f}×)")
        mine = own if own is not None else best_ours
        for compiler in _COMPILERS:
            if compiler in by_variant:
                theirs = by_variant[compiler]
                lead = (
                    f"{theirs / mine:.2f}× faster than fxopt"
                    if theirs > mine
                    else f"fxopt {mine / theirs:.2f}× faster"
                )
                parts.append(f"{compiler} {theirs:.2f}× ({lead})")
        lines.append("- " + "; ".join(parts) + ".")
    if not lines:
        return []
    return [
        "**Where fxopt stands** (best in-process fxopt column vs the best of fuse / "
        "optimize_for_inference / jit.freeze, timed in the same process; against the "
        "compilers, `fxopt own process` when it was run, as they each run in their own):",
        "",
        *lines,
        "",
    ]


def render_inference_threads(data: dict) -> str:
    """The same benchmark at more than one thread (results/inference_2t.json)."""
    return render_inference(data, raw="results/inference_2t.json", png="results/inference_2t.png")


def _inference_kernels(rows: list[dict]) -> list[str]:
    """Per autotuned fxopt variant: the fused kernels the tiler chose, the reorders per
    call and the top ops by self CPU time (torch profiler)."""
    lines = []
    for r in rows:
        extra = r.get("extra") or {}
        layout, prof = extra.get("layout") or {}, extra.get("profile")
        if not prof:
            continue
        top = ", ".join(
            f"{op['op'].split('::')[-1]} {100 * op['share']:.0f}%" for op in prof["top_ops"][:4]
        )
        kernels = layout.get("kernels") or "none (no fused kernels in the chosen layout)"
        lines.append(
            f"| {r['label']} b{r['batch']} | {r['variant'].removesuffix(' +autotune')} | "
            f"{layout.get('chosen', '—')} | {_md(kernels, 160)} | {layout.get('fused_ops', 0)} | "
            f"{prof['reorders_per_call']:g} | {_md(top, 120)} |"
        )
    if not lines:
        return []
    return [
        "**Kernels fxopt chose** (the layout kept; the fused kernels the tiler chose for it, "
        "per pattern of the `cpu` library; ops fused into them; layout reorders per call and "
        "the top ops by self CPU time, from the torch profiler over 3 calls):",
        "",
        "| model | capture | layout | kernels (tiles per pattern) | ops fused | reorders "
        "| top ops (self CPU) |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
        *lines,
        "",
    ]


def render_inference_hf(data: dict) -> str:
    """The same benchmark on transformers' own models (results/inference_hf.json):
    BertModel, and a Llama-shaped decoder's prefill and decode step."""
    llama = any(m.startswith("hf_llama") for m in data["config"].get("models", {}))
    models = "transformers' BertModel (export capture)"
    if llama:
        models = (
            "transformers' BertModel and a Llama-shaped LlamaForCausalLM's prefill and "
            "decode step (decoder_speed.py's model and wrapper: the cache as tensors in and "
            "out; export capture)"
        )
    return render_inference(
        data, raw="results/inference_hf.json", png="results/inference_hf.png", models=models
    )


def render_inference(
    data: dict,
    raw: str = "results/inference.json",
    png: str = "results/inference.png",
    models: str = "",
) -> str:
    cfg = data["config"]
    rows = data["rows"]
    by_key = {(r["label"], r["batch"], r["variant"]): r for r in rows}
    configs = list(dict.fromkeys((r["label"], r["batch"]) for r in rows))
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "eager"]
    image, seq = cfg["image"], cfg["seq"]
    images = any(m in ("resnet50", "mobilenet_v2") for m in cfg.get("models", ["resnet50"]))
    sizes = f"images {image}×{image}, " if images else ""
    sizes += f"BERT {cfg['bert_config']} with {seq} tokens"
    threads = cfg["torch_threads"]
    clock = "wall time" if threads > 1 else "CPU time"
    allocator = (
        " Every process runs with glibc malloc pinned (`"
        + " ".join(f"{k}={v}" for k, v in cfg["allocator"].items())
        + "`): with the defaults a call's cost depends on what the process ran before, up to "
        "2× for eager (docs/measuring.md)."
        if cfg.get("allocator")
        else ""
    )
    quick = (
        " **Run with `--quick`** (smaller inputs, fewer runs): the full sizes (224×224, 128 "
        "tokens) did not fit the time available on this loaded machine."
        if cfg.get("quick")
        else ""
    )

    def cell(r: dict | None) -> str:
        if r is None:
            return "—"
        if r["status"] == "failed":
            return "fails: " + _md(r.get("error") or "?", 80)
        text = f"{r['speedup']:.2f}×" if r.get("speedup") else "—"
        if r["status"] != "ok":
            text += f" (outputs differ: {_md(r.get('error') or '', 60)})"
        if (r.get("extra") or {}).get("same_module_as"):
            text += "†"
        return f"**{text}**" if r["variant"].startswith("fxopt") else text

    speed = [
        [f"{label} b{batch}", _ms(by_key.get((label, batch, "eager"), {}).get("median_ms"))]
        + [cell(by_key.get((label, batch, v))) for v in variants]
        for label, batch in configs
    ]
    setup = [
        [f"{label} b{batch}"] + [_setup_cell(by_key.get((label, batch, v))) for v in variants]
        for label, batch in configs
    ]
    worst = max(
        (r["max_abs_error"] for r in rows if r.get("max_abs_error") is not None), default=None
    )
    out = [
        "## Inference latency"
        + (f" of {models}" if models else "")
        + ": fxopt vs torch.fx, TorchScript, torch.compile, ONNX Runtime"
        + (f" ({threads} threads)" if threads > 1 else ""),
        "",
        f"CPU inference, {sizes}, batch {' and '.join(map(str, cfg['batches']))}, "
        f"{threads} torch thread{'s' if threads > 1 else ''}. Cells: speedup over eager "
        f"(eager median / variant median, per-call {clock}, variants interleaved round-robin "
        "in one process after warm-up). `torch.compile` and ONNX Runtime each run in their "
        "own process, against eager timed in that process." + quick + allocator,
        "",
        run_line(data),
        "",
        table(["model", "eager", *variants], speed, "lr" + "r" * len(variants)),
        "",
        "Every variant's outputs were compared with eager's (`fxopt.verify.compare`); "
        + (f"the largest difference was {worst:.2g}. " if worst is not None else "")
        + "Speedups within ~0.1 of each other are noise on this machine. † autotuning kept "
        "the plain graph: the same module as the column before, timed once.",
        "",
        "**One-time cost** (wall seconds on a loaded machine: trace, fuse, optimize with "
        "verification, autotune, compile from a cold cache, ONNX export):",
        "",
        table(["model", *variants], setup, "l" + "r" * len(variants)),
        "",
    ]
    out += _inference_standing(rows)
    out += _inference_kernels(rows)
    layouts = _inference_layouts(rows)
    if layouts:
        out += [
            "**Layout chosen by fxopt's autotuning** (median ms per candidate in its own "
            "short timing):",
            "",
        ]
        out += [*layouts, ""]
    out += ["### What each column is", ""]
    out += [f"- **{v}**: {note}" for v, note in data.get("variants", {}).items()]
    out += [
        "",
        f"![speedup vs eager]({png})",
        "",
        f"Raw data (every sample): [{raw}]({raw}). "
        "Details: [benchmarks/README.md](benchmarks/README.md).",
    ]
    return "\n".join(out)


def render_transformers_speed(data: dict) -> str:
    rows = data["rows"]

    def cell(entry: dict) -> str:
        if "error" in entry:
            return "fails: " + _md(entry["error"], 60)
        mark = "" if entry.get("verified") else " (not verified)"
        return f"{entry['speedup']:.2f}×{mark}" if entry.get("speedup") else "—"

    body = [
        [
            r["model"],
            cell(r.get("passes only", {})),
            f"**{cell(r.get('speed preset', {}))}**",
            str(r.get("speed preset", {}).get("layout") or "—"),
            _md(r.get("speed preset", {}).get("kernels") or "—", 90),
            _setup_cell({"status": "ok", "setup_s": r.get("speed preset", {}).get("setup_s")}),
        ]
        for r in rows
    ]
    speedups = [
        r["speed preset"]["speedup"] for r in rows if r.get("speed preset", {}).get("speedup")
    ]
    before = [r["passes only"]["speedup"] for r in rows if r.get("passes only", {}).get("speedup")]
    summary = []
    if speedups and before:
        summary = [
            f"Passes only: {min(before):.2f}–{max(before):.2f}× the model's speed; the speed "
            f"preset with its layout step: {min(speedups):.2f}–{max(speedups):.2f}×. "
            "Speedups within ~0.1 of 1.00 are this machine's noise: each figure is the "
            "report's own interleaved timing of the model and the result. Where the model "
            "itself is kept (`original`), what separates it from 1.00× is what every "
            "optimized module pays per call: the input guard (15–17 µs for export graphs, "
            "see the guard section) and the wrapper's call, a few percent of these sub-"
            "millisecond models and 0.01% of ResNet-50's or BERT-base's call.",
            "",
        ]
    return "\n".join(
        [
            "## Never slower than the model: the speed preset on Hugging Face models",
            "",
            '`fxopt.optimize(model, inputs, mode="export")` on transformers architectures '
            "(small configs, random weights), by the report's own speedup (original vs "
            "optimized, interleaved, 1 thread). The layout step measures the fused-kernel "
            "candidates against the plain graph and the unmodified model behind the input "
            "guard (`original`), and keeps the fastest.",
            "",
            run_line(data),
            "",
            table(
                ["model", "passes only", "speed preset", "layout kept", "kernels", "setup s"],
                body,
                "lrrllr",
            ),
            "",
            *summary,
            "![speed preset on transformers](results/transformers_speed.png)",
        ]
    )


def render_decoder_speed(data: dict) -> str:
    rows = data["rows"]
    names = ("eager", "fxopt", "torch.compile", "onnxruntime")

    def cell(row: dict, name: str) -> str:
        entry = row.get("variants", {}).get(name, {})
        if "ms" not in entry:
            return "fails: " + _md(entry.get("error") or row.get("error") or "not run", 50)
        if name == "eager":
            return f"{entry['ms']:.2f} ms"
        return f"{entry['ms']:.2f} ms ({entry['speedup']:.2f}×)"

    body = [
        [
            r["step"],
            str(r["threads"]),
            str(r["batch"]),
            str(r["length"]),
            *(cell(r, n) for n in names),
            {True: "yes", False: "**no**"}.get(r.get("greedy_tokens_equal"), "—"),
        ]
        for r in rows
    ]
    ratios = [
        r["variants"]["fxopt"]["ms"] / r["variants"]["torch.compile"]["ms"]
        for r in rows
        if "ms" in r.get("variants", {}).get("fxopt", {})
        and "ms" in r.get("variants", {}).get("torch.compile", {})
    ]
    level = [ratio <= 1.0 for ratio in ratios]
    close = [ratio <= 1.03 for ratio in ratios]
    config = data["config"]
    generation = _generation_table(rows)
    return "\n".join(
        [
            "## Language-model decode and prefill: fxopt against torch.compile and ORT",
            "",
            f"transformers' `{config['model']}` at hidden {config['hidden_size']}, "
            f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} query and "
            f"{config['num_key_value_heads']} key/value heads, vocabulary "
            f"{config['vocab_size']} (random weights). Decode: one token against a "
            "DynamicCache of `length` tokens; prefill: a `length`-token prompt. Per row, in "
            "one process, every variant is timed interleaved (median wall ms; speedup over "
            "eager). torch.compile runs with freezing; ONNX Runtime with ORT_ENABLE_ALL "
            "(its threads do not spin between runs, which took the CPU from the variant timed "
            "next). "
            f"Greedy: {config['new_tokens']} tokens generated with fxopt's decode step equal "
            "eager's.",
            "",
            run_line(data),
            "",
            table(
                ["step", "threads", "batch", "length", *names, "greedy = eager"],
                body,
                "lrrrrrrrl",
            ),
            "",
            f"fxopt is at least level with torch.compile+freezing on {sum(level)} of "
            f"{len(level)} rows, and within 3% of it on {sum(close)}.",
            *generation,
        ]
    )


def _generation_table(rows: list[dict]) -> list[str]:
    """The decode rows' generation loops (median step, cache growing a token a step)."""
    names = ("eager", "fxopt", "torch.compile")
    found = [r for r in rows if r.get("generation_step_ms")]
    if not found:
        return []

    def cell(row: dict, name: str) -> str:
        ms = row["generation_step_ms"].get(name)
        if ms is None:
            return "—"
        eager = row["generation_step_ms"].get("eager")
        return f"{ms:.2f} ms" + (f" ({eager / ms:.2f}×)" if eager and name != "eager" else "")

    body = [
        [str(r["threads"]), str(r["batch"]), str(r["length"]), *(cell(r, n) for n in names)]
        for r in found
    ]
    return [
        "",
        "In a greedy generation loop (the prompt of `length` tokens, then a step per new "
        "token, each on a cache one token longer: the median step; speedup over eager):",
        "",
        table(["threads", "batch", "prompt", *names], body, "rrrrrr"),
    ]


def render_kernel_gap(data: dict) -> str:
    """Where the gap to ONNX Runtime on the CNNs comes from (benchmarks/kernel_gap.py)."""
    cfg = data["config"]
    rows = []
    for r in data["rows"]:
        lat, ours, theirs = r["latency_ms"], r["fxopt_profile"], r["ort_profile"]
        floor = r["onednn_conv_floor"]["ms"]
        mine, other = ours["ms_per_call"], theirs["ms_per_call"]
        ratio = lat["fxopt"] / lat["onnxruntime"]
        rows.append(
            [
                f"{r['label']} b{r['batch']}",
                f"{lat['fxopt']:.1f} / {lat['onnxruntime']:.1f} ({ratio:.2f}×)",
                f"{mine.get('conv', 0):.1f} ({ours['conv_calls']})",
                f"{other.get('conv', 0):.1f} ({theirs['conv_calls']})",
                f"{mine.get('other', 0) + mine.get('reorder', 0):.1f}",
                f"{other.get('other', 0) + other.get('reorder', 0):.1f}",
                f"{floor:.1f} ({floor / lat['onnxruntime']:.2f}× ORT's call)",
            ]
        )
    return "\n".join(
        [
            "## Where the gap to ONNX Runtime on the CNNs comes from",
            "",
            f"Images 224×224, 1 thread, onnxruntime {cfg['onnxruntime']}, each runtime's own "
            f"profiler over {cfg['calls']} calls after warm-up (`benchmarks/kernel_gap.py`). "
            "fxopt runs its `speed` result (oneDNN kernels with fused activations and "
            "residual adds, packed weights); ORT its session at `ORT_ENABLE_ALL` (MLAS "
            "kernels, its own fusions). Latency: median CPU ms per call without a profiler. "
            "Conv kernels and the rest: self ms per call under the profilers (which add "
            "their own cost per op), convolution calls in brackets. The floor: each of the "
            "model's convolutions alone on oneDNN's fused kernel (channels-last, packed "
            "weights, hot caches, nothing between calls), median time summed.",
            "",
            run_line(data),
            "",
            table(
                [
                    "model",
                    "latency ms fxopt / ORT",
                    "conv kernels ms, fxopt",
                    "conv kernels ms, ORT",
                    "rest ms, fxopt",
                    "rest ms, ORT",
                    "oneDNN conv floor ms",
                ],
                rows,
                "lrrrrrr",
            ),
            "",
        ]
    )


def _md(text: str, limit: int) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _ms(ms: float | None) -> str:
    return "—" if ms is None else f"{ms:.1f} ms"


def _setup_cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if r["status"] == "failed" or r.get("setup_s") is None:
        return "—"
    return f"{r['setup_s']:.1f}"


def _inference_layouts(rows: list[dict]) -> list[str]:
    """One line per autotuned variant; when it left the plain graph, how the choice fared
    in the interleaved benchmark next to the plain graph (a separate measurement)."""
    by_key = {(r["label"], r["batch"], r["variant"]): r for r in rows}
    lines = []
    for r in rows:
        layout = (r.get("extra") or {}).get("layout")
        if not layout:
            continue
        timings = ", ".join(f"{k} {v:.1f}" for k, v in layout.get("median_ms", {}).items())
        rejected = "; ".join(f"{k}: {_md(v, 60)}" for k, v in layout.get("rejected", {}).items())
        plain = by_key.get((r["label"], r["batch"], r["variant"].removesuffix(" +autotune")))
        verdict = ""
        if layout.get("chosen") != "plain" and plain and plain.get("speedup") and r.get("speedup"):
            gain = r["speedup"] - plain["speedup"]
            word = "confirmed" if gain > 0.1 else "not confirmed" if gain < -0.1 else "within noise"
            verdict = (
                f"; in the benchmark {r['speedup']:.2f}× vs {plain['speedup']:.2f}× "
                f"for the plain graph ({word})"
            )
        lines.append(
            f"- {r['label']} b{r['batch']}, {r['variant']}: **{layout.get('chosen')}**"
            + (f" ({timings})" if timings else "")
            + verdict
            + (f"; rejected: {rejected}" if rejected else "")
        )
    return lines


def render_preset_speed(data: dict) -> str:
    rows = data["rows"]
    sizes = sorted({r["size"] for r in rows})
    out = [
        "## Transform speed: the whole `speed` preset vs fuse() and CSEPass",
        "",
        "The five passes of the `speed` preset run to a fixed point by the PassManager (with "
        "lint, invariant checks and each pass's postcondition check), on generated graphs: "
        "`conv-bn` is a module-level CNN graph (Conv2d → BatchNorm2d → ReLU blocks, residual "
        "adds), `mixed` is transform_speed's torch-op graph. `recompile` (the codegen the "
        "PassManager runs once at the end) is its own row. Cells: CPU seconds (median of the "
        "rounds; the tools of a family run round-robin) and nodes/s; "
        "`max error` is each tool's output against the original graph's at the smallest size.",
        "",
        machine_line(data) + f" `{data.get('command', '')}`.",
        "",
    ]
    growth = {(g["family"], g["tool"], g["from"]): g["ratio"] for g in data.get("growth", [])}
    for family in dict.fromkeys(r["family"] for r in rows):
        headers = [
            "tool",
            *[f"{s:,} nodes" for s in sizes],
            *[f"t({short(b)}) / t({short(a)})" for a, b in itertools.pairwise(sizes)],
            "max error",
        ]
        body = []
        for tool in dict.fromkeys(r["tool"] for r in rows if r["family"] == family):
            by_size = {r["size"]: r for r in rows if r["family"] == family and r["tool"] == tool}
            cells = [f"**{tool}**" if tool.startswith("fxopt") else tool]
            for size in sizes:
                r = by_size.get(size)
                cells.append(
                    "—" if r is None else f"{r['seconds']:.3f} s · {r['nodes_per_s'] / 1000:.1f}k/s"
                )
            for a, _ in itertools.pairwise(sizes):
                ratio = growth.get((family, tool, a))
                cells.append("—" if ratio is None else f"{ratio:.1f}")
            errors = [
                r["max_abs_error"] for r in by_size.values() if r["max_abs_error"] is not None
            ]
            cells.append(f"{errors[0]:.1e}" if errors else "—")
            body.append(cells)
        out += [f"### {family}", "", table(headers, body), ""]
    out += _preset_aim(rows, growth, data.get("same_round_ratios", []))
    return "\n".join(out)


def _preset_aim(rows: list[dict], growth: dict, ratios: list[dict]) -> list[str]:
    """The issue's aim, checked against this run: under 3 s at 100k nodes, faster per node
    than CSEPass alone, growth about linear (x10 per x10 nodes)."""
    largest = max(r["size"] for r in rows)
    same_round = {(r["family"], r["size"]): r["time_per_node_ratio"] for r in ratios}
    lines = [
        "**Against the aim** (whole preset under 3 s at 100k nodes, faster per node than "
        "`CSEPass`, linear growth). This machine's speed drifts by up to 1.6× from minute to "
        "minute, so the time is given as the median and the fastest of the rounds, and the "
        "per-node comparison with `CSEPass` pairs the two tools round by round:",
        "",
    ]
    for r in rows:
        if r["tool"] != "fxopt speed" or r["size"] != largest:
            continue
        verdict = "met" if r["seconds"] < 3.0 else "not met"
        fastest = r.get("min_seconds", r["seconds"])
        parts = [f"median {r['seconds']:.2f} s ({verdict}), fastest {fastest:.2f} s"]
        ratio = same_round.get((r["family"], largest))
        if ratio is not None:
            parts.append(f"{ratio:.2f}× `CSEPass`'s time per node (same rounds)")
        g = growth.get((r["family"], r["tool"], largest // 10))
        if g is not None:
            # Beside torch's linear-time tools in the same run: at 100k nodes the graphs
            # leave the cache, and every tool's growth moves with the machine.
            torch_growth = [
                v
                for (family, tool, size), v in growth.items()
                if family == r["family"] and size == largest // 10 and not tool.startswith("fxopt")
            ]
            parts.append(f"×{g:.1f} from {largest // 10:,} nodes")
            if torch_growth:
                low, high = min(torch_growth), max(torch_growth)
                parts[-1] += f" (torch's rows in this run: ×{low:.1f} to ×{high:.1f})"
        lines.append(f"- {r['family']}, {r['nodes_before']:,} nodes: " + "; ".join(parts))
    cse = [r for r in rows if r["tool"] == "torch CSEPass" and r["size"] == largest]
    if cse:
        lines.append(
            f"- `CSEPass` alone, same rounds: {cse[0]['nodes_per_s'] / 1000:.1f}k nodes/s "
            f"(median {cse[0]['seconds']:.2f} s, fastest {cse[0].get('min_seconds', 0):.2f} s)"
        )
    return [*lines, ""]


def render_tiling(data: dict) -> str:
    rows = data["rows"]

    def covered(r: dict) -> str:
        return f"{r['covered']:,} ({r['coverage']:.1%})"

    body = []
    for r in rows:
        ilp = r["ilp"]
        agrees = "same optimum" if ilp["agrees"] else "**differs**"
        body.append(
            [
                r["model"],
                f"{r['nodes']:,}",
                f"**{covered(r)}**",
                f"**{r['tiles']}**",
                seconds(r["seconds"]),
                f"{r['match_ms']:.1f} / {r['solve_ms']:.1f} ms",
                f"{r['states']:,}",
                f"{agrees}, {ilp['solve_ms']:.0f} ms",
                f"{covered(r['greedy'])}, {r['greedy']['tiles']} tiles",
                f"{covered(r['greedy_alphabetical'])}, {r['greedy_alphabetical']['tiles']} tiles",
            ]
        )
    headers = [
        "graph",
        "nodes",
        "fxopt covered",
        "fxopt tiles",
        "fxopt time (CPU)",
        "match / solve (wall)",
        "states",
        "ILP (HiGHS)",
        "greedy, library order",
        "greedy, alphabetical order",
    ]
    growth = [
        f"L={g['from']}→{g['to']}: time ×{g['time_ratio']:.1f} for ×{g['to'] / g['from']:g} "
        f"layers (log-log slope {g['slope']:.2f}), states ×{g['states_ratio']:.1f}"
        for g in data.get("growth", [])
        if g.get("time_ratio")
    ]
    uncovered = rows[-1]["uncovered_by_op"] if rows else {}
    ties = [
        r["model"]
        for r in rows
        if (r["greedy"]["covered"], r["greedy"]["tiles"]) == (r["covered"], r["tiles"])
    ]
    verdict = (
        f"Greedy in the library's largest-first order reaches the optimum on {len(ties)} of "
        f"{len(rows)} graphs here; in alphabetical order single-op kernels (`add`, `linear`) "
        "claim nodes first and coverage drops to about half. fxopt's result does not depend "
        "on pattern order. (Where largest-first greedy loses even so: the 5-op chain in "
        "tests/test_tiling.py, 3 tiles instead of 2.)"
    )
    return "\n".join(
        [
            f"## Tiling: covering transformer graphs with the `{data['library']}` library",
            "",
            "`fxopt.tiling.tile` on a compact BERT encoder (`zoo:bert`, config `tiny`, "
            "fx capture, eval dropout elided) at L layers and on a bert-base "
            "`transformers.BertModel` (random weights, `torch.export`): nodes covered, "
            "tiles, CPU time of matching + exact solving (median of "
            f"{data.get('repeats', '?')}), states the exact search explored, and the same "
            "placements solved by the HiGHS ILP. *Greedy* takes placements in pattern order "
            "then graph order, each one that overlaps none taken before — the choice "
            "`torch.fx` `replace_pattern` makes when called once per pattern — with the "
            "library in its own (largest-first) order and in alphabetical order.",
            "",
            machine_line(data) + f" `{data.get('command', '')}`.",
            "",
            table(headers, body, "lrrrrrrlll"),
            "",
            "Growth: " + "; ".join(growth) + "." if growth else "",
            "",
            verdict,
            "",
            f"Uncovered in the last graph, by op: {uncovered}."
            if uncovered
            else "Every node of the last graph is covered.",
            "",
            "![tiling time and coverage](results/tiling.png)",
        ]
    )


def render_remat(data: dict) -> str:
    """Remat: peak / saved activation memory and step time, ratios to eager."""
    cfg = data.get("config", {})
    out = [
        "## Remat: training memory vs time (fxopt.remat vs checkpoint and min-cut)",
        "",
        "One training step (forward, loss, backward) per variant. **peak**: peak activation +"
        " temporary memory, **saved**: bytes live at the forward/backward boundary (profiler"
        " allocation events; parameters and parameter gradients excluded), **time**: median"
        " CPU time of a step (1 thread, variants interleaved); all ratios to eager in the same"
        " run. fxopt budgets are fractions of the baseline's simulated peak; `est. peak` is"
        " the cost model's. Aim: 0.50× peak at ≤ 1.10× time; every-block checkpoint's peak"
        " at ≤ 1.25× time; peak never rising as the budget falls.",
        "",
        run_line(data, " (quick configuration)." if cfg.get("quick") else "."),
        "",
    ]
    for result in data["models"]:
        rows = []
        for r in result["rows"]:
            if r["status"] != "ok":
                rows.append([r["variant"], r["status"], "—", "—", "—", "—", _md(r["error"], 70)])
                continue
            est = r.get("estimated_peak_ratio")
            rows.append(
                [
                    f"**{r['variant']}**" if r["kind"] == "fxopt" else r["variant"],
                    "ok",
                    f"{r['peak_ratio']:.2f}",
                    f"{r['saved_ratio']:.2f}",
                    f"{r['time_ratio']:.2f}",
                    "—" if est is None else f"{est:.2f}",
                    f"{r['max_grad_error']:.1e}",
                ]
            )
        headers = ["variant", "status", "peak", "saved", "time", "est. peak", "grad error"]
        out += [f"### {result['model']}: {result['description']}", ""]
        out += [table(headers, rows, "llrrrrr"), ""]
        out += [_remat_verdict(result), ""]
    out += [
        "![peak activation memory vs step time](results/remat.png)",
        "",
        "Raw data: [results/remat.json](results/remat.json). "
        "Details: [benchmarks/README.md](benchmarks/README.md).",
    ]
    return "\n".join(out)


def _remat_verdict(result: dict) -> str:
    """How close each fxopt planner got to the aims, from the measured rows."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    ckpt = next((r for r in ok if r["kind"] == "checkpoint"), None)
    lines = []
    for planner in dict.fromkeys(r["planner"] for r in result["rows"] if r["planner"]):
        mine = sorted((r for r in ok if r["planner"] == planner), key=lambda r: -r["budget"])
        if not mine:
            lines.append(f"- {planner}: no budget of the grid was reachable (or it failed).")
            continue
        best = min(mine, key=lambda r: r["peak_ratio"])
        text = f"- {planner}: lowest peak {best['peak_ratio']:.2f}× at {best['time_ratio']:.2f}×"
        half = [r for r in mine if r["peak_ratio"] <= 0.52]
        if half:
            text += f"; 0.50× peak at {min(r['time_ratio'] for r in half):.2f}× time"
        else:
            text += "; 0.50× peak not reached"
        if ckpt:
            match = [r for r in mine if r["peak_ratio"] <= ckpt["peak_ratio"] + 0.02]
            if match:
                text += (
                    f"; checkpoint's {ckpt['peak_ratio']:.2f}× peak at "
                    f"{min(r['time_ratio'] for r in match):.2f}× time "
                    f"(checkpoint itself: {ckpt['time_ratio']:.2f}×)"
                )
            else:
                text += f"; checkpoint's {ckpt['peak_ratio']:.2f}× peak not reached"
        peaks = [r["peak_ratio"] for r in mine]
        if any(b > a + 0.02 for a, b in itertools.pairwise(peaks)):
            text += "; **the measured peak rose as the budget fell**"
        lines.append(text + ".")
    # Same seed before every variant's first step: a gradient that differs from eager's
    # means that variant computed something else (e.g. a dropout mask drawn twice).
    for r in ok:
        error = r.get("max_grad_error")
        if error is not None and error > 1e-3:
            lines.append(
                f"- **{r['variant']}: gradients differ from eager's by {error:.1e}** under the "
                "same seed: its backward does not use its forward's values (torch's min-cut "
                "re-draws dropout masks in the backward; see docs/remat.md)."
            )
    return "\n".join(lines)


def render_circle_decoders(data: dict) -> str:
    """The language models of ``benchmarks/circle.py --decoders``, in render_circle's table."""
    rows = data["rows"]
    third = set(data.get("config", {}).get("third_party", ()))
    won = sum(
        1
        for model in dict.fromkeys(r["model"] for r in rows)
        if _fewer_or_equal_operators(rows, model)
    )
    mine = sum(1 for r in rows if r["tool"] == "fxopt" and r.get("validated"))
    theirs = sum(1 for r in rows if r["tool"] == "tico" and r.get("validated"))
    total = len({r["model"] for r in rows})
    tables = render_circle(
        data,
        title="Circle conversion of language models: fxopt vs TICO",
        third_intro="transformers' decoders (the DynamicCache of a decode step as tensors)",
    )
    intro = (
        "The zoo's own Llama-shaped decoder (families llama, qwen2, gemma; a prefill of 15 "
        "tokens, and one decode step on a static 32-slot KV cache) and transformers' Llama, "
        "Qwen2, Mistral and Gemma 3 (hidden 64, 2 layers, grouped-query attention; a prefill "
        "of 2 × 16 tokens with padding, and one decode step on a 15-token DynamicCache passed "
        f"as tensors). Validated: fxopt {mine} of {total}, TICO {theirs} of {total}; fxopt's "
        f"file has at most TICO's operator count on {won} of {total} "
        f"({len(third)} from transformers)."
    )
    head, _, rest = tables.partition("\n\n")
    return "\n\n".join([head, intro, rest])


def render_tico_modules(data: dict) -> str:
    """TICO's own module tests (``benchmarks/tico_modules.py``): how many each tool's file
    validates, operators where both do, and every module fxopt misses, with its reason."""
    summary, rows = data["summary"], data["rows"]
    scored = [r for r in rows if r["status"] == "scored"]
    set_apart = {k: v for k, v in summary["by_status"].items() if k != "scored"}
    apart = ", ".join(f"{v} {k}" for k, v in sorted(set_apart.items())) or "none"
    runtimes = Counter(r["fxopt"].get("runtime") for r in scored if r["fxopt"]["validated"])
    tico_runtimes = Counter(r["tico"].get("runtime") for r in scored if r["tico"]["validated"])
    body = [
        ["validated (onert, else LiteRT)", summary["fxopt_validated"], summary["tico_validated"]],
        ["  in onert", runtimes.get("onert", 0), tico_runtimes.get("onert", 0)],
        ["  in LiteRT", runtimes.get("litert", 0), tico_runtimes.get("litert", 0)],
        ["converted", "–", summary["tico_converted"]],
        [
            f"operators, on the {summary['both_validated']} both validate",
            summary["operators_fxopt_both"],
            summary["operators_tico_both"],
        ],
        ["modules with fewer operators", summary["fxopt_fewer_ops"], summary["fxopt_more_ops"]],
    ]
    misses = [
        [r["module"], r["fxopt"].get("error", "not validated")[:160]]
        for r in scored
        if not r["fxopt"]["validated"]
    ]
    parts = [
        "## TICO's module tests: fxopt vs TICO",
        f"{run_line(data)} Every module of TICO's `test/modules/op` and `test/modules/net` "
        f"({summary['modules']}; set apart: {apart}), built as TICO's runner builds it "
        f"(its example inputs and dynamic shapes), {summary['scored']} scored. fxopt: "
        "`circle.convert` with its own validation (the example and a second input). TICO: "
        "`tico.convert`, the file run on the example in onert, else LiteRT, at the module's "
        "tolerance (TICO's own runner uses its reference interpreter for files onert cannot "
        "run, which is not installed here).",
        table(["", "fxopt", "TICO"], body, "lrr"),
    ]
    if misses:
        parts += ["Modules fxopt does not validate:", table(["module", "why"], misses)]
    return "\n\n".join(parts)


def _fewer_or_equal_operators(rows: list[dict], model: str) -> bool:
    by = {r["tool"]: r for r in rows if r["model"] == model}
    mine, theirs = by.get("fxopt", {}), by.get("tico", {})
    if not mine.get("validated"):
        return False
    if not theirs.get("converted"):
        return True
    return mine["operators"] <= theirs["operators"]


def render_circle(
    data: dict,
    title: str = "Circle conversion: fxopt vs TICO",
    third_intro: str = (
        "Third-party architectures (transformers' models from small configs, timm's models "
        "named timm_* at 128 × 128, and a DenseNet-121 of our own; weights redrawn at a "
        "trained model's scale)"
    ),
) -> str:
    rows = data["rows"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    by = {(r["model"], r["tool"]): r for r in rows}

    def cell(r: dict | None, key: str, fmt: str = "{}") -> str:
        if r is None or not r.get("converted"):
            return "failed"
        value = r.get(key)
        return "–" if value is None else fmt.format(value)

    def validated(r: dict | None) -> str:
        if r is None or not r.get("converted"):
            return "not converted"
        if not r.get("runs"):
            return "no runtime runs it"
        if r.get("shape_differs"):
            return f"NO: output shape differs ({r.get('runtime', 'onert')})"
        return f"{'yes' if r.get('validated') else 'NO'} ({r.get('runtime', 'onert')})"

    third = set(data.get("config", {}).get("third_party", ()))
    bodies: dict[bool, list] = {False: [], True: []}
    for model in models:
        f, t = by.get((model, "fxopt")), by.get((model, "tico"))
        ratio = "–"
        if f and t and f.get("latency_ms") and t.get("latency_ms"):
            ratio = f"{f['latency_ms'] / t['latency_ms']:.2f}"
        bodies[model in third].append(
            [
                model,
                f"{validated(f)} / {validated(t)}",
                f"{cell(f, 'operators')} / {cell(t, 'operators')}",
                f"{cell(f, 'transposes')} / {cell(t, 'transposes')}",
                f"{cell(f, 'convert_s', '{:.1f}')} / {cell(t, 'convert_s', '{:.1f}')}",
                f"{cell(f, 'bytes', '{:,}')} / {cell(t, 'bytes', '{:,}')}",
                ratio,
                f"{cell(f, 'max_abs_error', '{:.1e}')} / {cell(t, 'max_abs_error', '{:.1e}')}",
            ]
        )
    headers = [
        "model",
        "validated (fxopt / tico)",
        "operators",
        "TRANSPOSE",
        "convert s",
        "file bytes",
        "onert latency fxopt/tico",
        "max abs error",
    ]

    def count(tool: str, runtime: str | None = None) -> int:
        return sum(
            1
            for r in rows
            if r["tool"] == tool
            and r["model"] in third
            and r.get("validated")
            and (runtime is None or r.get("runtime") == runtime)
        )

    counts = {tool: count(tool) for tool in ("fxopt", "tico")}
    in_onert = {tool: count(tool, "onert") for tool in ("fxopt", "tico")}
    third_table = []
    if bodies[True]:
        third_table = [
            "",
            f"{third_intro}: fxopt "
            f"validates {counts['fxopt']} of {len(third)}, TICO {counts['tico']}; in onert "
            f"itself, fxopt {in_onert['fxopt']}, TICO {in_onert['tico']}.",
            "",
            table(headers, bodies[True]),
        ]
    return "\n".join(
        [
            f"## {title}",
            "",
            "Each model converted by `fxopt.circle.convert` (conversion alone, "
            "`validate=False`) and by `tico.convert` (0.3.0) in the same run; both files run "
            "in onert 0.1.0 (cpu), or in LiteRT where onert cannot run the file (the same "
            "rule for both), and compared with PyTorch: validated when every output matches "
            "within rtol = atol = 1e-4 (a file whose outputs have another shape is not "
            "validated; its error is measured on the values reshaped). hf_bert is "
            "transformers' `BertModel` from a config (random weights) with an attention "
            "mask. Latency: median of 20 runs in onert, one thread.",
            "",
            run_line(data),
            "",
            table(headers, bodies[False]),
            *third_table,
            "",
        ]
    )


def render_guard(data: dict) -> str:
    body = []
    for r in data["rows"]:
        options = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        body.append(
            [
                f"{r['model']} ({options})" if options else r["model"],
                r["mode"],
                r["contract"].replace("\n", "; "),
                f"{r['guard_us']:.1f}",
                f"{r['contract_us']:.1f}" if "contract_us" in r else "–",
                f"{r['latency_ms']['bare']:.3f}",
                f"{r['guard_fraction_of_latency']:.1e}",
                f"{r['guarded_over_bare']:.3f}",
            ]
        )
    headers = [
        "model",
        "capture",
        "contract",
        "guard µs/call",
        "of which fxopt's contract",
        "module ms (no guard)",
        "guard / latency",
        "guarded / unguarded, timed",
    ]
    return "\n".join(
        [
            "## Input guard: the cost of checking every call",
            "",
            "Every optimized module first checks its inputs against its contract (dtype, "
            "device, rank, static dims, dynamic-dim ranges and relations, memory format when "
            "pinned; for export graphs also torch.export's own guard function). `guard "
            "µs/call`: the check alone, median of 7 × 2000 calls (CPU time); the rest of it, "
            "in export rows, is torch.export's own guard function. The last column "
            "times the optimized module with and without its guard, interleaved; it moves by "
            "a few percent from run to run on this machine, far more than the guard costs. "
            "One thread; speed preset passes, dynamic batch, no layout step.",
            "",
            machine_line(data) + f" `{data.get('command', '')}`",
            "",
            table(headers, body),
            "",
        ]
    )


def render_circle_ab(data: dict) -> str:
    body = [
        [
            r["model"],
            f"{r['operators_base']} → {r['operators_head']}",
            "yes" if r["same_operators"] else "**no**",
            f"{r['convert_s_base']:.3f}",
            f"{r['convert_s_head']:.3f}",
            f"{r['head_over_base']:.2f}",
        ]
        for r in data["rows"]
    ]
    headers = ["model", "operators", "identical lists", "convert s, base", "head", "head/base"]
    return "\n".join(
        [
            "## Circle converter: this checkout against an earlier revision",
            "",
            f"Base revision `{data['base']}`, {data['rounds']} rounds alternating the two "
            "revisions, each in its own process; CPU seconds of `circle.convert` (best of two "
            "after a warm-up), median over rounds.",
            "",
            machine_line(data) + f" `{data.get('command', '')}`",
            "",
            table(headers, body),
            "",
        ]
    )


def render_preset_ab(data: dict) -> str:
    body = [
        [
            r["family"],
            short(r["size"]),
            f"{r['nodes_before']} → {r['nodes_after_head']}",
            "yes" if r["same_graph"] else "**no**",
            f"{r['seconds_base']:.3f}",
            f"{r['seconds_head']:.3f}",
            f"{r['head_over_base']:.2f}",
            f"{r['paired_head_over_base']:.2f}",
        ]
        for r in data["rows"]
    ]
    headers = ["graph", "size", "nodes", "same graph", "base s", "head s", "head/base", "paired"]
    passes = [
        [r["family"], name, f"{base:.1f}", f"{r['pass_ms_head'].get(name, 0.0):.1f}"]
        for r in data["rows"]
        for name, base in r["pass_ms_base"].items()
    ]
    return "\n".join(
        [
            "## Speed preset: this checkout against an earlier revision",
            "",
            f"Base revision `{data['base']}`, {len(data['rows'][0]['samples_base'])} rounds "
            "alternating the two revisions, each sample in its own process on a freshly built "
            "graph; CPU seconds of the whole `speed` preset (PassManager, up to 4 rounds, with "
            "lint, invariants and every pass's verify), median over rounds; paired: the median "
            "of the per-round ratios. Same graph: node counts and op histograms of the results "
            "are identical.",
            "",
            machine_line(data) + f" `{data.get('command', '')}`",
            "",
            table(headers, body),
            "",
            "Milliseconds per pass (median):",
            "",
            table(["graph", "pass", "base ms", "head ms"], passes),
            "",
        ]
    )


def render_quantize(data: dict) -> str:
    rows = data["rows"]
    cnns = ("cnn_bn", "resnet18", "mobilenet_v2")

    def runs(r: dict) -> str:
        if not r.get("converted"):
            return f"not converted ({r.get('error', '')[:60]})"
        if r["tool"] != "tico":
            return f"{'yes' if r.get('validated') else 'NO'} ({r.get('runtime')})"
        if r.get("runtime"):
            return f"runs ({r['runtime']})"
        return "runs nowhere"

    def num(r: dict, key: str, fmt: str) -> str:
        value = r.get(key)
        return "–" if value is None else fmt.format(value)

    def compute_ops(r: dict) -> int | None:
        """Operators other than QUANTIZE / DEQUANTIZE (which a runnable file needs around
        every float island, and TICO's files replace by mixed-type operators)."""
        counts = r.get("op_counts")
        if not counts:
            return None
        return sum(n for op, n in counts.items() if op not in ("QUANTIZE", "DEQUANTIZE"))

    body = []
    for r in rows:
        source = r.get("sqnr_source") or ""
        sqnr = num(r, "sqnr_db", "{:.1f}") + ("*" if source.startswith("fake-quant") else "")
        latency = "–"
        if r.get("latency_ms"):
            latency = f"{r['latency_ms']:.2f} / {r['float_latency_ms']:.2f}"
        body.append(
            [
                r["model"],
                r["scheme"],
                r["tool"],
                runs(r),
                sqnr,
                num(r, "pt2e_sqnr_db", "{:.1f}") if r["scheme"] == "uint8" else "–",
                num(r, "pt2e_file_sqnr_db", "{:.1f}") if r["scheme"] == "uint8" else "–",
                num(r, "top1_agreement", "{:.0%}"),
                f"{num(r, 'operators', '{}')} ({compute_ops(r) if r.get('op_counts') else '–'})",
                num(r, "transposes", "{}"),
                num(r, "size_vs_float", "{:.2f}"),
                num(r, "convert_s", "{:.1f}"),
                latency,
            ]
        )
    fxopt = [r for r in rows if r["tool"] == "fxopt"]
    tico = [r for r in rows if r["tool"] == "tico"]
    validated = sum(bool(r.get("validated")) for r in fxopt)
    tico_runs = sum(bool(r.get("runtime")) for r in tico)
    near_pt2e = [
        r["model"]
        for r in fxopt
        if r["scheme"] == "uint8" and r.get("sqnr_db") and r.get("pt2e_sqnr_db")
        and r["sqnr_db"] >= r["pt2e_sqnr_db"] - 1.0
    ]  # fmt: skip
    uint8 = [r for r in fxopt if r["scheme"] == "uint8"]
    pt2e_kept = [
        f"{r['model']} {r['pt2e_file_sqnr_db'] - r['pt2e_sqnr_db']:+.1f} dB"
        for r in uint8
        if r.get("pt2e_file_sqnr_db") is not None and r.get("pt2e_sqnr_db") is not None
    ]
    pairs = [
        (r, t)
        for r in fxopt
        for t in tico
        if (t["model"], t["scheme"]) == (r["model"], r["scheme"])
        and r.get("operators") and t.get("operators")
    ]  # fmt: skip
    fewer_ops = [f"{r['model']} {r['scheme']}" for r, t in pairs if r["operators"] < t["operators"]]
    fewer_compute = [
        f"{r['model']} {r['scheme']}" for r, t in pairs if compute_ops(r) < compute_ops(t)
    ]
    cnn_sizes = [
        f"{r['model']} {r['size_vs_float']:.2f}"
        for r in uint8
        if r["model"] in cnns and r.get("size_vs_float")
    ]
    slower = [
        f"{r['model']} {r['latency_ms'] / r['float_latency_ms']:.1f}×"
        for r in uint8
        if r.get("latency_ms")
    ]
    faster = [
        f"{r['model']} {r['latency_ms'] / r['float_latency_ms']:.2f}×"
        for r in rows
        if r["tool"] == "fxopt per-tensor" and r.get("latency_ms")
    ]
    cfg = data.get("config", {})
    return "\n".join(
        [
            "## Quantized Circle: fxopt vs TICO",
            "",
            "Each model quantized after training by `fxopt.quant.quantize` → "
            "`fxopt.circle.convert` and by TICO 0.3.0's PTQ (`tico.quantization.prepare` / "
            "calibrate / `convert` → `tico.convert`; benchmarks/tico_quant.py says how and "
            f"which workarounds it needs) on the same {cfg.get('calibration_batches')} "
            "calibration batches; SQNR against the float model on "
            f"{cfg.get('held_out_batches')} held-out batches, from the runtime that runs the "
            "file (* : no runtime runs it, so the SQNR is TICO's fake-quantized PyTorch "
            "model's). fxopt's files are validated against the quantized model in onert "
            "(uint8) or LiteRT (int16: onert 0.1.0 has no int16 kernel); TICO's are run in "
            "both. PT2E reference: torchao's XNNPACK symmetric per-channel config, same "
            "calibration. fxopt's int16 is 16x8 (8-bit weights, what LiteRT and TFLite-style "
            "NPUs run); TICO's int16 has 16-bit weights, which neither runtime loads. "
            "Latency: onert, median of 30 runs, one thread, quantized / float file.",
            "",
            run_line(data),
            "",
            f"- Validated in a runtime: fxopt {validated} of {len(fxopt)} files; TICO's "
            f"files that run in onert or LiteRT: {tico_runs} of {len(tico)}.",
            f"- uint8 SQNR within 1 dB of the PT2E reference (or above it): "
            f"{', '.join(near_pt2e) or 'none'} (of {len(uint8)}).",
            "- The PT2E model itself converted by fxopt (its integer file against the PT2E "
            f"model, in SQNR to the float model): {', '.join(pt2e_kept) or 'not measured'}.",
            f"- Fewer operators than TICO ({len(fewer_ops)} of {len(pairs)}): "
            f"{', '.join(fewer_ops) or 'none'}; not counting QUANTIZE / DEQUANTIZE (in "
            f"parentheses in the table; {len(fewer_compute)} of {len(pairs)}): "
            f"{', '.join(fewer_compute) or 'none'}.",
            f"- CNN uint8 files against the float file: {', '.join(cnn_sizes)}.",
            f"- onert latency of fxopt's per-channel uint8 file against the float file: "
            f"{', '.join(slower)} (onert 0.1.0's per-channel uint8 kernels are slow); with "
            f"per-tensor weights: {', '.join(faster)}.",
            "",
            table(
                [
                    "model",
                    "scheme",
                    "tool",
                    "validated / runs",
                    "SQNR dB",
                    "PT2E dB",
                    "PT2E file dB",
                    "top-1",
                    "operators (w/o Q/DQ)",
                    "TRANSPOSE",
                    "size / float",
                    "convert s",
                    "onert ms (q / float)",
                ],
                body,
                "llllrrrrrrrr",
            ),
            "",
            "![SQNR and size per model](results/quantize.png)",
            "",
        ]
    )


def render_remat_compile(data: dict) -> str:
    """Remat inside torch.compile: fxopt's backend (fx code, Inductor) vs torch's min-cut."""
    out = [
        "## Remat inside torch.compile (fxopt backend vs torch's min-cut under Inductor)",
        "",
        "One training step per variant; **peak**: peak activation memory (profiler allocation"
        " events, parameters and gradients excluded), **time**: median CPU time per step, both"
        " ratios to eager in the same run (1 thread); **setup**: compile and first step;"
        " **grad error**: largest gradient difference from eager. `inductor min-cut B` is"
        " `torch.compile` with `activation_memory_budget=B`; `fxopt backend+inductor B` is"
        " fxopt's partition with Inductor compiling the graphs. Aims (issue 18): the BN CNN"
        " through the backend within 5 % of `compile_step`'s peak; with Inductor, step time at"
        " budget 0.5 no worse than torch's min-cut at 0.5.",
        "",
        run_line(data),
        "",
    ]
    for result in data["models"]:
        rows = []
        by_name = {r["variant"]: r for r in result["rows"]}
        for r in result["rows"]:
            if r["status"] != "ok":
                rows.append([r["variant"], r["status"], "—", "—", "—", _md(r["error"], 70)])
                continue
            rows.append(
                [
                    f"**{r['variant']}**" if r["kind"].startswith("fxopt") else r["variant"],
                    "ok",
                    f"{r['peak_ratio']:.3f}",
                    f"{r['time_ratio']:.2f}",
                    f"{r['setup_s']:.1f} s",
                    f"{r['max_grad_error']:.1e}",
                ]
            )
        out += [f"### {result['model']}: {result['description']}", ""]
        out += [table(["variant", "status", "peak", "time", "setup", "grad error"], rows, "llrrrr")]
        paired = result.get("inductor_comparison", [])
        out += ["", _remat_compile_verdict(by_name, paired), ""]
        out += _paired_lines(paired)
    if "frontier" in data:
        out += _frontier_section(data["frontier"])
    out.append("Raw data: [results/remat_compile.json](results/remat_compile.json).")
    return "\n".join(out)


def _frontier_section(frontier: dict) -> list[str]:
    """The budget sweep under Inductor: both tools' points, then min-cut's against fxopt's
    fastest at no more memory."""
    by_name = {r["variant"]: r for r in frontier["rows"]}

    def point(name: str) -> list[str]:
        r = by_name.get(name)
        if not r or r["status"] != "ok":
            return [r["status"] if r else "—", "—"]
        return [f"{r['peak_ratio']:.3f}", f"{r['time_ratio']:.3f}"]

    rows = [
        [f"{b:g}", *point(f"fxopt backend+inductor {b}"), *point(f"inductor min-cut {b}")]
        for b in frontier["budgets"]
    ]
    lines = [
        f"### {frontier['model']} under Inductor, budget sweep",
        "",
        "The two tools' budgets measure different things (fxopt: a fraction of the graph's"
        " peak; min-cut: of its saved activations between saving all and recomputing all),"
        " so the same number is not the same memory. Each point below is one budget; the"
        " list after it compares each min-cut point with the fxopt point closest to it at no"
        " more peak memory, time paired by round.",
        "",
        table(
            ["budget", "fxopt peak", "fxopt time", "min-cut peak", "min-cut time"], rows, "lrrrr"
        ),
        "",
        "![peak memory vs step time under Inductor](results/remat_compile.png)",
        "",
    ]
    lines += _same_plan_spread(frontier["rows"])
    for m in frontier.get("equal_memory", []):
        t = m["time_vs_min_cut"]
        if t is None:
            lines.append(
                f"- {m['min_cut']} (peak {m['min_cut_peak']:.3f}): fxopt has no point this low"
            )
            continue
        lines.append(
            f"- {m['min_cut']} (peak {m['min_cut_peak']:.3f}): {m['fxopt']} (peak "
            f"{m['fxopt_peak']:.3f}) takes **{t['median']:.3f}×** its time (95 % interval "
            f"{t['ci95'][0]:.3f}–{t['ci95'][1]:.3f})"
        )
    return [*lines, ""]


def _same_plan_spread(rows: list[dict]) -> list[str]:
    """How far apart the times of one plan compiled several times are (budgets whose
    points share a peak): the resolution of any one comparison in the sweep."""
    by_peak: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["status"] == "ok" and r["budget"] is not None:
            tool = r["variant"].rsplit(" ", 1)[0]
            by_peak.setdefault((tool, round(r["peak_ratio"], 4)), []).append(r)
    lines = []
    for (tool, peak), same in by_peak.items():
        if len(same) > 1:
            times = [r["time_ratio"] for r in same]
            budgets = ", ".join(f"{r['budget']:g}" for r in same)
            lines.append(
                f"Same plan, compiled {len(same)} times: {tool} at budgets {budgets} "
                f"(peak {peak:.3f}) took {min(times):.3f}–{max(times):.3f} of eager's time "
                f"({max(times) / min(times) - 1:.1%} apart)."
            )
    return [" ".join(lines), ""] if lines else []


def _paired_lines(comparisons: list[dict]) -> list[str]:
    """fxopt+Inductor's time over min-cut's, the median of each round's ratio (a round's
    time the mean over each tool's compiles, when there are several)."""
    lines = [
        f"- budget {c['budget']}: fxopt+Inductor / min-cut time, median of {t['rounds']} "
        f"rounds{_over_compiles(c)}: **{t['median']:.3f}×** (95 % interval "
        f"{t['ci95'][0]:.3f}–{t['ci95'][1]:.3f})"
        for c in comparisons
        for t in [c["time_vs_min_cut"]]
    ]
    return [*lines, ""] if lines else []


def _over_compiles(comparison: dict) -> str:
    n = comparison.get("compiles", 1)
    return f", each the mean over {n} compiles of each tool" if n > 1 else ""


def _remat_compile_verdict(rows: dict, comparisons: list[dict]) -> str:
    parts = []
    for budget in (0.5, 0.7):
        step, ours = rows.get(f"fxopt step {budget}"), rows.get(f"fxopt backend {budget}")
        if step and ours and step["status"] == ours["status"] == "ok":
            parts.append(
                f"budget {budget}: backend peak {ours['peak_ratio']:.3f} vs compile_step's "
                f"{step['peak_ratio']:.3f} ({ours['peak_ratio'] / step['peak_ratio']:.3f}×)"
            )
        fused, theirs = (
            rows.get(f"fxopt backend+inductor {budget}"),
            rows.get(f"inductor min-cut {budget}"),
        )
        if fused and theirs and fused["status"] == theirs["status"] == "ok":
            paired = next((c for c in comparisons if c["budget"] == budget), None)
            ratio = (
                paired["time_vs_min_cut"]["median"]
                if paired
                else fused["time_ratio"] / theirs["time_ratio"]
            )
            parts.append(
                f"budget {budget} under Inductor: fxopt peak {fused['peak_ratio']:.3f} vs "
                f"min-cut {theirs['peak_ratio']:.3f}, time ratio {ratio:.3f}×"
                + (" (paired, below)" if paired else "")
            )
    return "; ".join(parts) + "." if parts else ""


def render_weight_only(data: dict) -> str:
    """Weight-only files for onert: fxopt's ggml formats against TICO's weight-only path."""
    out = [
        "## Weight-only quantization of language models (fxopt ggml files vs TICO)",
        "",
        "Logits of a 16-token prefill. **onert**: the file loads and runs in onert (fxopt's"
        " are also validated against the quantized model they compute); **SQNR**: the"
        " logits against the float model on 8 held-out prompts, from onert where it runs"
        " the file, else from the tool's PyTorch model (*torch*); **size**, **latency**:"
        " against fxopt's float file in onert. fxopt `q8_0`/`q4_0`: ggml block weights"
        " (8.5 / 4.5 bits a weight; in `q4_0` the embedding table too); TICO `uint8`/`uint4`:"
        " `PTQConfig(activation=no_quant(), weight=affine(uint8|uint4))`, per-channel"
        " asymmetric weights.",
        "",
        run_line(data),
        "",
    ]
    for result in data["models"]:
        rows = []
        for r in result["rows"]:
            if r["status"] != "ok":
                rows.append([r["tool"], r["format"], _md(r["status"], 60), "—", "—", "—"])
                continue
            runs = (
                "yes" if r.get("loads_in_onert") else "**no**: " + _md(r.get("onert_error", ""), 40)
            )
            origin = "" if r.get("sqnr_from") == "onert" else " (*torch*)"
            latency = r.get("latency_vs_float")
            rows.append(
                [
                    f"**{r['tool']}**" if r["tool"] == "fxopt" else r["tool"],
                    r["format"],
                    runs,
                    f"{r['sqnr_db']:.1f} dB{origin}",
                    f"{r['size_vs_float']:.3f}",
                    f"{latency:.2f}" if latency is not None else "—",
                ]
            )
        out += [
            f"### {result['model']}: {result['description']}",
            "",
            f"Float file {result['float_bytes'] / 2**20:.1f} MiB, {result['float_latency_ms']:.2f}"
            " ms in onert.",
            "",
            table(["tool", "format", "onert", "SQNR", "size", "latency"], rows, "llllrr"),
            "",
        ]
    out.append("Raw data: [results/weight_only.json](results/weight_only.json).")
    return "\n".join(out)


def render_remat_lm(data: dict) -> str:
    """A language model's training memory: fxopt's budgets against checkpointing and
    Inductor's min-cut, with the head chunked or not."""
    out = [
        "## Remat: a language model's training memory (the LM head's floor)",
        "",
        f"{data['description']}; LM loss (`labels=input_ids`), logits"
        f" {data['logit_bytes'] / 2**20:.0f} MiB. **peak**: peak activation memory of a step"
        " (profiler allocation events, parameters and their gradients excluded), in MiB and"
        " as a ratio to eager's; **time**: median CPU time per step over eager's, same run;"
        " **grad error**: largest gradient difference from eager. `checkpointing` is"
        " transformers' own (non-reentrant); `inductor min-cut B` is `torch.compile` with"
        " `activation_memory_budget=B`; `fxopt B` is `compile_step(memory_budget=B,"
        ' lm_head_chunks="auto")`, which traces the head and its cross-entropy in chunks of'
        " rows when the budget needs it (**chunks**); `head unchunked` is the default, no"
        " chunks.",
        "",
        run_line(data),
        "",
    ]
    rows = []
    for r in data["rows"]:
        if r["status"] != "ok":
            rows.append([r["variant"], r["status"], "—", "—", "—", "—", _md(r["error"], 60)])
            continue
        rows.append(
            [
                f"**{r['variant']}**" if r["kind"] == "fxopt" else r["variant"],
                "ok",
                f"{r['peak_bytes'] / 2**20:.1f}",
                f"{r['peak_ratio']:.2f}",
                f"{r['time_ratio']:.2f}",
                str(r.get("lm_head_chunks", "—")),
                f"{r['max_grad_error']:.1e}",
            ]
        )
    headers = ["variant", "status", "peak MiB", "peak", "time", "chunks", "grad error"]
    out += [table(headers, rows, "llrrrrr"), ""]
    out += [_remat_lm_verdict(data["rows"]), ""]
    out.append(
        "![memory against time](results/remat_lm.png)\n\nRaw data:"
        " [results/remat_lm.json](results/remat_lm.json)."
    )
    return "\n".join(out)


def _remat_lm_verdict(rows: list[dict]) -> str:
    """The lowest peak each kind reached, and at what time."""
    ok = [r for r in rows if r["status"] == "ok"]
    parts = []
    for kind, label in (
        ("checkpoint", "checkpointing"),
        ("min-cut", "Inductor's min-cut"),
        ("fxopt", "fxopt"),
    ):
        mine = [r for r in ok if r["kind"] == kind]
        if mine:
            low = min(mine, key=lambda r: (r["peak_bytes"], r["time_ratio"]))
            parts.append(
                f"{label} {low['peak_ratio']:.2f}× eager's peak at {low['time_ratio']:.2f}×"
                f" its time (`{low['variant']}`)"
            )
    unchunked = [r for r in ok if r.get("lm_head_chunks") == 1 and r["kind"] == "fxopt"]
    line = "Lowest peak reached: " + "; ".join(parts) + "."
    for r in unchunked:
        same = next(
            (c for c in ok if c["kind"] == "fxopt" and c["budget"] == r["budget"] and c is not r),
            None,
        )
        if same is not None:
            line += (
                f" At budget {r['budget']} with the head unchunked: {r['peak_ratio']:.2f}× the"
                f" peak at {r['time_ratio']:.2f}× the time ({same['peak_ratio']:.2f}× at"
                f" {same['time_ratio']:.2f}× in {same.get('lm_head_chunks')} chunks)."
            )
    return line


def render_remat_step(data: dict) -> str:
    """The whole step with the optimizer: memory by kind, and setup time vs aot_eager."""
    cfg = data.get("config", {})
    out = [
        "## Remat: the whole training step (AdamW) and setup time",
        "",
        "**total**: parameters + optimizer state + the peak of everything one step allocates"
        " on top (activations, gradients, optimizer temporaries; `measure_total`), ratio to"
        " eager (`zero_grad`, forward, backward, `optimizer.step()`); **step peak**: that"
        " last part alone; **time**: median CPU time per step, ratio to eager; **equal**:"
        " parameters after one step bit-equal to eager's. `in-backward` applies each update"
        " inside the backward and frees its gradient (`update_in_backward=True`).",
        "",
        run_line(data, " (quick sizes)." if cfg.get("quick") else "."),
        "",
    ]
    for result in data.get("memory", []):
        rows = [
            [
                f"**{r['variant']}**" if r["variant"] != "eager" else r["variant"],
                f"{r['total_bytes'] / 2**20:.0f} MiB",
                f"{r['total_ratio']:.3f}",
                f"{r['step_peak_ratio']:.3f}",
                f"{r['time_ratio']:.2f}",
                "yes" if r["params_equal_eager_after_one_step"] else "**no**",
            ]
            for r in result["rows"]
        ]
        out += [f"### {result['model']}: {result['description']}", ""]
        headers = ["variant", "total", "total ratio", "step peak", "time", "equal"]
        out += [table(headers, rows, "lrrrrl"), ""]
    setup = data.get("setup")
    if setup:
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in setup["fxopt_phases_s"].items())
        out += [
            f"**Setup** ({setup['description']}, budget {setup.get('budget')}): `compile_step`"
            f" {setup['fxopt_compile_step_s']:.1f} s ({phases}) against"
            f' `torch.compile(backend="aot_eager")`\'s first step'
            f" {setup['aot_eager_first_step_s']:.1f} s: {setup['ratio']:.2f}×.",
            "",
        ]
    for section, origin in data.get("sections_from", {}).items():
        out += [
            f"The {section} figures are from an earlier run: `{origin['command']}`, "
            f"{origin['date']}.",
            "",
        ]
    out.append("Raw data: [results/remat_step.json](results/remat_step.json).")
    return "\n".join(out)


def _max_or_dash(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{max(values):.2f}" if values else "—"


def render_remat_ddp(data: dict) -> str:
    """Remat under DDP and FSDP2: per-rank peak and time ratios to the same job without
    remat, worst rank shown."""
    cfg = data.get("config", {})
    out = [
        "## Remat under DistributedDataParallel and FSDP2 (gloo, one thread per process)",
        "",
        "Real multi-process jobs on this 2-core machine. Per rank, on each job's third step "
        "(DDP rebuilds its gradient buckets in the second, a parameter-sized allocation that "
        "held every DDP ratio near 0.9 when the second step was measured): **peak** memory of"
        " the step (parameters and gradients excluded; DDP's and FSDP's own buffers included,"
        " FSDP2's gathered parameters among them), **act. peak**: the same without the blocks"
        " FSDP2 allocates or frees in its own `FSDP::` profiler scopes (gathered parameters,"
        " reduce-scatter buffers, the unsharded gradients it consumes; equal to peak under "
        "DDP; — in runs before it was recorded), **saved**: bytes live at the "
        "forward/backward boundary (the activations the forward left for the backward; "
        "without FSDP2's blocks too, among them the root module's parameters, which FSDP2 "
        "keeps gathered from the forward to the backward), and median CPU **time** per step,"
        " as ratios to the "
        "same job without remat (plain DDP, or plain FSDP2) on the same rank; the worst rank "
        "is shown, and the largest gradient difference from that job over all ranks. Budget"
        f" {cfg.get('budget')}: a fraction of the process's activation peak. Under DDP fxopt"
        " plans each DDPOptimizer piece (gradient bucket), under FSDP2 "
        "`compile_blocks(blocks, root=model)` each sharded block and the root's code around "
        "them (a stem, embeddings, a head); the pieces (blocks) share that one budget and "
        "each is planned for what it saves. torch's min-cut gets the same "
        "`activation_memory_budget`, compiled the same way (per block and the root under "
        "FSDP2). **alone** is the same model in each process "
        "without a wrapper (no gradient exchange), and **alone fxopt** that model through "
        "`torch.compile(model, backend=fxopt.remat.backend(B))`, one plan for the whole "
        "graph: the single-process reference, as ratios to alone. Aim (issue 18): the "
        "single-process aims per rank (0.50× activation peak at ≤ 1.10× time).",
        "",
        run_line(data),
        "",
    ]
    for result in data["runs"]:
        names = list(result["ranks"][0])
        rows = []
        for name in names:
            per_rank = [r[name] for r in result["ranks"]]
            failed = [r for r in per_rank if r.get("status", "ok") != "ok"]
            if failed:
                rows.append([name, "fails: " + _md(failed[0]["error"], 90), *["—"] * 6])
                continue
            rows.append(
                [
                    f"**{name}**" if "fxopt" in name else name,
                    f"{max(r['peak_ratio'] for r in per_rank):.2f}",
                    _max_or_dash(per_rank, "activation_peak_ratio"),
                    _max_or_dash(
                        per_rank,
                        "activation_saved_ratio"
                        if "activation_saved_ratio" in per_rank[0]
                        else "saved_ratio",
                    ),
                    f"{max(r['time_ratio'] for r in per_rank):.2f}",
                    _max_or_dash(per_rank, "time_vs_compiled"),
                    f"{max(r['first_step_s'] for r in per_rank):.1f} s",
                    f"{max(r['max_grad_error'] for r in per_rank):.1e}",
                ]
            )
        wrapper = {"fsdp2": "FSDP2"}.get(result.get("wrapper", "ddp"), "DDP")
        out += [f"### {wrapper}, {result['world']} processes, {result['description']}", ""]
        headers = ["variant", "peak", "act. peak", "saved", "time", "vs compiled"]
        headers += ["first step", "grad error"]
        out += [table(headers, rows, "lrrrrrrr"), ""]
        out += _per_rank_against_alone(result)
    out.append("Raw data: [results/remat_ddp.json](results/remat_ddp.json).")
    return "\n".join(out)


def _per_rank_against_alone(result: dict) -> list[str]:
    """One line: fxopt per rank at the first budget beside the same plan in one process."""
    names = list(result["ranks"][0])
    alone = next((n for n in names if n.startswith("alone fxopt")), None)
    ours = next((n for n in names if " fxopt " in n and not n.startswith("alone")), None)
    if alone is None or ours is None:
        return []

    def worst(name: str) -> tuple[float, float] | None:
        rows = [r[name] for r in result["ranks"]]
        if any(r.get("status", "ok") != "ok" for r in rows):
            return None
        return (
            max(r["activation_peak_ratio"] for r in rows),
            max(r["time_ratio"] for r in rows),
        )

    per_rank, single = worst(ours), worst(alone)
    if per_rank is None or single is None:
        return []
    return [
        f"Per rank, `{ours}`: activation peak {per_rank[0]:.2f} at {per_rank[1]:.2f}× time; "
        f"the same budget in one process (`{alone}`): {single[0]:.2f} at {single[1]:.2f}×.",
        "",
    ]


def render_cli_startup(data: dict) -> str:
    """Command-line start-up: median wall time of fresh processes, beside import torch."""
    rows = [[f"`{r['command']}`", f"{r['median_s']:.3f} s"] for r in data["rows"]]
    return "\n".join(
        [
            "## Command-line start-up",
            "",
            "Wall time of a fresh process per run (median of"
            f" {data.get('config', {}).get('repeat')} interleaved runs). `fxopt --help`, the"
            " version and argument errors answer without importing torch; aim (issue 19):"
            " `fxopt --help` under 0.5 s.",
            "",
            machine_line(data) + f" `{data.get('command', '')}`.",
            "",
            table(["command", "median"], rows, "lr"),
            "",
            "Raw data: [results/cli_startup.json](results/cli_startup.json).",
        ]
    )


def render_e2e_large(data: dict) -> str:
    """The command line end to end on a 100k-node model: wall time, memory, phases, each
    labelled run (an earlier checkout's beside the current one) in its own column."""
    runs = data["runs"]
    labels = list(runs)
    phases = list(dict.fromkeys(p for run in runs.values() for p in run["phases_s"]))

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.0f} s"

    def phase_cell(run: dict, name: str) -> str:
        peak = (run.get("phases_peak_mib") or {}).get(name)
        shown = seconds(run["phases_s"].get(name))
        return shown if peak is None else f"{shown}, +{peak} MiB"

    rows = [[name, *(phase_cell(runs[k], name) for k in labels)] for name in phases]
    rows.append(["**wall (whole command)**", *(f"**{runs[k]['wall_s']:.0f} s**" for k in labels)])
    rows.append(["max RSS", *(f"{runs[k]['max_rss_mib']} MiB" for k in labels)])
    rows.append(["nodes before → after", *(_nodes(runs[k]) for k in labels)])
    rows.append(["verified", *(str(runs[k]["verified"]) for k in labels)])
    first, last = runs[labels[0]], runs[labels[-1]]
    speedup = first["wall_s"] / last["wall_s"]
    described = [
        f"- **{label}**: {run.get('note') or 'this checkout'}; run {run['machine']['date']}, "
        f"fxopt {run['machine']['fxopt']}, torch {run['machine']['torch']}; "
        f"{run.get('conditions', '')}."
        for label, run in runs.items()
    ]
    verdict = "reached" if speedup >= 3 else "not reached"
    # Issue 35: within 60 s and 1.5 GiB; the costs that remain, named per phase.
    fits = last["wall_s"] <= 60 and last["max_rss_mib"] <= 1.5 * 1024
    issue35 = (
        f"Aim (issue 35): within 60 s and 1.5 GiB; {'reached' if fits else 'not reached'} "
        f"({last['wall_s']:.0f} s, {last['max_rss_mib'] / 1024:.1f} GiB)."
    )
    return "\n".join(
        [
            "## End to end on a 100k-node model (`fxopt optimize`)",
            "",
            f"`{last['command']}` in a fresh process (benchmarks/e2e_large.py): wall time, "
            "peak resident memory and the report's `phases_s` (with each phase's peak "
            "resident memory beyond the job's start, where the run recorded it). The model "
            "is a plain "
            "`nn.Module` looping over 25k conv-bn-relu blocks of 2 channels, so the run "
            "times fxopt, not arithmetic. "
            f"**{labels[-1]}** against **{labels[0]}**: {speedup:.2f}× faster end to end. "
            f"Aim (issue 19): 3× faster; {verdict}. {issue35}",
            "",
            *described,
            "",
            table(["phase", *labels], rows, "l" + "r" * len(labels)),
            "",
            "Raw data: [results/e2e_large.json](results/e2e_large.json).",
        ]
    )


def _nodes(run: dict) -> str:
    return f"{run['nodes_before']} → {run['nodes_after']}"


def render_memory(data: dict) -> str:
    """Peak memory beyond the model per job and model size (benchmarks/memory.py)."""
    rows = data["rows"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    weights = {r["size"]: r["weight_gib"] for r in rows if "weight_gib" in r}

    def cell(job: str, size: str) -> str:
        found = [r for r in rows if r["job"] == job and r["size"] == size]
        if not found:
            return "—"
        r = found[0]
        if r.get("error"):
            return f"failed: {_md(r['error'], 60)}"
        if "max_rss_gib" in r:  # the command line: its whole process
            return f"{r['wall_s']:.0f} s, {r['max_rss_gib']:.2f} GiB max RSS in all, {_checked(r)}"
        if "steps_beyond_x" in r:
            first, steady = r["steps_beyond_x"]
            budget = r.get("budget", 0.5)
            at = "" if budget == 0.5 else f" (budget {budget:g}: 0.5 is below any plan)"
            return f"+{first:.2f}× first, +{steady:.2f}× steady{at}"
        extra = ""
        if r["job"] == "convert":
            extra = ", validated" if r.get("validated") else ", NOT validated"
        beyond = f"+{r['peak_beyond_x']:.2f}× ({r['peak_beyond_gib']:.2f} GiB"
        return f"{beyond}, {r['wall_s']:.0f} s{extra})"

    jobs = list(dict.fromkeys(r["job"] for r in rows))
    header = ["job", *(f"{size} ({weights.get(size, '?')} GiB)" for size in sizes)]
    table_rows = [[f"`{job}`", *(cell(job, size) for size in sizes)] for job in jobs]
    config = data.get("config", {})
    verdict = _memory_verdict(rows)
    return "\n".join(
        [
            "## Memory beyond the model (optimize, convert, remat)",
            "",
            "Peak resident memory of each job in a fresh process, beyond the process once "
            "the model and its inputs were built, as a multiple of the model's fp32 weight "
            "bytes (benchmarks/memory.py; VmHWM reset after the build). Llama-shaped "
            "`LlamaForCausalLM` models with random weights; inference on ids of "
            f"{'×'.join(map(str, config.get('inference_ids', [1, 32])))}, training on "
            f"{'×'.join(map(str, config.get('training_ids', [2, 256])))} tokens with a "
            "padding mask and the LM loss (gradients included in every step; each step "
            "measured after glibc's `malloc_trim`, so from what is live).",
            "",
            machine_line(data)
            + " "
            + "; ".join(f"`{c}`" for c in data.get("commands", [data.get("command", "")]))
            + ".",
            "",
            *_merged_runs(data),
            table(header, table_rows, "l" + "r" * len(sizes)),
            "",
            *verdict,
            "",
            "![peak memory against model size](results/memory.png)",
            "",
            "Raw data, with fxopt's own per-phase peaks: "
            "[results/memory.json](results/memory.json).",
        ]
    )


def _checked(row: dict) -> str:
    """What a command-line row's JSON said: verified (optimize) or validated (convert)."""
    word = "verified" if "verified" in row else "validated"
    return word if row.get(word) else f"NOT {word}"


def _merged_runs(data: dict) -> list[str]:
    """Where the rows re-run into a results file later were measured (their machine)."""
    lines = []
    for run in data.get("merged_runs", []):
        m = run["machine"]
        lines.append(
            f"- `{run['command']}` was re-run into it on {m.get('date', '?')}, on {m.get('cpu')} "
            f"(load {_round(m.get('load_avg_1min'))} at the end)."
        )
    return [*lines, ""] if lines else []


def _memory_verdict(rows: list[dict]) -> list[str]:
    """The issue's aims on the 0.7 GiB model, checked against this run."""

    def find(job: str, size: str = "medium") -> dict | None:
        found = [r for r in rows if r["job"] == job and r["size"] == size and not r.get("error")]
        return found[0] if found else None

    lines = []
    optimize, convert = find("optimize"), find("convert")
    if optimize:
        ok = "met" if optimize["peak_beyond_x"] <= 0.5 else "not met"
        shown = f"+{optimize['peak_beyond_x']:.2f}×"
        lines.append(f"- optimize on the 0.7 GiB model: {shown} (aim ≤ 0.5×: {ok}).")
    if convert:
        ok = "met" if convert["peak_beyond_x"] <= 1.5 else "not met"
        shown = f"+{convert['peak_beyond_x']:.2f}×"
        lines.append(f"- convert on the 0.7 GiB model: {shown} (aim ≤ 1.5×: {ok}).")
    eager = find("train eager")
    for job in ("compile_step", "remat backend"):
        row = find(job)
        if row and eager:
            (first, steady), eager_first = row["steps_beyond_x"], eager["steps_beyond_x"][0]
            ok = "met" if first <= eager_first else "not met"
            lines.append(
                f"- {job} first step at budget 0.5: +{first:.2f}× against eager's first step "
                f"+{eager_first:.2f}× (aim: no higher: {ok}); steady +{steady:.2f}×."
            )
    xl = [r for r in rows if r["size"] == "xl" and not r.get("error")]
    weights = {r["size"]: r["weight_gib"] for r in rows if "weight_gib" in r}
    for r in xl:
        if "max_rss_gib" in r:  # the command line, as a user runs it
            lines.append(
                f"- `{r['command']}` on the {weights.get('xl', 0):.1f} GiB model: {_checked(r)}, "
                f"{r['wall_s']:.0f} s from the command to its answer, "
                f"{r['max_rss_gib']:.2f} GiB max RSS in all (the model it builds included)."
            )
            continue
        lines.append(
            f"- {r['job']} on the {r['weight_gib']:.1f} GiB model: completed in "
            f"{r['wall_s']:.0f} s, +{r['peak_beyond_x']:.2f}×."
        )
    return lines


RENDERERS: dict[str, Callable[[dict], str]] = {
    "memory.json": render_memory,
    "e2e_large.json": render_e2e_large,
    "cli_startup.json": render_cli_startup,
    "guard.json": render_guard,
    "transform_speed.json": render_transform_speed,
    "preset_speed.json": render_preset_speed,
    "inference.json": render_inference,
    "inference_2t.json": render_inference_threads,
    "inference_hf.json": render_inference_hf,
    "transformers_speed.json": render_transformers_speed,
    "decoder_speed.json": render_decoder_speed,
    "kernel_gap.json": render_kernel_gap,
    "tiling.json": render_tiling,
    "remat.json": render_remat,
    "remat_compile.json": render_remat_compile,
    "remat_step.json": render_remat_step,
    "remat_lm.json": render_remat_lm,
    "weight_only.json": render_weight_only,
    "remat_ddp.json": render_remat_ddp,
    "circle.json": render_circle,
    "circle_decoders.json": render_circle_decoders,
    "tico_modules.json": render_tico_modules,
    "circle_ab.json": render_circle_ab,
    "preset_ab.json": render_preset_ab,
    "quantize.json": render_quantize,
}


# --------------------------------------------------------------------------- main

HEADER = """\
<!-- Generated by benchmarks/make_results.py from results/*.json: do not edit by hand. -->
# Benchmark results

Generated from the JSON files in [results/](results/). Regenerate with `make bench`
(re-runs every benchmark, then this page), or re-render only with
`python benchmarks/make_results.py`. What each benchmark measures and how long it takes:
[benchmarks/README.md](benchmarks/README.md).
"""


def render_all(results: Path = RESULTS) -> str:
    parts = [HEADER]
    files = sorted(results.glob("*.json"))
    for name, render in RENDERERS.items():
        path = results / name
        if path.exists():
            parts.append(render(json.loads(path.read_text())))
    others = [f for f in files if f.name not in RENDERERS]
    if others:
        parts.append(
            "## Other results (no renderer yet)\n\n"
            + "\n".join(f"- [{relative(f)}]({relative(f)})" for f in others)
        )
    return "\n\n".join(p.rstrip() for p in parts) + "\n"


# --------------------------------------------------------------------------- WRITEUP.md

#: WRITEUP.md's generated part sits between these two lines; the prose around it is kept.
HEADLINES_BEGIN = "<!-- headlines: generated by benchmarks/make_results.py -->"
HEADLINES_END = "<!-- end of headlines -->"


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    return json.loads(path.read_text()) if path.exists() else None


def _inference_headlines(data: dict) -> list[list[str]]:
    speed = {(r["model"], r["batch"], r["variant"]): r.get("speedup") for r in data["rows"]}
    out = []
    for model, batch in sorted({(r["model"], r["batch"]) for r in data["rows"]}):

        def x(variant, model=model, batch=batch):
            value = speed.get((model, batch, variant))
            return f"{value:.2f}×" if value else "—"

        out.append(
            [
                "optimize",
                f"{model} batch {batch}: speedup over eager, 1 thread",
                x("fxopt fx +autotune"),
                f"compile+freezing {x('torch.compile freezing')}, ORT {x('onnxruntime')}",
                "Inference latency",
            ]
        )
    return out


def _remat_headlines(data: dict) -> list[list[str]]:
    out = []
    for model in data["models"]:
        rows = {r["variant"]: r for r in model["rows"] if r.get("status", "ok") == "ok"}
        ours, theirs = rows.get("fxopt greedy 0.5"), rows.get("min-cut 0.5")
        checkpoint = rows.get("checkpoint every block")
        if not ours:
            continue

        def pair(row):
            return f"{row['peak_ratio']:.2f} at {row['time_ratio']:.2f}×" if row else "—"

        out.append(
            [
                "remat",
                f"{model['model']}: peak activation memory at time, budget 0.5",
                pair(ours),
                f"min-cut {pair(theirs)}; checkpoint every block {pair(checkpoint)}",
                "Remat: training memory vs time",
            ]
        )
    return out


def _ddp_headlines(data: dict) -> list[list[str]]:
    """Per rank, worst rank: fxopt at the first budget against min-cut and checkpointing,
    for each 2-process job."""
    out = []
    budget = data.get("config", {}).get("budget", 0.5)
    for result in data["runs"]:
        if result["world"] != 2:
            continue
        wrapper = result.get("wrapper", "ddp")

        def pair(name: str, ranks=result["ranks"]) -> str:
            rows = [r.get(name) for r in ranks]
            if any(r is None or r.get("status", "ok") != "ok" for r in rows):
                return "—"
            peak = max(r.get("activation_peak_ratio", r["peak_ratio"]) for r in rows)
            return f"{peak:.2f} at {max(r['time_ratio'] for r in rows):.2f}×"

        ours = pair(f"{wrapper} fxopt {budget}")
        if ours == "—":
            continue
        label = {"fsdp2": "FSDP2"}.get(wrapper, "DDP")
        model = result["description"].split(":")[0].split(",")[0]
        out.append(
            [
                "remat",
                f"{label} 2 ranks, {model} ({result['model']}): per-rank activation peak at "
                f"time, budget {budget}",
                ours,
                f"min-cut {pair(f'{wrapper} min-cut {budget}')}; checkpoint every block "
                f"{pair(f'{wrapper} checkpoint')}",
                "Remat under DistributedDataParallel and FSDP2",
            ]
        )
    return out


def _setup_headline(data: dict) -> list[list[str]]:
    setup = data.get("setup")
    if not setup:
        return []
    return [
        [
            "remat",
            "ResNet-152 b8: compile_step setup (capture, profile, plan, rewrite)",
            f"{setup['fxopt_compile_step_s']:.1f} s",
            f"aot_eager first step {setup['aot_eager_first_step_s']:.1f} s",
            "Remat: the whole training step",
        ]
    ]


def _circle_headline(data: dict) -> list[list[str]]:
    counts: dict[str, list[int]] = {}
    for row in data["rows"]:
        done = counts.setdefault(row["tool"], [0, 0])
        done[0] += 1
        done[1] += bool(row.get("validated", row.get("runs")))
    if "fxopt" not in counts:
        return []
    peers = "; ".join(f"{tool} {v}/{n}" for tool, (n, v) in counts.items() if tool != "fxopt")
    n, v = counts["fxopt"]
    return [
        [
            "convert",
            "models converted and run in a runtime (of those benchmarked)",
            f"{v}/{n}",
            peers or "—",
            "Circle conversion: fxopt vs TICO",
        ]
    ]


def _memory_headlines(data: dict) -> list[list[str]]:
    rows = {(r["job"], r["size"]): r for r in data["rows"] if not r.get("error")}
    section = "Memory beyond the model (optimize, convert, remat)"
    out = []
    for job, peers in (("optimize", ("torch.compile", "torch.export")), ("convert", ("tico",))):
        mine = rows.get((job, "medium"))
        if mine is None:
            continue
        shown = [
            f"{peer} +{rows[(peer, 'medium')]['peak_beyond_x']:.2f}×"
            for peer in peers
            if (peer, "medium") in rows
        ]
        out.append(
            [
                job,
                f"peak memory beyond a {mine['weight_gib']:.1f} GiB Llama (× its weights)",
                f"+{mine['peak_beyond_x']:.2f}×",
                "; ".join(shown) or "—",
                section,
            ]
        )
    return out


def _cli_headline(data: dict) -> list[list[str]]:
    rows = {r["command"]: r["median_s"] for r in data["rows"]}
    if "fxopt --help" not in rows:
        return []
    return [
        [
            "CLI",
            "`fxopt --help`, fresh process",
            f"{rows['fxopt --help']:.2f} s",
            f"`import torch` alone {rows.get('import torch', 0):.2f} s",
            "Command-line start-up",
        ]
    ]


def render_headlines(results: Path = RESULTS) -> str:
    """The headline figures of WRITEUP.md, each read from the JSON RESULTS.md is made of
    and naming the RESULTS.md section it appears in."""
    sources = [
        ("inference.json", _inference_headlines),
        ("remat.json", _remat_headlines),
        ("remat_step.json", _setup_headline),
        ("remat_ddp.json", _ddp_headlines),
        ("circle.json", _circle_headline),
        ("memory.json", _memory_headlines),
        ("cli_startup.json", _cli_headline),
    ]
    rows: list[list[str]] = []
    for name, extract in sources:
        data = _load(results, name)
        if data is not None:
            rows += extract(data)
    headers = ["job", "measure", "fxopt", "peers, same run", "RESULTS.md section"]
    return table(headers, rows, "llrll")


def write_writeup(path: Path, results: Path = RESULTS) -> bool:
    """Refresh the generated part of WRITEUP.md in place; False when it has no markers."""
    if not path.exists():
        return False
    text = path.read_text()
    if HEADLINES_BEGIN not in text or HEADLINES_END not in text:
        return False
    head, rest = text.split(HEADLINES_BEGIN, 1)
    _, tail = rest.split(HEADLINES_END, 1)
    body = f"{HEADLINES_BEGIN}\n{render_headlines(results)}\n{HEADLINES_END}"
    path.write_text(head + body + tail)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of JSON files")
    parser.add_argument("--out", type=Path, default=ROOT / "RESULTS.md")
    args = parser.parse_args(argv)
    args.out.write_text(render_all(args.results))
    print(f"wrote {args.out}")
    writeup = args.out.parent / "WRITEUP.md"
    if args.out == ROOT / "RESULTS.md" and write_writeup(writeup, args.results):
        print(f"refreshed the headline figures in {writeup}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
