"""Every script in examples/ runs."""

import runpy
from pathlib import Path

import pytest

from tests.extras import require_circle

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path, capsys):
    if "convert" in path.name:
        require_circle()
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()
