"""Run Circle bytes in onert, the ONE project's runtime, working around its binding quirks.

onert 0.1.0 (the PyPI wheel) misreads non-contiguous numpy inputs and crashes on rank-0
inputs, so inputs are made C-contiguous here and rank-0 inputs are rejected with a clear
message (the converter gives scalar inputs shape ``[1]`` instead). The session reads a file,
so the bytes go to a temporary file first.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from fxopt.errors import FxoptError


class RuntimeUnavailableError(FxoptError):
    """onert is not installed (``pip install 'fxopt[circle]'``) or cannot load a model."""


def onert_available() -> bool:
    """True when the onert Python package can be imported."""
    try:
        import onert  # noqa: F401
    except Exception:
        return False
    return True


def as_numpy(value: object) -> np.ndarray:
    """A C-contiguous numpy array (torch tensors are detached and moved to the CPU)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.ascontiguousarray(value)


class Session:
    """An onert session over Circle bytes; ``run`` returns numpy outputs."""

    def __init__(self, data: bytes, backends: str = "cpu"):
        try:
            from onert import infer
        except Exception as error:
            raise RuntimeUnavailableError(
                f"onert is not importable ({error}); install it with pip install 'fxopt[circle]'"
            ) from error
        handle, self._path = tempfile.mkstemp(suffix=".circle")
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        try:
            self._session = infer.session(self._path, backends)
        except Exception as error:
            os.unlink(self._path)
            raise RuntimeUnavailableError(f"onert cannot load the model: {error}") from error

    def run(self, inputs: Sequence[object]) -> list[np.ndarray]:
        arrays = [as_numpy(x) for x in inputs]
        for i, array in enumerate(arrays):
            if array.ndim == 0:
                raise ValueError(f"input {i} is rank 0: onert 0.1.0 cannot bind rank-0 inputs")
        outputs = self._session.infer(arrays)
        return [np.array(o, copy=True) for o in outputs]

    def latency_ms(self, inputs: Sequence[object], runs: int = 20, warmup: int = 3) -> float:
        """Median wall time of ``runs`` inferences after ``warmup`` (milliseconds)."""
        arrays = [as_numpy(x) for x in inputs]
        for _ in range(warmup):
            self._session.infer(arrays)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self._session.infer(arrays)
            times.append((time.perf_counter() - start) * 1e3)
        return float(np.median(times))

    def close(self) -> None:
        if os.path.exists(self._path):
            os.unlink(self._path)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: os may be gone
            self.close()
