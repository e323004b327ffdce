"""The notebooks are stored with their outputs; here each one is checked to be what its
jupytext source says (notebooks/*.py) and run again, top to bottom, in a fresh kernel."""

import sys
from pathlib import Path

import pytest

from tests.extras import HAS_CIRCLE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "notebooks"))

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
make_notebooks = pytest.importorskip("make_notebooks", reason="notebooks/make_notebooks.py")

pytestmark = pytest.mark.skipif(not HAS_CIRCLE, reason="the notebooks convert to Circle")


def _code(notebook) -> list[str]:
    return [cell.source.strip() for cell in notebook.cells if cell.cell_type == "code"]


@pytest.mark.parametrize("name", make_notebooks.NOTEBOOKS)
def test_the_stored_notebook_is_its_source_and_still_runs(name):
    stored = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    source = jupytext.read(ROOT / "notebooks" / f"{name}.py")
    assert _code(stored) == _code(source), f"run: python notebooks/make_notebooks.py {name}"
    # Every code cell of the stored notebook has been run (outputs kept for readers).
    assert all(cell.execution_count for cell in stored.cells if cell.cell_type == "code")
    fresh = make_notebooks.executed(name)  # raises CellExecutionError naming the failing cell
    printed = [
        output
        for cell in fresh.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type in ("stream", "display_data", "execute_result")
    ]
    assert printed, "the notebook printed nothing"
    assert not any(o.get("name") == "stderr" for o in printed), [
        o.text for o in printed if o.get("name") == "stderr"
    ]
