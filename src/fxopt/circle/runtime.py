"""Run Circle bytes in onert, the ONE project's runtime, or in LiteRT, the second runtime.

onert 0.1.0 (the PyPI wheel) misreads non-contiguous numpy inputs and crashes on rank-0
inputs, so inputs are made C-contiguous here and rank-0 inputs are rejected with a clear
message (the converter gives scalar inputs shape ``[1]`` instead). The session reads a file:
a :class:`~fxopt.circle.file.CircleFile` on disk is read where it lies, bytes go to a
temporary file first.

LiteRT (``ai-edge-litert``) runs the operators onert 0.1.0 has no kernel for (CUMSUM,
TRANSPOSE_CONV, ...). Circle's schema is a superset of TFLite's: the same model re-packed
with schema version 3 and file identifier ``TFL3`` (:func:`litert_twin`) loads there, as
long as it uses no Circle-only operator. Its reference kernels share no code with ours.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence

import numpy as np

from fxopt.circle.file import CircleFile
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
    """An onert session over a Circle file (or bytes); ``run`` returns numpy outputs."""

    def __init__(self, data: bytes | CircleFile, backends: str = "cpu"):
        try:
            from onert import infer
        except Exception as error:
            raise RuntimeUnavailableError(
                f"onert is not importable ({error}); install it with pip install 'fxopt[circle]'"
            ) from error
        # onert copies every constant out of the file into memory of its own (+1.18x the
        # weights, measured on a 0.7 GiB Llama) unless told to read them from the mapped
        # file (pages the kernel can drop and read again): a user's own setting stands.
        os.environ.setdefault("USE_MMAPED_DATA", "1")
        circle = data if isinstance(data, CircleFile) else CircleFile(data)
        self._file = contextlib.ExitStack()
        path = self._file.enter_context(circle.on_disk())
        try:
            self._session = infer.session(path, backends)
        except Exception as error:
            self._file.close()
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
        self._file.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: os may be gone
            self.close()


def litert_available() -> bool:
    """True when the LiteRT interpreter (``ai-edge-litert``) can be imported."""
    try:
        from ai_edge_litert import interpreter  # noqa: F401
    except Exception:
        return False
    return True


def litert_twin(data: bytes | CircleFile) -> bytes:
    """``data`` re-packed as a TFLite file: schema version 3, identifier ``TFL3``."""
    import flatbuffers
    from circle_schema.v0_10.circle import Model

    if isinstance(data, CircleFile):
        data = data.read()
    model = Model.ModelT.InitFromPackedBuf(data, 0)
    model.version = 3
    builder = flatbuffers.Builder(len(data) + 1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


class LiteRTSession:
    """A LiteRT interpreter over Circle bytes (its TFLite twin), reference kernels only:
    no XNNPACK delegate, so the numbers come from a second, independent implementation."""

    def __init__(self, data: bytes | CircleFile, *, twin: CircleFile | None = None):
        try:
            from ai_edge_litert.interpreter import Interpreter, OpResolverType
        except Exception as error:
            raise RuntimeUnavailableError(
                f"LiteRT is not importable ({error}); install it with pip install ai-edge-litert"
            ) from error
        self._file = contextlib.ExitStack()
        resolver = OpResolverType.BUILTIN_REF
        try:
            if twin is not None:  # read where it lies (mapped, as LiteRT reads files)
                path = self._file.enter_context(twin.on_disk())
                self._interpreter = Interpreter(
                    model_path=path, experimental_op_resolver_type=resolver
                )
            else:
                self._interpreter = Interpreter(
                    model_content=litert_twin(data), experimental_op_resolver_type=resolver
                )
        except Exception as error:
            self._file.close()
            raise RuntimeUnavailableError(f"LiteRT cannot load the model: {error}") from error

    def run(self, inputs: Sequence[object]) -> list[np.ndarray]:
        interpreter = self._interpreter
        details = interpreter.get_input_details()
        # Rank-0 inputs are [1] in the file (see the module docstring).
        arrays = [as_numpy(x).reshape(1) if np.ndim(x) == 0 else as_numpy(x) for x in inputs]
        if len(arrays) != len(details):
            raise ValueError(f"the model takes {len(details)} inputs, got {len(arrays)}")
        for detail, array in zip(details, arrays):
            if tuple(detail["shape"]) != array.shape:
                interpreter.resize_tensor_input(detail["index"], array.shape)
        interpreter.allocate_tensors()
        for detail, array in zip(details, arrays):
            interpreter.set_tensor(detail["index"], array)
        interpreter.invoke()
        outputs = interpreter.get_output_details()
        return [np.array(interpreter.get_tensor(d["index"]), copy=True) for d in outputs]

    def __enter__(self) -> LiteRTSession:
        return self

    def __exit__(self, *exc) -> None:
        self._interpreter = None
        self._file.close()


def open_session(
    data: bytes | CircleFile, runtime: str = "onert", *, litert_file: CircleFile | None = None
) -> Session | LiteRTSession:
    """A session over Circle ``data`` in ``runtime``: "onert" or "litert". ``litert_file``:
    ``data``'s LiteRT twin already written (a file with offset buffers, which cannot be
    re-packed in memory: :func:`fxopt.circle.build.build_file` with ``LITERT``).

    >>> open_session(b"", "tflite")
    Traceback (most recent call last):
    ...
    ValueError: unknown runtime 'tflite'; expected onert or litert
    """
    if runtime == "onert":
        return Session(data)
    if runtime == "litert":
        return LiteRTSession(data, twin=litert_file)
    raise ValueError(f"unknown runtime {runtime!r}; expected onert or litert")
