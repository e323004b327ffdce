"""What the jobs of the ``fxopt`` command print alike. Imports no torch."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping

from rich.console import Console


def stdout() -> Console:
    """The console of a job's report on stdout."""
    # Piped output has no terminal width; 150 columns keep the report table unwrapped.
    return Console() if sys.stdout.isatty() else Console(width=150)


def print_json(report) -> None:
    """``--json``: the report as one JSON object on one line of stdout."""
    print(json.dumps(report))


def print_dumps(console: Console, dumps: Mapping[str, str]) -> None:
    """``--dump-after``: each graph under its title, on ``console`` (stderr: beside the
    progress, not in the report or its JSON)."""
    for name, text in dumps.items():
        console.print(f"[bold]graph after {name}[/]", highlight=False)
        console.print(text, highlight=False, markup=False)


#: How a job names its model, in every job's ``MODEL`` help.
MODEL_HELP = "zoo:NAME[?k=v&...], path/to/file.py:CALLABLE or pkg.module:CALLABLE"


def add_model_argument(parser: argparse.ArgumentParser, extra: str = "") -> None:
    """The ``MODEL`` positional argument every job takes."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP + extra)


def add_memory_check_argument(parser: argparse.ArgumentParser, verb: str) -> None:
    """``--no-memory-check``: run ``verb`` although the machine seems short of memory."""
    parser.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help=f"{verb} even when the machine seems to have less memory free than the job needs",
    )
