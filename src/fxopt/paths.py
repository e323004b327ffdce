"""The files fxopt reads and writes for the CLI, checked before any work is done.

A report path in a missing read-only folder should fail in a millisecond with one line,
not after a minute of optimizing with a traceback; a binary file given as a YAML config
should say so, not raise ``UnicodeDecodeError``.

    >>> from pathlib import Path
    >>> from fxopt.paths import writable
    >>> writable(Path("out/report.md"), "--report").name
    'report.md'
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fxopt.errors import UserInputError


def writable(path: Path, option: str) -> Path:
    """``path`` if a file can be written there (its folder may not exist yet), else a
    UserInputError naming ``option``."""
    path = Path(path)
    if path.is_dir():
        raise UserInputError(f"{option} {path}: is a directory; give a file path")
    folder = _existing_ancestor(path.parent)
    if not folder.is_dir():
        raise UserInputError(f"{option} {path}: {folder} is a file, not a directory")
    _try_writing_in(folder, f"{option} {path}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserInputError(f"{option} {path}: the file exists and is read-only")
    return path


#: What the plots can be saved as (matplotlib picks the format from the suffix).
IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def writable_image(path: Path, option: str) -> Path:
    """``path`` if a plot can be written there: :func:`writable`, with an image suffix."""
    path = writable(path, option)
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise UserInputError(
            f"{option} {path}: a plot is written as {', '.join(IMAGE_SUFFIXES)}; "
            f"'{path.suffix or '(no suffix)'}' is none of them"
        )
    return path


def writable_directory(path: Path, option: str) -> Path:
    """``path`` if it is (or can be created as) a writable directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserInputError(f"{option} {path}: exists and is not a directory")
    folder = _existing_ancestor(path)
    if not folder.is_dir():
        raise UserInputError(f"{option} {path}: {folder} is a file, not a directory")
    _try_writing_in(folder, f"{option} {path}")
    return path


def _try_writing_in(folder: Path, what: str) -> None:
    """Create and delete a scratch file in ``folder``: permission bits do not tell (root
    may write anywhere by them, but not in /proc or on a read-only mount)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise UserInputError(f"{what}: cannot write in {folder} ({reason.lower()})") from None


def read_text(path: Path, what: str) -> str:
    """The text of ``path`` (UTF-8), or a UserInputError saying why it cannot be read."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"{what} not found: {path}")
    if path.is_dir():
        raise UserInputError(f"{what} {path} is a directory, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserInputError(f"{what} {path} is not a text file (not valid UTF-8)") from None
    except OSError as error:
        raise UserInputError(f"cannot read {what} {path}: {error.strerror or error}") from None


def _existing_ancestor(path: Path) -> Path:
    path = path if str(path) else Path(".")
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
