"""fxopt.circle at two revisions of fxopt, same run: operator lists and convert time.

For a change to the converter's internals that must not change its output ("operator
counts unchanged, convert time no worse"): each revision converts the built-in models in
its own process (a git worktree of ``--base``, and this checkout), the two alternating
round by round so a slow phase of the machine hits both. Per model: whether the operator
lists are identical, and the median CPU seconds of ``circle.convert`` (after one warm-up
conversion) at each revision, with their ratio. Writes results/circle_ab.json.

    python benchmarks/circle_ab.py --base HEAD~3 [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, ROOT, command_line, machine_info, write_json

MODELS = (
    "mlp",
    "cnn_bn",
    "resnet18?image=64",
    "resnet50?image=64",
    "mobilenet_v2?image=64",
    "bert?config=tiny&seq=16",
    "gpt?config=tiny&seq=16",
)

# Runs in a fresh interpreter with one revision's src on sys.path: one JSON line out.
_CHILD = """
import inspect, json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
import fxopt
from fxopt import circle, models
assert fxopt.__file__.startswith(sys.argv[2]), (fxopt.__file__, sys.argv[2])
out = {}
for spec in json.loads(sys.argv[1]):
    made = models.load("zoo:" + spec, [])
    model, inputs = made.model.eval(), made.example_inputs
    # Conversion alone: revisions before validation-by-default have no validate argument.
    validates = "validate" in inspect.signature(circle.convert).parameters
    options = {"validate": False} if validates else {}
    circle.convert(model, inputs, **options)  # warm-up: export's caches, lazy imports
    times = []
    for _ in range(2):
        start = time.process_time()
        converted = circle.convert(model, inputs, **options)
        times.append(time.process_time() - start)
    out[spec] = {"operators": converted.operators, "seconds": min(times)}
print(json.dumps(out))
"""


def run_revision(src: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(MODELS), str(src)],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"conversion failed under {src}:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        worktree = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(worktree), args.base],
            check=True,
        )
        try:
            samples: dict[str, list[dict]] = {"base": [], "head": []}
            for round_index in range(args.rounds):
                for side, src in (("base", worktree / "src"), ("head", ROOT / "src")):
                    samples[side].append(run_revision(src))
                print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)])
    rows = []
    for spec in MODELS:
        base = [s[spec] for s in samples["base"]]
        head = [s[spec] for s in samples["head"]]
        base_s = statistics.median(x["seconds"] for x in base)
        head_s = statistics.median(x["seconds"] for x in head)
        rows.append(
            {
                "model": spec,
                "operators_base": len(base[0]["operators"]),
                "operators_head": len(head[0]["operators"]),
                "same_operators": all(x["operators"] == base[0]["operators"] for x in base + head),
                "convert_s_base": base_s,
                "convert_s_head": head_s,
                "head_over_base": head_s / base_s,
            }
        )
        print(
            f"{spec:28s} ops {rows[-1]['operators_base']:4d} → {rows[-1]['operators_head']:4d}"
            f"  same={rows[-1]['same_operators']}  {base_s:.3f}s → {head_s:.3f}s"
            f"  ({head_s / base_s:.2f}x)"
        )
    write_json(
        RESULTS / "circle_ab.json",
        {
            "benchmark": "circle_ab",
            "machine": machine_info(),
            "command": command_line(),
            "base": args.base,
            "rounds": args.rounds,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
