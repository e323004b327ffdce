"""The lowered graph: Circle tensors and operators before they are serialized.

Lowering writes into a :class:`CircleGraph`; the Circle-level optimizations
(:mod:`fxopt.circle.optimize`) rewrite it; :mod:`fxopt.circle.build` serializes it. Keeping
this small in-memory form between the torch graph and the FlatBuffer means the fusions and
the op counts never parse bytes, and the builder never sees a torch object.

    >>> import numpy as np
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> y = g.add_tensor("y", (2, 3), np.float32)
    >>> g.add_op("RELU", [x], [y])
    >>> g.inputs, g.outputs = [x], [y]
    >>> g.op_counts()
    {'RELU': 1}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Tensor:
    """One Circle tensor. ``data`` is set for constants (weights, shapes, scalars)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: np.ndarray | None = None
    # -1 marks a dynamic dimension (seed §4.3); None when every dimension is static.
    shape_signature: tuple[int, ...] | None = None
    # Constants that come from one torch storage share a key, so they share one buffer.
    buffer_key: object = None


@dataclass
class Operator:
    """One Circle operator: a BuiltinOperator name, tensor indices and an options object."""

    code: str
    inputs: list[int]
    outputs: list[int]
    options: object | None = None


@dataclass
class CircleGraph:
    tensors: list[Tensor] = field(default_factory=list)
    operators: list[Operator] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)

    def add_tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: object,
        data: np.ndarray | None = None,
        *,
        shape_signature: tuple[int, ...] | None = None,
        buffer_key: object = None,
    ) -> int:
        self.tensors.append(
            Tensor(
                name,
                tuple(int(d) for d in shape),
                np.dtype(dtype),
                data,
                shape_signature,
                buffer_key,
            )
        )
        return len(self.tensors) - 1

    def add_op(
        self, code: str, inputs: list[int], outputs: list[int], options: object = None
    ) -> None:
        self.operators.append(Operator(code, list(inputs), list(outputs), options))

    def op_counts(self) -> dict[str, int]:
        """Operator name → count, most frequent first."""
        return dict(Counter(op.code for op in self.operators).most_common())

    def consumers(self) -> dict[int, list[Operator]]:
        """Tensor index → the operators that read it, in graph order."""
        users: dict[int, list[Operator]] = {}
        for op in self.operators:
            for index in op.inputs:
                if index >= 0:
                    users.setdefault(index, []).append(op)
        return users

    def producers(self) -> dict[int, Operator]:
        return {index: op for op in self.operators for index in op.outputs}
