"""RESULTS.md and WRITEUP.md's headline figures are generated from results/*.json: a check
that the committed pages are what the generator makes of the committed JSON, so no figure
is edited by hand or left behind when a benchmark is re-run."""

import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

make_results = pytest.importorskip("make_results")


def test_results_md_is_what_the_json_renders_to():
    assert (ROOT / "RESULTS.md").read_text() == make_results.render_all(ROOT / "results")


def test_writeup_headlines_are_generated_from_the_results():
    text = (ROOT / "WRITEUP.md").read_text()
    begin, end = make_results.HEADLINES_BEGIN, make_results.HEADLINES_END
    block = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == make_results.render_headlines(ROOT / "results")
    # Each headline names a RESULTS.md section that exists.
    sections = {
        line.lstrip("# ").strip()
        for line in (ROOT / "RESULTS.md").read_text().splitlines()
        if line.startswith("## ")
    }
    for row in block.splitlines()[2:]:
        named = row.strip("| ").split(" | ")[-1]
        assert any(s.startswith(named) for s in sections), named


def test_recorded_commands_name_no_directory_of_the_machine_that_ran_them():
    from common import portable_path

    assert portable_path(str(ROOT / "results" / "x.json")) == "results/x.json"
    scratch = Path(tempfile.gettempdir())
    assert portable_path(str(scratch / "scratch" / "out.json")) == "…/out.json"
    assert portable_path("--quick") == "--quick"
    text = (ROOT / "RESULTS.md").read_text()
    assert str(ROOT) not in text and f"{scratch}/" not in text
