"""The error the tiler raises for a bad graph, pattern or library file.

It is a :class:`fxopt.errors.UserInputError`, so the ``fxopt`` command prints it as one
line and exits with status 2. Messages name the file (or ``<graph>`` / ``<library>`` for
data passed in memory) and the entry: ``lib.yaml: patterns[2] ('mlp'): output 'z' is not
one of its nodes``.
"""

from __future__ import annotations

from fxopt.errors import UserInputError


class TilingInputError(UserInputError):
    """A graph, pattern or library that cannot be used as given."""
