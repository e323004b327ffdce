"""How long does ``fxopt optimize`` take end to end on a 100k-node model, and where does
the time go?

Runs the command line as a user does, in a fresh process, and records its wall time, its
peak resident memory (the child's ``ru_maxrss``) and the report's ``phases_s`` (capture,
passes, verify, layout, benchmark). Each run is kept under a label in
``results/e2e_large.json``, so a run of an earlier checkout (``--pythonpath`` pointing at
its ``src``) sits beside the current one, on the same model and machine:

    python benchmarks/e2e_large.py                                    # label "now"
    git worktree add ../fxopt-old <commit>
    python benchmarks/e2e_large.py --label before --pythonpath ../fxopt-old/src \\
        --note "fxopt at <commit>"
    python benchmarks/e2e_large.py --model benchmarks/large_graph.py:conv_bn_10k

Nothing else should run on the machine meanwhile (the 100k-node run takes minutes); say
so with ``--conditions`` when something did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import RESULTS, ROOT, machine_info, write_json

DEFAULT_MODEL = "benchmarks/large_graph.py:conv_bn_100k"


def run(model: str, pythonpath: str | None) -> dict:
    """One ``fxopt optimize <model> --json`` in a fresh process: its report and costs."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "fxopt.cli", "optimize", model, "--json"]
    start = time.perf_counter()
    child = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout, stderr = _communicate(child)
    wall = time.perf_counter() - start
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"e2e_large: the command failed:\n{stderr[-2000:]}")
    report = json.loads(stdout)
    return {
        "wall_s": round(wall, 2),
        "max_rss_mib": round(usage.ru_maxrss / 1024),
        "nodes_before": report["nodes_before"],
        "nodes_after": report["nodes_after"],
        "verified": report["verified"],
        "mode": report["mode"],
        "layout": report["layout"]["chosen"] if report.get("layout") else None,
        "phases_s": report["phases_s"],
        # Peak resident memory of each phase, from the report (fxopt.memory): beyond the
        # resident set when the job started (the model built, torch imported).
        "phases_peak_mib": _phase_peaks(report.get("memory")),
        "progress": [line for line in stderr.splitlines() if line.startswith("fxopt:")],
    }


def _phase_peaks(memory: dict | None) -> dict[str, int]:
    if not memory or memory.get("baseline_bytes") is None:
        return {}
    base = memory["baseline_bytes"]
    return {
        name: round(max(0, peak - base) / 2**20)
        for name, peak in memory.get("phases_peak_bytes", {}).items()
    }


def _communicate(child: subprocess.Popen) -> tuple[str, str]:
    """The child's output, echoing its progress lines as they come; the child is left
    unreaped so that ``os.wait4`` can read its resource usage."""
    stderr_lines = []
    assert child.stderr is not None and child.stdout is not None
    for line in child.stderr:
        stderr_lines.append(line)
        print(line, end="", file=sys.stderr, flush=True)
    stdout = child.stdout.read()
    return stdout, "".join(stderr_lines)


def _commit(path: str) -> str:
    """The checkout's commit, ``+changes`` when its tree differs from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True)
        return done.stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "+changes" if git("status", "--porcelain") else ""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--label", default="now", help="the run's name in the JSON")
    parser.add_argument("--pythonpath", help="a checkout's src, to time an earlier fxopt")
    parser.add_argument("--note", default="", help="what this run is (kept in the JSON)")
    parser.add_argument(
        "--conditions", default="nothing else ran on the machine", help="(kept in the JSON)"
    )
    args = parser.parse_args()
    path = RESULTS / "e2e_large.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get("model") != args.model or "runs" not in data:
        data = {"model": args.model, "runs": {}}  # another model: earlier runs do not compare
    result = run(args.model, args.pythonpath)
    result.update(
        commit=_commit(args.pythonpath or str(ROOT)),
        machine=machine_info(),
        command=f"fxopt optimize {args.model} --json",
        note=args.note,
        conditions=args.conditions,
    )
    data["runs"][args.label] = result
    write_json(path, data)
    phases = ", ".join(f"{k} {v:.0f} s" for k, v in result["phases_s"].items())
    print(f"{args.label}: {result['wall_s']:.0f} s, {result['max_rss_mib']} MiB; {phases}")


if __name__ == "__main__":
    main()
