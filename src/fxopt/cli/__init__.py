"""The ``fxopt`` command. The only package that reads options from outside.

One module per job, each with ``HELP``, ``add_arguments(parser)`` and ``run(args,
console) -> int``: :mod:`~fxopt.cli.optimize`, :mod:`~fxopt.cli.passes`,
:mod:`~fxopt.cli.demo`, :mod:`~fxopt.cli.tile`, :mod:`~fxopt.cli.remat` and
:mod:`~fxopt.cli.convert`; what they print alike is in :mod:`fxopt.cli._common`. This
module parses the command line, runs the job and turns its errors into exit codes.

Exit status: 0 on success, 2 for a user mistake (bad MODEL spec, missing file, bad shape,
unknown pass or preset, untraceable model), 1 for an internal failure (a pass that broke
or a result that failed verification). Errors print one line; ``--debug`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape

from fxopt import __version__
from fxopt.errors import FxoptError, UserInputError

# The subcommands, in the order `fxopt --help` lists them. Each module imports torch only
# inside `run`, so `fxopt --help` stays fast. Listed here, not registered on import: the
# CLI's shape is readable in one place.
COMMAND_MODULES: dict[str, str] = {
    "optimize": "fxopt.cli.optimize",
    "passes": "fxopt.cli.passes",
    "demo": "fxopt.cli.demo",
    "tile": "fxopt.cli.tile",
    "remat": "fxopt.cli.remat",
    "convert": "fxopt.cli.convert",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxopt", description="Graph optimizer for PyTorch: every rewrite verified."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"fxopt {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMAND_MODULES.items():
        module = importlib.import_module(module_name)
        module.add_arguments(commands.add_parser(name, help=module.HELP))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # The torch profiler (remat measures memory with it) prints a USDT line per profiling
    # session to stderr unless kineto's log level is raised before torch loads it.
    os.environ.setdefault("KINETO_LOG_LEVEL", "9")
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return _run_command(args, console)
    except UserInputError as error:
        if args.debug:
            raise
        console.print(f"[bold red]fxopt: error:[/] {escape(str(error))}", **_ONE_LINE)
        return 2
    except FxoptError as error:
        if args.debug:
            raise
        console.print(
            f"[bold red]fxopt: {type(error).__name__}:[/] {escape(str(error))}", **_ONE_LINE
        )
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a bug in fxopt: one line, and how to see more
        if args.debug:
            raise
        console.print(
            f"[bold red]fxopt: internal error:[/] {type(error).__name__}: {escape(str(error))} "
            "(run with --debug for the traceback)",
            **_ONE_LINE,
        )
        return 1


def _run_command(args, console: Console) -> int:
    if getattr(args, "threads", None) is not None:
        if args.threads < 1:
            raise UserInputError(f"--threads must be at least 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    return importlib.import_module(COMMAND_MODULES[args.command]).run(args, console)


# Error lines: no highlighting, no wrapping; messages are escaped, since shapes such as
# float32[s0 >= 1, 8] would otherwise read as rich markup.
_ONE_LINE = {"highlight": False, "soft_wrap": True}
