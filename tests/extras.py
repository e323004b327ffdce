"""Which optional extras are installed, for tests that need one (see ../conftest.py)."""

from __future__ import annotations

import importlib

import pytest


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


HAS_CIRCLE = all(_importable(name) for name in ("circle_schema", "flatbuffers"))
CIRCLE_REASON = "the circle extra is not installed: pip install -e '.[circle]'"

#: Mark for a test that converts to Circle.
needs_circle = pytest.mark.skipif(not HAS_CIRCLE, reason=CIRCLE_REASON)


def require_circle() -> None:
    """Skip the running test (one case of a parametrized one) without the circle extra."""
    if not HAS_CIRCLE:
        pytest.skip(CIRCLE_REASON)
