"""Never slower than the model: the ``speed`` preset on third-party models, by its own report.

Hugging Face architectures (random weights from small configs: benchmarks/circle_models.py)
captured with torch.export, where a graph of many small ATen ops run by fx's generated
Python can be slower than the module it came from. Per model, one torch thread:

    passes only      fxopt.optimize(model, inputs, mode="export", autotune=False): the
                     preset's passes; the report's own speedup (original vs optimized,
                     timed interleaved)
    speed preset     the same with the layout step (the default): candidates include the
                     fused CPU kernels and the unmodified model behind the input guard

Outputs: results/transformers_speed.json (every report) and .png; RESULTS.md's section is
generated from the JSON.

    python benchmarks/transformers_speed.py            # ~5 min on this 2-core machine
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import fxopt
from circle_models import third_party_models
from common import RESULTS, command_line, machine_info, steady_allocator, write_json

console = Console()
MODELS = (
    "hf_vit",
    "hf_mobilevit",
    "hf_bert_small",
    "hf_roberta",
    "hf_distilbert",
    "hf_albert",
    "hf_electra",
    "hf_clip_text",
    "hf_wav2vec2",
    "hf_convnext",
    "hf_resnet",
)


def measure(name: str, build, runs: int) -> dict:
    model, inputs = build()
    row: dict = {"model": name}
    for label, autotune in (("passes only", False), ("speed preset", True)):
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = fxopt.optimize(
                    model, inputs, mode="export", autotune=autotune, benchmark_runs=runs
                )
        except Exception as error:  # recorded, not fatal: the next model still runs
            row[label] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
            continue
        report = result.report
        layout = report.get("layout") or {}
        row[label] = {
            "speedup": report["speedup"],
            "latency_ms": report["latency_ms"],
            "verified": report["verified"],
            "setup_s": round(time.perf_counter() - started, 2),
            "layout": layout.get("chosen"),
            "kernels": layout.get("kernels"),
            "layout_ms": layout.get("median_ms"),
            "rejected": layout.get("rejected"),
        }
    return row


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in data["rows"] if "speedup" in r.get("speed preset", {})]
    names = [r["model"].removeprefix("hf_") for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.4
    for k, label in enumerate(("passes only", "speed preset")):
        values = [r[label].get("speedup") or 0 for r in rows]
        ax.bar([i + (k - 0.5) * width for i in range(len(rows))], values, width, label=label)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(rows)), names, rotation=30, fontsize=8)
    ax.set_ylabel("speedup over the model (its own report)")
    ax.set_title("speed preset on Hugging Face models captured with torch.export (1 thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=30, help="timed calls per report")
    parser.add_argument("--out", type=Path, default=RESULTS / "transformers_speed.json")
    args = parser.parse_args(argv)
    allocator = steady_allocator()
    torch.set_num_threads(1)
    try:
        builders = third_party_models()
    except ImportError as error:
        console.print(f"skipped: transformers is not installed ({error}); pip install -e '.[hf]'")
        return 0
    started = time.perf_counter()
    rows = []
    with console.status("") as status:
        for name in args.models:
            status.update(f"{name}")
            rows.append(measure(name, builders[name], args.runs))
    data = {
        "benchmark": "transformers_speed",
        "machine": machine_info(),
        "command": command_line(),
        "config": {"runs": args.runs, "torch_threads": 1, "allocator": allocator},
        "rows": rows,
        "runtime_s": round(time.perf_counter() - started, 1),
    }
    write_json(args.out, data)
    plot(data, args.out.with_suffix(".png"))
    table = Table(title="speed preset vs the model, by its own report (1 thread)")
    for column in ("model", "passes only", "speed preset", "layout kept", "kernels"):
        table.add_column(column)
    for r in rows:
        cells = []
        for label in ("passes only", "speed preset"):
            entry = r.get(label, {})
            cells.append(entry.get("error", "")[:40] or f"{entry['speedup']:.2f}×")
        preset = r.get("speed preset", {})
        table.add_row(r["model"], *cells, str(preset.get("layout")), preset.get("kernels") or "—")
    console.print(table)
    console.print(f"wrote {args.out} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
