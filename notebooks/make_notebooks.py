"""Build the notebooks: each ``*.py`` here (jupytext percent format, the reviewed source)
becomes a ``.ipynb`` executed in a fresh kernel, stored with its outputs.

    python notebooks/make_notebooks.py            # every notebook
    python notebooks/make_notebooks.py tour       # one

tests/test_notebooks.py checks that each stored notebook is its source's and that it still
runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOTEBOOKS = ("essentials", "tour")


def executed(name: str, timeout: int = 600):
    """The notebook of ``name.py``, run top to bottom in a fresh kernel in this folder."""
    import jupytext
    from nbclient import NotebookClient

    notebook = jupytext.read(HERE / f"{name}.py")
    notebook.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    NotebookClient(notebook, timeout=timeout, resources={"metadata": {"path": str(HERE)}}).execute()
    return notebook


def main(argv: list[str]) -> int:
    import nbformat

    for name in argv or NOTEBOOKS:
        notebook = executed(name)
        nbformat.write(notebook, HERE / f"{name}.ipynb")
        print(f"wrote {HERE / name}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
