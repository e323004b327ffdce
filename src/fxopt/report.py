"""Render optimize reports: a rich table, JSON, Markdown and a PNG bar chart.

All renderers take the report dicts that :func:`fxopt.optimize` returns (and the CLI prints
with ``--json``), so every view shows the same numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

_COLUMNS = (
    "model",
    "nodes",
    "passes that changed it",
    "layout",
    "kernels",
    "verified",
    "max err",
    "ms before",
    "ms after",
    "speedup",
    "memory",
)


def _row(report: dict) -> list[str]:
    changed = sorted({p["name"] for p in report["passes"] if p["changed"]})
    layout = report.get("layout") or {}
    chosen = layout.get("chosen") or "—"
    latency = report.get("latency_ms") or {}
    err = report.get("max_abs_error")
    return [
        f"{report['model']} ({report.get('mode', '')})",
        f"{report['nodes_before']}→{report['nodes_after']}",
        ", ".join(changed) or "—",
        chosen,
        layout.get("kernels") or "—",
        "yes" if report["verified"] else "NO",
        "—" if err is None else ("0" if err == 0 else f"{err:.0e}"),
        _ms(latency.get("original")),
        _ms(latency.get("optimized")),
        speedup_cell(report),
        memory_cell(report.get("memory")),
    ]


def speedup_cell(report: dict) -> str:
    """The speedup, or that it is within the measured noise (not a result either way)."""
    speedup = report.get("speedup")
    if speedup is None:
        return "—"
    if report.get("speedup_within_noise"):
        return f"{speedup:.2f}× (within noise)"
    interval = report.get("speedup_ci95")
    return (
        f"{speedup:.2f}× ({interval[0]:.2f}–{interval[1]:.2f})" if interval else f"{speedup:.2f}×"
    )


def memory_cell(memory: dict | None) -> str:
    """The job's peak memory beyond the model: bytes, and × the model's weights."""
    if not memory or memory.get("peak_beyond_baseline_bytes") is None:
        return "—"
    from fxopt.memory import gib

    shown = f"+{gib(memory['peak_beyond_baseline_bytes'])}"
    ratio = memory.get("peak_beyond_baseline_x_weights")
    # Beside a small model, the peak is the code fxopt and torch load (about 100 MiB):
    # as a multiple of its weights it would say nothing about the job.
    if ratio is None or (memory.get("weight_bytes") or 0) < _SMALL_MODEL:
        return shown
    return f"{shown} ({ratio:.2f}× weights)"


_SMALL_MODEL = 64 * 2**20


def memory_line(memory: dict | None) -> str | None:
    """Peak memory per phase, beyond what the process held when the job started."""
    if not memory or memory.get("baseline_bytes") is None:
        return None
    from fxopt.memory import gib

    base = memory["baseline_bytes"]
    phases = ", ".join(
        f"{name} +{gib(max(0, peak - base))}"
        for name, peak in memory.get("phases_peak_bytes", {}).items()
    )
    return f"peak memory beyond the model, per phase: {phases}" if phases else None


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def table(reports: Sequence[dict], title: str = "fxopt optimize") -> Table:
    """A rich Table with one row per model."""
    out = Table(title=title, title_justify="left")
    for column in _COLUMNS:
        wraps = column in ("passes that changed it", "kernels")
        out.add_column(
            column, justify="left" if wraps or column == "model" else "right", no_wrap=not wraps
        )
    for report in reports:
        out.add_row(*_row(report))
    return out


def markdown(reports: Sequence[dict], title: str = "fxopt optimize report") -> str:
    """A Markdown table plus, per model, the passes and the ops that changed."""
    lines = [f"# {title}", "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(_row(r)) + " |" for r in reports]
    for report in reports:
        lines += ["", f"## {report['model']} ({report.get('mode', '')})", ""]
        lines += ["| pass | round | changed | ms | stats |", "|---|---|---|---|---|"]
        for p in report["passes"]:
            stats = ", ".join(f"{k}={v}" for k, v in p["stats"].items())
            lines.append(
                f"| {p['name']} | {p['round']} | {p['changed']} | {p['time_ms']:.2f} | {stats} |"
            )
        delta = _op_delta(report)
        if delta:
            lines += ["", "Ops removed: " + ", ".join(f"{op} −{n}" for op, n in delta)]
        verified = verified_lines(report)
        if verified:
            lines += ["", *(f"- {line.strip()}" for line in verified)]
    return "\n".join(lines) + "\n"


def _op_delta(report: dict) -> list[tuple[str, int]]:
    before, after = report.get("ops_before", {}), report.get("ops_after", {})
    return [(op, n - after.get(op, 0)) for op, n in before.items() if n > after.get(op, 0)]


def verified_lines(report: dict) -> list[str]:
    """What "verified" covered and what the module accepts: the lines under the table."""
    lines = []
    mode = report.get("mode", "")
    if report.get("requested_mode") == "auto":
        mode = f"{mode} (auto)"
    if report.get("verified"):
        lines.append(f"verified ({mode} capture) on " + "; ".join(report.get("checked", ())))
    contract = report.get("contract") or {}
    accepts = "; ".join(f"{name}: {spec}" for name, spec in contract.get("inputs", {}).items())
    if accepts:
        lines.append(f"accepts {accepts}")
    lines += [f"  and {relation}" for relation in contract.get("relations", ())]
    if contract.get("state"):
        lines.append(f"  in {contract['state']} (other states are refused)")
    lines += _exactness_lines(report.get("fast_math"))
    for skipped in report.get("skipped_passes", ()):
        lines.append(f"skipped pass {skipped['name']}: {skipped['reason']}")
    if report.get("layout_skipped"):
        lines.append(f"no layout step: {report['layout_skipped']}")
    layout = report.get("layout") or {}
    if layout.get("kernels"):
        lines.append(
            f"layout {layout['chosen']}: fused kernels chosen by the tiler: {layout['kernels']} "
            f"({layout.get('fused_ops', 0)} ops fused into them)"
        )
    if layout.get("note"):
        lines.append(f"layout: {layout['note']}")
    lines += [f"note: {note}" for note in report.get("notes", ())]
    memory = memory_line(report.get("memory"))
    if memory:
        lines.append(memory)
    return lines


def _exactness_lines(fast_math: dict | None) -> list[str]:
    """What exactness the result keeps: all of it, or the rewrites fast_math applied."""
    if not fast_math:
        return []
    applied = ", ".join(f"{rewrite} ({n})" for rewrite, n in fast_math["inexact"].items())
    if applied:
        return [f"fast_math: exact for finite inputs only, by {applied}"]
    if fast_math["enabled"]:
        return ["fast_math: no rewrite exact for finite inputs only was applied"]
    return ["exact: NaN, ±inf and -0.0 give eager's answer (fast_math off)"]


def explain(report: dict) -> list[str]:
    """One line per site a pass skipped, with the reason (``--explain``), then the fused
    kernels of the layout step: what was left out and why."""
    lines = []
    for p in report["passes"]:
        for skip in p.get("skipped", []):
            lines.append(f"{p['name']} (round {p['round']}): {skip['node']}: {skip['reason']}")
    layout = report.get("layout") or {}
    for skip in layout.get("kernel_skipped", ()):
        lines.append(f"layout {layout['chosen']}: {skip['node']}: {skip['reason']}")
    return lines


def print_skipped(console, report: dict) -> None:
    """``--explain``'s output on ``console`` (a rich Console): a count, then one line per
    skipped site."""
    lines = explain(report)
    console.print(f"\n{len(lines)} skipped site(s):" if lines else "\nno site was skipped")
    for line in lines:
        console.print(f"  {line}", highlight=False, soft_wrap=True, markup=False)


def write_json(reports: Sequence[dict], path: Path) -> None:
    path.write_text(json.dumps(list(reports), indent=2) + "\n")


def plot(reports: Sequence[dict], path: Path) -> Path:
    """Bar chart: graph nodes and latency, original vs optimized, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Options (zoo:resnet18?image=32) make labels collide; the table keeps them.
    names = [f"{r['model'].split('?')[0]}\n({r.get('mode', '')})" for r in reports]
    x = range(len(reports))
    width = 0.38
    fig, (ax_nodes, ax_time) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(reports)), 4))
    ax_nodes.bar(
        [i - width / 2 for i in x], [r["nodes_before"] for r in reports], width, label="original"
    )
    ax_nodes.bar(
        [i + width / 2 for i in x], [r["nodes_after"] for r in reports], width, label="optimized"
    )
    ax_nodes.set_title("graph nodes")
    timed = [r for r in reports if (r.get("latency_ms") or {}).get("original")]
    if timed:
        ratio = [r["latency_ms"]["optimized"] / r["latency_ms"]["original"] for r in timed]
        # The 95 % interval of each ratio as an error bar; a bar within the noise is grey.
        low = [
            1 / r["speedup_ci95"][1] if r.get("speedup_ci95") else q for r, q in zip(timed, ratio)
        ]
        high = [
            1 / r["speedup_ci95"][0] if r.get("speedup_ci95") else q for r, q in zip(timed, ratio)
        ]
        errors = [
            [max(0.0, q - lo) for q, lo in zip(ratio, low)],
            [max(0.0, hi - q) for q, hi in zip(ratio, high)],
        ]
        colors = ["lightgray" if r.get("speedup_within_noise") else "tab:green" for r in timed]
        labels = [names[reports.index(r)] for r in timed]
        ax_time.bar(labels, ratio, color=colors, yerr=errors, capsize=3)
        ax_time.axhline(1.0, color="gray", linewidth=1, linestyle="--")
        ax_time.set_title("latency, optimized / original (lower is faster; grey: within noise)")
    else:
        ax_time.set_axis_off()
    for ax in (ax_nodes, ax_time):
        ax.tick_params(axis="x", labelsize=8, labelrotation=30)
    ax_nodes.set_xticks(list(x), names)
    ax_nodes.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
