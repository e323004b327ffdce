"""CircleModel: the converted file plus what users ask of it (save, run, counts)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fxopt.circle.file import CircleFile


@dataclass
class CircleModel:
    """A converted model. ``file`` is the Circle file (in memory, or for a large model in a
    temporary file: :class:`~fxopt.circle.file.CircleFile`), ``bytes`` a copy of its
    content; ``report`` says how it was made; ``validation`` (a
    :class:`~fxopt.circle.validation.Validation`, None when not asked for) says which
    runtime checked it against PyTorch and how closely it matched."""

    file: CircleFile
    operators: list[str]
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    validation: object = None
    # The Circle graph the bytes were built from, kept for quantized files only (their
    # per-kernel validation reads it); None otherwise.
    graph: object = field(default=None, repr=False, compare=False)
    #: The LiteRT twin of a file with offset buffers (over 2 GiB), which onert 0.1.0
    #: cannot read: written when the file is validated.
    litert: CircleFile | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.file, CircleFile):
            self.file = CircleFile(self.file)

    @property
    def bytes(self) -> bytes:
        """The file's content (a copy: :meth:`save` writes it without one)."""
        return self.file.read()

    @property
    def nbytes(self) -> int:
        return self.file.nbytes

    @property
    def op_counts(self) -> dict[str, int]:
        """Operator name → count, most frequent first."""
        return dict(Counter(self.operators).most_common())

    @property
    def transposes(self) -> int:
        return self.operators.count("TRANSPOSE")

    def save(self, path: str | Path) -> Path:
        return self.file.save(path)

    def run(self, *inputs) -> list[np.ndarray]:
        """Run in onert (the ONE runtime) on torch tensors or numpy arrays."""
        from fxopt.circle.runtime import Session

        with Session(self.file) as session:
            return session.run(inputs)

    def summary(self) -> str:
        """A few lines: size, operator counts, transposes, per-stage time."""
        counts = ", ".join(f"{name} {count}" for name, count in self.op_counts.items())
        stages = ", ".join(
            f"{name} {ms:.0f} ms" for name, ms in self.report.get("stages_ms", {}).items()
        )
        lines = [
            f"Circle model: {self.nbytes / 1024:.1f} KiB, {len(self.operators)} operators "
            f"({self.transposes} TRANSPOSE)",
            f"  ops: {counts}",
            f"  time: {stages}",
        ]
        baked = self.report.get("baked_inputs")
        if baked:
            values = ", ".join(f"{name}={value}" for name, value in baked.items())
            lines.append(f"  baked in (not inputs of the file): {values}")
        if self.validation is not None:
            lines.append(f"  validation: {self.validation.message}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"CircleModel({self.nbytes} bytes, {len(self.operators)} operators, "
            f"inputs={self.input_names}, outputs={self.output_names})"
        )
