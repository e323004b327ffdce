"""Collection rules shared by tests/ and the doctests in src/fxopt.

Without the ``circle`` extra (circle-schema, flatbuffers, onert) the converter cannot be
imported: its test modules are reported as skipped with the reason, and the doctests of
``fxopt.circle`` and ``fxopt.quant`` are not collected (counted in the summary),
instead of stopping collection.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.extras import CIRCLE_REASON, HAS_CIRCLE

_CIRCLE_SOURCES = Path(__file__).parent / "src" / "fxopt" / "circle"
# Modules outside fxopt.circle whose doctests convert to Circle.
_CIRCLE_DOCTESTS = (Path(__file__).parent / "src" / "fxopt" / "quant" / "__init__.py",)
_ignored: list[object] = []


class _SkippedModule(pytest.File):
    """A test module that cannot be imported here: one skipped item saying why."""

    def collect(self):
        yield _Skipped.from_parent(self, name=self.path.stem)


class _Skipped(pytest.Item):
    def runtest(self):
        pytest.skip(CIRCLE_REASON)

    def reportinfo(self):
        return self.path, None, f"{self.name}: {CIRCLE_REASON}"


def pytest_pycollect_makemodule(module_path: Path, parent):
    if not HAS_CIRCLE and module_path.name.startswith("test_circle"):
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: Path, parent):
    # --doctest-modules would import the skipped test modules too.
    collected = yield
    if not HAS_CIRCLE and file_path.name.startswith("test_circle"):
        return [node for node in collected if type(node).__name__ != "DoctestModule"]
    return collected


def pytest_ignore_collect(collection_path: Path, config):
    if not HAS_CIRCLE and (
        _CIRCLE_SOURCES in (collection_path, *collection_path.parents)
        or collection_path in _CIRCLE_DOCTESTS
    ):
        _ignored.extend(collection_path.rglob("*.py") if collection_path.is_dir() else [0])
        return True
    return None


def pytest_terminal_summary(terminalreporter):
    if _ignored:
        terminalreporter.write_line(
            f"not collected: the doctests of {len(_ignored)} modules that convert to Circle "
            f"({CIRCLE_REASON})"
        )
