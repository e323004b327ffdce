"""copy-aliased-outputs: a graph output that onert may overwrite is re-read at the end.

onert 0.1.0 runs RESHAPE in place (its output shares the input's memory) and frees that
memory after the last operator that reads it, graph output or not: the next operator may
then write over it (measured: ``return y, y.reshape(2, -1) + 1`` returned ``y + 1`` as its
first output); a graph output a TRANSPOSE reads was overwritten too. The converter must
not hand over that pattern, so such an output is produced by one more RESHAPE (to its own
shape) after every other operator, which keeps its memory alive to the end (measured:
both outputs then match PyTorch; a one-input CONCATENATION there works too, at the cost of
a copy).

The same holds for a CONCATENATION's output that another operator also reads (measured:
``y = torch.cat([x, z]); return y[:4, :, :24], y`` returned ``y`` off by 5.9 in its first
rows; a MUL or a BATCH_MATMUL reading it broke it too, though not every time: a KV-cache
update returning the cache that attention reads is this pattern).

More generally, onert's memory planner may give a graph output's buffer to an operator
after the output's last reader (measured: ``d = x / y; return d, x - floor(d) * y``
returned ``d`` off by 4.1; NEG, ABS, EXP, RELU in FLOOR's place alike), though most graphs
never meet it. ``every_read`` re-produces every graph output another operator reads:
``convert`` turns it on when a file's values differ in validation
(``CircleConfig.copy_read_outputs``).

    >>> import numpy as np
    >>> from fxopt.circle.graph import CircleGraph
    >>> g = CircleGraph()
    >>> x = g.add_tensor("x", (2, 3), np.float32)
    >>> y, r = g.add_tensor("y", (2, 3), np.float32), g.add_tensor("r", (6,), np.float32)
    >>> g.add_op("RELU", [x], [y])
    >>> g.add_op("RESHAPE", [y], [r])
    >>> g.inputs, g.outputs = [x], [y, r]
    >>> CopyAliasedOutputs()(g).stats, [op.code for op in g.operators]
    ({'copied': 1}, ['RELU', 'RESHAPE', 'RESHAPE'])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from circle_schema.v0_10.circle.ReshapeOptions import ReshapeOptionsT

from fxopt.circle.graph import CircleGraph
from fxopt.circle.passes.kind import CIRCLE
from fxopt.passes.base import Pass, PassResult, Plan

#: Operators after which onert 0.1.0 may overwrite a graph output they read: RESHAPE runs
#: in place on its input's memory; TRANSPOSE does not, but measured alike (``y = x * 1.5;
#: return q @ y.transpose(-1, -2), y`` returned ``y`` off by 6.5: a decode step's key
#: cache, returned and read transposed by attention, is this pattern).
ALIASING = ("RESHAPE", "TRANSPOSE")
#: Operators whose graph output onert 0.1.0 may overwrite when any operator reads it.
FRAGILE_PRODUCERS = ("CONCATENATION",)


@dataclass(frozen=True)
class CopyPlan(Plan):
    outputs: tuple[int, ...] = ()  # graph output tensors onert may overwrite


class CopyAliasedOutputs(Pass[CopyPlan]):
    name = "copy-aliased-outputs"
    description = "a graph output onert may overwrite is produced again at the end"
    graph_kind = CIRCLE
    idempotent = True

    def __init__(self, every_read: bool = False):
        super().__init__()
        self.every_read = every_read

    def analyze(self, graph: CircleGraph) -> CopyPlan:
        outputs = set(graph.outputs)
        fragile = {
            tensor
            for op in graph.operators
            if op.code in FRAGILE_PRODUCERS
            for tensor in op.outputs
            if tensor in outputs
        }
        read = {
            tensor
            for op in graph.operators
            for position, tensor in enumerate(op.inputs)
            if tensor in fragile or (position == 0 and op.code in ALIASING and tensor in outputs)
        }
        if self.every_read:
            read |= {tensor for op in graph.operators for tensor in op.inputs if tensor in outputs}
        return CopyPlan((), tuple(sorted(read)))

    def transform(self, graph: CircleGraph, plan: CopyPlan) -> PassResult:
        for tensor in plan.outputs:
            source = graph.tensors[tensor]
            shape = source.shape_signature or source.shape
            copy = graph.add_tensor(
                f"{source.name}_out",
                source.shape,
                source.dtype,
                shape_signature=source.shape_signature,
            )
            target = graph.add_tensor("shape", (len(shape),), np.int32, np.asarray(shape, np.int32))
            options = ReshapeOptionsT()
            options.newShape = [int(d) for d in shape]
            graph.add_op("RESHAPE", [tensor, target], [copy], options)
            graph.outputs[graph.outputs.index(tensor)] = copy
        return PassResult(bool(plan.outputs), {"copied": len(plan.outputs)})

    def verify(self, graph: CircleGraph) -> None:
        left = self.analyze(graph).outputs
        assert not left, f"graph output(s) {list(left)} still read in a way onert breaks"
