"""The bytes of a Circle file, held once: in memory, or in a temporary file of its own.

A large model's file is as large as its weights. Held as ``bytes`` and copied on its way
(builder → ``bytes`` → a temporary file for the runtime → ``save``), it cost several
copies of the weights; a :class:`CircleFile` is written once and read where it lies: the
runtime opens it from disk, ``save`` copies it file to file, and :meth:`spill` moves an
in-memory file to disk so that the memory is free before the runtime loads it.

    >>> import tempfile, pathlib
    >>> f = CircleFile(b"\\x00\\x00\\x00\\x00CIR0")
    >>> f.nbytes, f.read()[4:8]
    (8, b'CIR0')
    >>> f.spill(); f.in_memory
    False
    >>> with f.on_disk() as path:
    ...     pathlib.Path(path).read_bytes()[4:8]
    b'CIR0'
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path


class CircleFile:
    """Circle bytes (``data``: bytes, a bytearray or a memoryview over one) or a file on
    disk (``path``; ``owned``: deleted with this object)."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview | None = None,
        *,
        path: Path | None = None,
        owned: bool = False,
    ):
        if (data is None) == (path is None):
            raise ValueError("CircleFile takes data or a path")
        self._data = memoryview(data).cast("B") if data is not None else None
        self._path = Path(path) if path is not None else None
        self._cleanup = weakref.finalize(self, _remove, str(path)) if owned and path else None

    @classmethod
    def temporary(cls) -> tuple[CircleFile, object]:
        """An empty owned temporary file and its open binary handle, to write into."""
        handle, name = tempfile.mkstemp(suffix=".circle")
        return cls(path=Path(name), owned=True), os.fdopen(handle, "wb")

    @property
    def in_memory(self) -> bool:
        return self._data is not None

    @property
    def nbytes(self) -> int:
        if self._data is not None:
            return self._data.nbytes
        assert self._path is not None
        return self._path.stat().st_size

    def read(self) -> bytes:
        """The whole file as ``bytes`` (a copy: what a caller asking for bytes gets)."""
        if self._data is not None:
            return self._data.tobytes()
        assert self._path is not None
        return self._path.read_bytes()

    def save(self, path: str | Path) -> Path:
        """Write the file to ``path`` (from memory, or copied file to file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if self._data is not None:
            with open(path, "wb") as out:
                out.write(self._data)
        else:
            assert self._path is not None
            if self._path.resolve() != path.resolve():
                shutil.copyfile(self._path, path)
        return path

    def spill(self) -> None:
        """Move an in-memory file to a temporary file of its own, freeing the memory."""
        if self._data is None:
            return
        handle, name = tempfile.mkstemp(suffix=".circle")
        with os.fdopen(handle, "wb") as out:
            out.write(self._data)
        self._data = None
        self._path = Path(name)
        self._cleanup = weakref.finalize(self, _remove, name)

    @contextlib.contextmanager
    def on_disk(self) -> Iterator[str]:
        """A path to the file on disk: its own, or a temporary one for the block."""
        if self._path is not None:
            yield str(self._path)
            return
        handle, name = tempfile.mkstemp(suffix=".circle")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(self._data)
            yield name
        finally:
            _remove(name)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
