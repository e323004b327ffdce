"""How long the command line takes to answer before any job runs.

Times, in fresh interpreters (wall clock, ``--repeat`` runs each, median):

    import torch          python -c "import torch": the floor every job pays
    fxopt --help          the parser, without torch (fxopt._lazy)
    fxopt --version
    fxopt optimise        a typo'd command: the one-line error
    fxopt passes          the first command that needs torch

Aim (issue 19): ``fxopt --help`` under 0.5 s. Writes results/cli_startup.json.

    python benchmarks/cli_startup.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, command_line, machine_info, write_json

FXOPT = shutil.which("fxopt") or str(Path(sys.executable).parent / "fxopt")
COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "fxopt --help": [FXOPT, "--help"],
    "fxopt --version": [FXOPT, "--version"],
    "fxopt optimise (typo)": [FXOPT, "optimise"],
    "fxopt passes": [FXOPT, "passes"],
}


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default=str(RESULTS / "cli_startup.json"))
    args = parser.parse_args(argv)
    for command in COMMANDS.values():
        timed(command)  # warm the file cache once
    samples: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeat):  # interleaved: drifts hit every command alike
        for name, command in COMMANDS.items():
            samples[name].append(timed(command))
    rows = [
        {"command": name, "median_s": statistics.median(s), "samples_s": s}
        for name, s in samples.items()
    ]
    for row in rows:
        print(f"{row['command']:24s} {row['median_s']:.3f} s")
    data = {
        "machine": machine_info(),
        "command": command_line(),
        "config": {"repeat": args.repeat, "clock": "wall, fresh interpreter per run"},
        "rows": rows,
    }
    write_json(Path(args.out), data)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
