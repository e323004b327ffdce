"""Lazy package exports (PEP 562): a name is imported from its module on first access.

The packages whose API imports torch export their names this way, so importing one of
them for something light (the CLI's argument parsing, an error class) costs no torch
import, and ``fxopt --help`` answers in a fraction of a second. An exported name must not
also be a submodule's name: importing that submodule would shadow it.

    >>> getattr_, dir_ = exports("fxopt.example", {"sqrt": "math"})
    >>> getattr_("sqrt")(9.0), "sqrt" in dir_()
    (3.0, True)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(package: str, names: Mapping[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps each exported name to
    the module that defines it. A resolved name is kept on the package."""

    def __getattr__(name: str):
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module '{package}' has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        if package in sys.modules:
            setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        own = vars(sys.modules[package]) if package in sys.modules else {}
        return sorted({*own, *names})

    return __getattr__, __dir__
