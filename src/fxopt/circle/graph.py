"""The lowered graph: Circle tensors and operators before they are serialized.

Lowering writes into a :class:`CircleGraph`; the Circle-level passes
(:mod:`fxopt.circle.passes`) rewrite it; :mod:`fxopt.circle.build` serializes it. Keeping
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
    >>> print(g.format())
    inputs: t0 float32[2, 3]
    t1 float32[2, 3] = RELU(t0)
    outputs: t1
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Quantization:
    """Affine quantization of a tensor: ``real = scale * (q - zero_point)``, one scale and
    zero point per tensor, or per slice along ``axis`` (per-channel weights).

    >>> Quantization((0.5,), (128,)).per_channel
    False
    """

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int = 0

    @property
    def per_channel(self) -> bool:
        return len(self.scale) > 1


@dataclass(frozen=True)
class Grid:
    """The integer grid a float constant lies on exactly: every value is
    ``scale * (q - zero_point)`` for an integer ``q`` in ``[qmin, qmax]``. A weight that the
    model stores as integers and dequantizes in the graph is lowered as its float values
    with its grid, so the file computes what the graph does; ``quantize-operators`` stores
    it back as integers when the operator reading it runs quantized.

    >>> Grid(Quantization((0.5,), (0,)), -127, 127).signed
    True
    """

    quantization: Quantization
    qmin: int
    qmax: int

    @property
    def signed(self) -> bool:
        return self.qmin < 0


@dataclass
class Tensor:
    """One Circle tensor. ``data`` is set for constants (weights, shapes, scalars);
    ``quantization`` for integer tensors that stand for real values."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    data: np.ndarray | None = None
    # -1 marks a dynamic dimension; None when every dimension is static.
    shape_signature: tuple[int, ...] | None = None
    # Constants that come from one torch storage share a key, so they share one buffer.
    buffer_key: object = None
    quantization: Quantization | None = None
    # A float constant that is a dequantized integer tensor (see Grid); None otherwise.
    grid: Grid | None = None
    # The Circle type of a constant stored in a block format (``"GGML_Q4_0"``): ``data`` is
    # its bytes (uint8, 1-D), ``shape`` the weight's. None: the type of ``dtype``.
    packed: str | None = None


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
        quantization: Quantization | None = None,
    ) -> int:
        self.tensors.append(
            Tensor(
                name,
                tuple(int(d) for d in shape),
                np.dtype(dtype),
                data,
                shape_signature,
                buffer_key,
                quantization,
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

    def sole_reader(self, tensor: int, readers: dict[int, list[Operator]]) -> Operator | None:
        """The one operator reading ``tensor`` (``readers`` from :meth:`consumers`), when it
        is read exactly once and is not a graph output; else None. A pass may then rewrite
        that pair without changing what anything else sees."""
        users = readers.get(tensor, ())
        return users[0] if len(users) == 1 and tensor not in self.outputs else None

    def format(self) -> str:
        """The graph as text, one operator a line (for dumps and golden tests): tensors are
        ``t<index>``, constants show their shape instead of their data, and a fused
        activation is printed after the operands."""
        from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType

        acts = {v: k for k, v in vars(ActivationFunctionType).items() if not k.startswith("_")}

        def typed(i: int) -> str:
            t = self.tensors[i]
            q = t.quantization
            quant = f" q(scale={q.scale[0]:.3g}, zp={q.zero_point[0]})" if q else ""
            if q and q.per_channel:
                quant = f" q(per-channel axis {q.axis}, {len(q.scale)} scales)"
            return f"t{i} {t.dtype.name}{list(t.shape)}{quant}"

        def operand(i: int) -> str:
            if i < 0:
                return "-"
            t = self.tensors[i]
            return f"const {t.dtype.name}{list(t.shape)}" if t.data is not None else f"t{i}"

        lines = ["inputs: " + ", ".join(typed(i) for i in self.inputs)]
        for op in self.operators:
            line = f"{', '.join(typed(o) for o in op.outputs)} = {op.code}("
            line += ", ".join(operand(i) for i in op.inputs) + ")"
            act = getattr(op.options, "fusedActivationFunction", 0)
            if act:
                line += f" fused={acts.get(act, act)}"
            lines.append(line)
        lines.append("outputs: " + ", ".join(f"t{i}" for i in self.outputs))
        return "\n".join(lines)

    def producers(self) -> dict[int, Operator]:
        return {index: op for op in self.operators for index in op.outputs}
