"""``fxopt passes``: every pass of every job (optimize, convert, remat), and the pipelines.

Imports torch only inside :func:`run`.
"""

from __future__ import annotations

import argparse

from fxopt.cli._common import stdout

HELP = "list the available passes and presets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(args, console) -> int:
    from rich.table import Table

    from fxopt.passes import PASSES, pipelines
    from fxopt.passes.registry import ALIASES
    from fxopt.remat.dead_draws import RemoveDeadDraws
    from fxopt.remat.input_writes import DetachInputWrites, RestoreInputWrites
    from fxopt.remat.joint_cse import JointCSE
    from fxopt.remat.rewrite import Recompute
    from fxopt.remat.snapshots import AddSnapshots
    from fxopt.remat.split_dropouts import SplitDropouts
    from fxopt.remat.updates import ApplyUpdates

    out = stdout()
    table = Table(title="passes", title_justify="left")
    for column in ("name", "job", "aliases", "what it does"):
        table.add_column(column)
    circle = _circle_pipelines()
    in_convert = set(circle[0].pass_names()) if circle else set()
    for name in sorted(PASSES):
        aliases = ", ".join(a for a, target in ALIASES.items() if target == name)
        job = "optimize, convert" if name in in_convert else "optimize"
        table.add_row(name, job, aliases, PASSES[name].description)
    for pass_ in circle[1].passes if circle else ():
        table.add_row(pass_.name, "convert", "", pass_.description)
    for cls in (SplitDropouts, AddSnapshots, Recompute, ApplyUpdates):
        table.add_row(cls.name, "remat", "", cls.description)
    for cls in (JointCSE, DetachInputWrites, RestoreInputWrites, RemoveDeadDraws):
        table.add_row(cls.name, "remat (torch.compile backend)", "", cls.description)
    out.print(table)
    presets = Table(title="pipelines", title_justify="left")
    presets.add_column("name")
    presets.add_column("passes, in order")
    for name in pipelines.PRESETS:
        presets.add_row(name, " → ".join(pipelines.get(name).pass_names()) or "(none)")
    if circle:
        steps = [*circle[0].pass_names(), "lower", *circle[1].pass_names()]
        presets.add_row("convert", " → ".join(steps))
    else:
        presets.add_row("convert", "(install fxopt[circle])")
    presets.add_row("remat", "split-dropouts → add-snapshots → plan → recompute (→ apply-updates)")
    out.print(presets)
    return 0


def _circle_pipelines() -> tuple | None:
    """The converter's default pipelines (ATen passes, Circle passes), or None when the
    circle extra is not installed."""
    try:
        from fxopt.circle.config import CircleConfig
        from fxopt.circle.passes import aten_pipeline, circle_pipeline
    except ImportError:
        return None
    config = CircleConfig()
    return aten_pipeline(config), circle_pipeline(config)
