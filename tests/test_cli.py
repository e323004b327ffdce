"""The fxopt command: exit codes, one-line errors, JSON keys."""

import json
import re
import subprocess
import sys
import textwrap

import pytest

from fxopt.cli import main
from tests.contract import OPTIMIZE_KEYS
from tests.extras import needs_circle

FXOPT = [sys.executable, "-m", "fxopt.cli"]


def run(*args, cwd=None):
    return subprocess.run([*FXOPT, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_optimize_json_has_the_documented_keys(capsys):
    code = main(["optimize", "zoo:redundant", "--json", "--runs", "2"])  # autotune on
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in OPTIMIZE_KEYS:
        assert key in report
    assert report["verified"] is True
    assert report["nodes_after"] < report["nodes_before"]
    assert {"name", "changed", "time_ms", "stats"} <= set(report["passes"][0])
    assert report["layout"]["chosen"] in report["layout"]["median_ms"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["optimize", "zoo:nope"], "unknown zoo model 'nope'"),
        (["optimize", "missing.py:make"], "model file not found: missing.py"),
        (["optimize", "zoo:mlp", "--passes", "cse,bogus"], "unknown pass 'bogus'"),
        (["optimize", "zoo:mlp", "--preset", "fastest"], "unknown preset 'fastest'"),
        (["optimize", "zoo:mlp", "--input", "1xAx3"], "bad input shape '1xAx3'"),
        (["optimize", "nonsense"], "bad MODEL 'nonsense'"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(args, message):
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0


def test_model_from_file_factory_errors_and_inputs(tmp_path):
    (tmp_path / "models.py").write_text(
        textwrap.dedent("""
        import torch

        def with_inputs():
            return torch.nn.Linear(3, 3), (torch.randn(2, 3),)

        def without_inputs():
            return torch.nn.Linear(3, 3)

        def broken():
            raise ValueError("no weights here")

        class Untraceable(torch.nn.Module):
            def forward(self, x):
                return x if x.sum() > 0 else -x

        def untraceable():
            return Untraceable(), (torch.randn(3),)
    """)
    )
    models = str(tmp_path / "models.py")
    ok = run("optimize", models + ":with_inputs", "--json", "--runs", "1", "--no-autotune")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["verified"] is True
    no_inputs = run("optimize", str(tmp_path / "models.py") + ":without_inputs")
    assert no_inputs.returncode == 2 and "--input" in no_inputs.stderr
    given = run(
        "optimize", models + ":without_inputs", "--input", "2x3", "--runs", "1", "--no-autotune"
    )
    assert given.returncode == 0, given.stderr
    broken = run("optimize", str(tmp_path / "models.py") + ":broken")
    assert broken.returncode == 2 and "no weights here" in broken.stderr
    untraceable = run("optimize", str(tmp_path / "models.py") + ":untraceable")
    assert untraceable.returncode == 2
    assert "with fx" in untraceable.stderr and "with export" in untraceable.stderr
    assert "models.py" in untraceable.stderr
    assert "Traceback" not in untraceable.stderr
    fx_only = run("optimize", str(tmp_path / "models.py") + ":untraceable", "--mode", "fx")
    assert fx_only.returncode == 2 and "mode='export'" in fx_only.stderr


#: The line optimize prints as each phase starts when stderr is not a terminal: progress,
#: not part of an error message.
PROGRESS = re.compile(r"^fxopt: .*: (capture|passes|verify|layout|benchmark) \(at [\d.]+ s\)$")


def one_line_error(result, code: int = 2) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not PROGRESS.match(line)]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--passes", ","], "names no pass"),
        (["--passes", "cse", "--preset", "bogus"], "not both"),
        (["--passes", "cse", "--dump-after", "dce"], "'dce': not a pass of this pipeline"),
        (["--input", "100000x100000x100000"], "cannot be allocated"),
        (["--input", "2x7"], "module 'fc1' (Linear)"),  # the layer, and both shapes:
        (["--input", "2x7", "--mode", "export"], "(2x7 and 784x256)"),
    ],
)
def test_option_mistakes_are_one_line_user_errors(args, message):
    assert message in one_line_error(run("optimize", "zoo:mlp", "--runs", "0", *args))


def test_unwritable_output_paths_fail_before_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for option in ("--report", "--plot"):
        result = run("optimize", "zoo:mlp", option, str(blocker / "out"))
        assert "is a file, not a directory" in one_line_error(result)
    result = run("demo", "--out", str(blocker))
    assert "not a directory" in one_line_error(result)


def test_model_file_mistakes_are_user_errors(tmp_path):
    (tmp_path / "sibling.py").write_text("SIZE = 3\n")
    (tmp_path / "models.py").write_text(
        textwrap.dedent("""
        from __future__ import annotations

        import dataclasses

        import torch


        @dataclasses.dataclass
        class Config:  # needs its module in sys.modules while the file runs
            size: int = 3


        class Two(torch.nn.Module):
            def forward(self, x, y):
                return x + y


        def lazy():
            from sibling import SIZE  # imported when the factory runs, not at import
            return torch.nn.Linear(SIZE, Config().size).eval(), (torch.randn(2, SIZE),)


        def two_inputs():
            return Two(), (torch.randn(2, 3),)


        def int_example():
            return torch.nn.Linear(3, 3), (torch.arange(6).reshape(2, 3),)
    """)
    )
    models = str(tmp_path / "models.py")
    ok = run("optimize", models + ":lazy", "--runs", "0", "--no-autotune")
    assert ok.returncode == 0, ok.stderr
    assert "takes 2 inputs" in one_line_error(run("optimize", models + ":two_inputs"))
    assert "fails on its example inputs" in one_line_error(run("optimize", models + ":int_example"))


def test_report_plot_and_explain(tmp_path, capsys):
    report, plot = tmp_path / "r.md", tmp_path / "p.png"
    code = main(
        [
            "optimize",
            "zoo:redundant",
            "--runs",
            "1",
            "--report",
            str(report),
            "--plot",
            str(plot),
            "--explain",
            "--mode",
            "export",
            "--no-autotune",
        ]
    )
    assert code == 0
    assert "| cse |" in report.read_text()
    assert plot.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "skipped site" in out or "no site was skipped" in out


@needs_circle
def test_passes_lists_every_registered_pass(capsys):
    from fxopt.passes import available

    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in (*available(), "fuse-activations", "split-dropouts", "recompute"):
        assert name in out
    assert "redundant_ops" in out and "speed" in out


def test_dump_after_prints_the_graph_after_that_pass(capsys):
    code = main(
        ["optimize", "zoo:redundant", "--runs", "0", "--no-autotune", "--dump-after", "cse"]
    )
    assert code == 0
    err = capsys.readouterr().err  # beside the progress, not in the report (or its JSON)
    assert "graph after cse" in err and "placeholder" in err


def test_parsing_the_command_line_does_not_import_torch():
    # `fxopt --help` and argument errors answer before torch is imported (fxopt._lazy):
    # checked in a fresh interpreter, as a user's shell runs it.
    probe = (
        "import sys\n"
        "from fxopt.cli import main\n"
        "for argv in (['--help'], ['convert', '--help'], ['remat', '--help'], ['optimise'],\n"
        "             ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
    assert "invalid choice: 'optimise'" in result.stderr
    import fxopt

    assert f"fxopt {fxopt.__version__}" in result.stdout  # --version, from the one place


def test_optimize_reports_phase_times_and_prints_each_phase_off_a_terminal(capsys):
    assert main(["optimize", "zoo:redundant", "--runs", "2", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    phases = report["phases_s"]
    assert list(phases) == ["capture", "passes", "verify", "layout", "benchmark"]
    assert all(seconds >= 0 for seconds in phases.values())
    # stderr is not a terminal here: one line per phase, in order, as it starts.
    lines = [line for line in captured.err.splitlines() if line.startswith("fxopt: ")]
    assert [line.split(": ")[2].split(" (at")[0] for line in lines] == list(phases)


def test_a_job_the_machine_cannot_hold_is_one_line_and_exit_2(monkeypatch, capsys):
    from fxopt import memory

    monkeypatch.setattr(memory, "available_bytes", lambda: 16)
    assert main(["optimize", "zoo:mlp", "--runs", "0"]) == 2
    err = capsys.readouterr().err
    assert "optimize needs about" in err and "--no-memory-check" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["optimize", "zoo:mlp", "--runs", "0", "--no-memory-check", "--json"]) == 0
