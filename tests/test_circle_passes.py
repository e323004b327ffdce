"""The Circle-level passes (fxopt.circle.passes): fuse-activations, merge-reshapes,
remove-dead-ops, copy-aliased-outputs — the six kinds of STYLE.md "Tests for every pass"
on hand-built graphs.

Parity builds the graph before and after the step, runs both Circle files in onert on the
same inputs and compares them (the runtime is the referee, not our own code).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from circle_schema.v0_10.circle.ActivationFunctionType import ActivationFunctionType as Act
from circle_schema.v0_10.circle.AddOptions import AddOptionsT
from circle_schema.v0_10.circle.ConcatenationOptions import ConcatenationOptionsT
from circle_schema.v0_10.circle.Conv2DOptions import Conv2DOptionsT
from circle_schema.v0_10.circle.DivOptions import DivOptionsT
from circle_schema.v0_10.circle.FullyConnectedOptions import FullyConnectedOptionsT
from circle_schema.v0_10.circle.GeluOptions import GeluOptionsT
from circle_schema.v0_10.circle.MulOptions import MulOptionsT
from circle_schema.v0_10.circle.Padding import Padding
from circle_schema.v0_10.circle.Pool2DOptions import Pool2DOptionsT
from circle_schema.v0_10.circle.ReshapeOptions import ReshapeOptionsT
from circle_schema.v0_10.circle.SubOptions import SubOptionsT

from fxopt.circle.build import build
from fxopt.circle.graph import CircleGraph, Quantization
from fxopt.circle.passes import (
    BroadcastPastReshapes,
    CopyAliasedOutputs,
    FoldAffine,
    FuseActivations,
    MergeConcatenations,
    MergeReshapes,
    RemoveDeadOps,
    ShareDuplicates,
    SkipReshapesIntoFC,
)
from fxopt.circle.runtime import Session, onert_available
from fxopt.errors import PassError
from fxopt.passes import PassManager, PassResult


def _run(pass_, stat: str, graph: CircleGraph) -> int:
    """Run one pass through the PassManager (invariants checked) in place; its count."""
    record = PassManager([pass_], copy=False).run(graph).records[0]
    return record.stats[stat]


def fuse_activations(graph: CircleGraph) -> int:
    return _run(FuseActivations(), "fused", graph)


def merge_reshapes(graph: CircleGraph) -> int:
    return _run(MergeReshapes(), "merged", graph)


def share_duplicates(graph: CircleGraph) -> int:
    return _run(ShareDuplicates(), "shared", graph)


def remove_dead_ops(graph: CircleGraph) -> int:
    return _run(RemoveDeadOps(), "removed", graph)


def copy_aliased_outputs(graph: CircleGraph) -> int:
    return _run(CopyAliasedOutputs(), "copied", graph)


def merge_concatenations(graph: CircleGraph) -> int:
    return _run(MergeConcatenations(), "merged", graph)


def fold_affine(graph: CircleGraph) -> int:
    return _run(FoldAffine(), "folded", graph)


def broadcast_past_reshapes(graph: CircleGraph) -> int:
    return _run(BroadcastPastReshapes(), "skipped", graph)


def residual_after_fc(shape=(1, 1, 4), residual=(1, 1, 4), code="ADD") -> CircleGraph:
    """x[1, 4] → FC → RESHAPE ``shape`` → ``code`` with an input of ``residual`` (a decode
    step's residual ADD after its output projection)."""
    g = CircleGraph()
    x, res = g.add_tensor("x", (1, 4), F32), g.add_tensor("res", residual, F32)
    hidden = g.add_tensor("hidden", (1, 4), F32)
    w, b = g.add_tensor("w", (4, 4), F32, _w(4, 4)), g.add_tensor("b", (4,), F32, _w(4))
    g.add_op("FULLY_CONNECTED", [x, w, b], [hidden], FullyConnectedOptionsT())
    reshaped = g.add_tensor("reshaped", shape, F32)
    o = ReshapeOptionsT()
    o.newShape = list(shape)
    target = g.add_tensor("shape", (len(shape),), np.int32, np.asarray(shape, np.int32))
    g.add_op("RESHAPE", [hidden, target], [reshaped], o)
    out_shape = tuple(np.broadcast_shapes(shape, residual))
    out = g.add_tensor("out", out_shape, F32)
    options = {"ADD": AddOptionsT, "MUL": MulOptionsT}[code]()
    g.add_op(code, [res, reshaped], [out], options)
    g.inputs, g.outputs = [x, res], [out]
    g.input_names, g.output_names = ["x", "res"], ["output_0"]
    return g


def skip_reshapes_into_fc(graph: CircleGraph) -> int:
    return _run(SkipReshapesIntoFC(), "skipped", graph)


def fc_reshape_gelu_fc(*, keep_last: bool = True, shared: bool = False) -> CircleGraph:
    """x[6, 4] → FC → RESHAPE [1, 2, 3, 5] (or [1, 3, 10] when not ``keep_last``) → GELU →
    FC → out (ConvNeXt's channels-last MLP); optionally the GELU result is an output too."""
    g = CircleGraph()
    x = g.add_tensor("x", (6, 4), F32)
    hidden = g.add_tensor("hidden", (6, 5), F32)
    w1, b1 = g.add_tensor("w1", (5, 4), F32, _w(5, 4)), g.add_tensor("b1", (5,), F32, _w(5))
    g.add_op("FULLY_CONNECTED", [x, w1, b1], [hidden], FullyConnectedOptionsT())
    shape = (1, 2, 3, 5) if keep_last else (1, 3, 10)
    reshaped = g.add_tensor("reshaped", shape, F32)
    o = ReshapeOptionsT()
    o.newShape = list(shape)
    target = g.add_tensor("shape", (len(shape),), np.int32, np.asarray(shape, np.int32))
    g.add_op("RESHAPE", [hidden, target], [reshaped], o)
    act = g.add_tensor("act", shape, F32)
    g.add_op("GELU", [reshaped], [act], GeluOptionsT())  # onert crashes on GELU without options
    k = shape[-1]
    w2, b2 = g.add_tensor("w2", (3, k), F32, _w(3, k)), g.add_tensor("b2", (3,), F32, _w(3))
    out = g.add_tensor("out", (30 // k, 3), F32)
    g.add_op("FULLY_CONNECTED", [act, w2, b2], [out], FullyConnectedOptionsT())
    g.inputs, g.outputs = [x], [out]
    g.input_names, g.output_names = ["x"], ["output_0"]
    if shared:
        g.outputs.append(act)
        g.output_names.append("output_1")
    return g


needs_onert = pytest.mark.skipif(not onert_available(), reason="onert is not installed")
F32 = np.float32
RNG = np.random.default_rng(0)


def _w(*shape):
    return RNG.standard_normal(shape).astype(F32)


def _pool_options():
    o = Pool2DOptionsT()
    o.padding, o.strideW, o.strideH, o.filterWidth, o.filterHeight = Padding.VALID, 2, 2, 2, 2
    return o


def _conv_options():
    o = Conv2DOptionsT()
    o.padding, o.strideW, o.strideH = Padding.SAME, 1, 1
    o.dilationWFactor = o.dilationHFactor = 1
    return o


def producer_then_act(producer: str, act: str) -> CircleGraph:
    """One fusible producer followed by one activation, the activation's output the output."""
    g = CircleGraph()
    if producer == "CONV_2D":
        x = g.add_tensor("x", (1, 5, 5, 2), F32)
        w, b = (
            g.add_tensor("w", (3, 3, 3, 2), F32, _w(3, 3, 3, 2)),
            g.add_tensor("b", (3,), F32, _w(3)),
        )
        mid = g.add_tensor("mid", (1, 5, 5, 3), F32)
        g.add_op("CONV_2D", [x, w, b], [mid], _conv_options())
        shape = (1, 5, 5, 3)
    elif producer == "MAX_POOL_2D":
        x = g.add_tensor("x", (1, 4, 4, 3), F32)
        mid = g.add_tensor("mid", (1, 2, 2, 3), F32)
        g.add_op("MAX_POOL_2D", [x], [mid], _pool_options())
        shape = (1, 2, 2, 3)
    elif producer == "FULLY_CONNECTED":
        x = g.add_tensor("x", (2, 4), F32)
        w, b = g.add_tensor("w", (3, 4), F32, _w(3, 4)), g.add_tensor("b", (3,), F32, _w(3))
        mid = g.add_tensor("mid", (2, 3), F32)
        g.add_op("FULLY_CONNECTED", [x, w, b], [mid], FullyConnectedOptionsT())
        shape = (2, 3)
    else:
        options = {"ADD": AddOptionsT, "SUB": SubOptionsT, "MUL": MulOptionsT, "DIV": DivOptionsT}
        x = g.add_tensor("x", (2, 3), F32)
        c = g.add_tensor("c", (3,), F32, np.asarray([1.5, -2.0, 0.75], F32))
        mid = g.add_tensor("mid", (2, 3), F32)
        g.add_op(producer, [x, c], [mid], options[producer]())
        shape = (2, 3)
    out = g.add_tensor("out", shape, F32)
    g.add_op(act, [mid], [out])
    g.inputs, g.outputs = [x], [out]
    g.input_names, g.output_names = ["x"], ["output_0"]
    return g


def reshape_chain(length: int, *, middle_also_read: bool = False) -> CircleGraph:
    """x[2,6] → RESHAPE ×length (shapes cycling) → RELU → out; optionally the first
    RESHAPE's output is also a second output."""
    shapes = [(3, 4), (12,), (4, 3), (2, 6)]
    g = CircleGraph()
    x = g.add_tensor("x", (2, 6), F32)
    current, first = x, None
    for i in range(length):
        shape = shapes[i % len(shapes)]
        out = g.add_tensor(f"r{i}", shape, F32)
        o = ReshapeOptionsT()
        o.newShape = list(shape)
        g.add_op(
            "RESHAPE",
            [current, g.add_tensor("s", (len(shape),), np.int32, np.asarray(shape, np.int32))],
            [out],
            o,
        )
        first = out if first is None else first
        current = out
    result = g.add_tensor("out", g.tensors[current].shape, F32)
    g.add_op("RELU", [current], [result])
    g.inputs, g.outputs = [x], [result]
    g.input_names, g.output_names = ["x"], ["output_0"]
    if middle_also_read:
        copy_out = g.add_tensor("first_copy", g.tensors[first].shape, F32)
        g.add_op("RELU", [first], [copy_out])
        g.outputs.append(copy_out)
        g.output_names.append("output_1")
    return g


def with_dead_chain(depth: int) -> CircleGraph:
    """x → RELU → out, plus ``depth`` operators in a chain from x that nothing reads."""
    g = CircleGraph()
    x = g.add_tensor("x", (2, 3), F32)
    out = g.add_tensor("out", (2, 3), F32)
    g.add_op("RELU", [x], [out])
    current = x
    for i in range(depth):
        dead = g.add_tensor(f"dead{i}", (2, 3), F32)
        g.add_op("TANH" if i % 2 else "LOGISTIC", [current], [dead])
        current = dead
    g.inputs, g.outputs = [x], [out]
    g.input_names, g.output_names = ["x"], ["output_0"]
    return g


def concat_chain(depth: int, *, inner_axis: int = 1, inner_also_read: bool = False):
    """x0[2, 3] → ``depth`` CONCATENATIONs, each with a new input (the first on
    ``inner_axis``, the rest on axis 1) → RELU; optionally the first result is also an
    output."""
    g = CircleGraph()
    current = g.add_tensor("x0", (2, 3), F32)
    inputs, first = [current], None
    for i in range(depth):
        axis = inner_axis if i == 0 else 1
        other_shape = list(g.tensors[current].shape)
        other_shape[axis] = 3
        other = g.add_tensor(f"x{i + 1}", tuple(other_shape), F32)
        shape = list(g.tensors[current].shape)
        shape[axis] += 3
        out = g.add_tensor(f"cat{i}", tuple(shape), F32)
        o = ConcatenationOptionsT()
        o.axis = axis
        g.add_op("CONCATENATION", [current, other], [out], o)
        inputs.append(other)
        first = out if first is None else first
        current = out
    result = g.add_tensor("out", g.tensors[current].shape, F32)
    g.add_op("RELU", [current], [result])
    g.inputs, g.outputs = inputs, [result]
    g.input_names = [g.tensors[i].name for i in inputs]
    g.output_names = ["output_0"]
    if inner_also_read:
        g.outputs.append(first)
        g.output_names.append("output_1")
    return g


def scale_before_fcs(readers: tuple[str, ...] = ("FULLY_CONNECTED", "FULLY_CONNECTED")):
    """x → MUL(s) read by each of ``readers`` (an RMSNorm's weight before q, k and v);
    every reader's result is an output."""
    g = CircleGraph()
    x = g.add_tensor("x", (2, 5, 3), F32)
    s = g.add_tensor("s", (3,), F32, (RNG.random(3) + 0.5).astype(F32))
    scaled = g.add_tensor("scaled", (2, 5, 3), F32)
    g.add_op("MUL", [x, s], [scaled], MulOptionsT())
    outs = []
    for i, code in enumerate(readers):
        if code == "FULLY_CONNECTED":
            w, b = (
                g.add_tensor(f"w{i}", (4, 3), F32, _w(4, 3)),
                g.add_tensor(f"b{i}", (4,), F32, _w(4)),
            )
            out = g.add_tensor(f"out{i}", (10, 4), F32)
            g.add_op(code, [scaled, w, b], [out], FullyConnectedOptionsT())
        else:
            out = g.add_tensor(f"out{i}", (2, 5, 3), F32)
            g.add_op(code, [scaled], [out])
        outs.append(out)
    g.inputs, g.outputs = [x], outs
    g.input_names, g.output_names = ["x"], [f"output_{i}" for i in range(len(outs))]
    return g


def affine_around(
    target: str = "FULLY_CONNECTED",
    *,
    after: bool = False,
    padded: bool = False,
    shared: bool = False,
    spatial_scale: bool = False,
) -> CircleGraph:
    """x → MUL(s) → ADD(t) → ``target`` (FC or CONV_2D, constant weights) [→ RESHAPE →
    MUL(γ) when ``after``]. Near misses: a SAME-padded conv, the ADD also an output, a
    scale that varies along a non-channel axis."""
    g = CircleGraph()
    conv = target == "CONV_2D"
    shape = (1, 4, 4, 3) if conv else (2, 5, 3)
    x = g.add_tensor("x", shape, F32)
    scale_shape = (4, 1, 3) if spatial_scale and conv else (3,)
    s = g.add_tensor("s", scale_shape, F32, (RNG.random(scale_shape) + 0.5).astype(F32))
    t = g.add_tensor("t", (3,), F32, _w(3))
    scaled, shifted = g.add_tensor("scaled", shape, F32), g.add_tensor("shifted", shape, F32)
    g.add_op("MUL", [x, s], [scaled], MulOptionsT())
    g.add_op("ADD", [scaled, t], [shifted], AddOptionsT())
    if conv:
        o = _conv_options()
        o.padding = Padding.SAME if padded else Padding.VALID
        out_shape = (1, 4, 4, 2) if padded else (1, 2, 2, 2)
        w, b = (
            g.add_tensor("w", (2, 3, 3, 3), F32, _w(2, 3, 3, 3)),
            g.add_tensor("b", (2,), F32, _w(2)),
        )
        out = g.add_tensor("out", out_shape, F32)
        g.add_op("CONV_2D", [shifted, w, b], [out], o)
    else:
        w, b = g.add_tensor("w", (4, 3), F32, _w(4, 3)), g.add_tensor("b", (4,), F32, _w(4))
        out = g.add_tensor("out", (10, 4), F32)
        g.add_op("FULLY_CONNECTED", [shifted, w, b], [out], FullyConnectedOptionsT())
    if after:
        reshaped = g.add_tensor("reshaped", (2, 5, 4), F32)
        o = ReshapeOptionsT()
        o.newShape = [2, 5, 4]
        shape_t = g.add_tensor("shape", (3,), np.int32, np.asarray([2, 5, 4], np.int32))
        g.add_op("RESHAPE", [out, shape_t], [reshaped], o)
        gamma = g.add_tensor("gamma", (4,), F32, (RNG.random(4) + 0.5).astype(F32))
        out = g.add_tensor("scaled_out", (2, 5, 4), F32)
        g.add_op("MUL", [gamma, reshaped], [out], MulOptionsT())
    g.inputs, g.outputs = [x], [out]
    g.input_names, g.output_names = ["x"], ["output_0"]
    if shared:
        g.outputs.append(shifted)
        g.output_names.append("output_1")
    return g


def output_also_reshaped(reader: str = "RESHAPE") -> CircleGraph:
    """x → RELU → y (output 0) → ``reader`` → ADD 1 → output 1: the pattern onert 0.1.0
    computes wrong when ``reader`` is a RESHAPE."""
    g = CircleGraph()
    x = g.add_tensor("x", (3, 4), F32)
    y = g.add_tensor("y", (3, 4), F32)
    g.add_op("RELU", [x], [y])
    read = g.add_tensor("read", (2, 6) if reader == "RESHAPE" else (3, 4), F32)
    if reader == "RESHAPE":
        o = ReshapeOptionsT()
        o.newShape = [2, 6]
        shape = g.add_tensor("s", (2,), np.int32, np.asarray([2, 6], np.int32))
        g.add_op("RESHAPE", [y, shape], [read], o)
    else:
        g.add_op(reader, [y], [read])
    out = g.add_tensor("out", g.tensors[read].shape, F32)
    one = g.add_tensor("one", (1,), F32, np.ones(1, F32))
    g.add_op("ADD", [read, one], [out], AddOptionsT())
    g.inputs, g.outputs = [x], [y, out]
    g.input_names, g.output_names = ["x"], ["output_0", "output_1"]
    return g


def run(graph: CircleGraph, inputs: list[np.ndarray]) -> list[np.ndarray]:
    with Session(build(graph)) as session:
        return session.run(inputs)


def inputs_for(graph: CircleGraph) -> list[np.ndarray]:
    return [(RNG.standard_normal(graph.tensors[i].shape) * 3).astype(F32) for i in graph.inputs]


FUSIBLE = ["CONV_2D", "FULLY_CONNECTED", "ADD", "SUB", "MUL", "DIV", "MAX_POOL_2D"]
ACTS = {"RELU": Act.RELU, "RELU6": Act.RELU6, "RELU_N1_TO_1": Act.RELU_N1_TO_1}


# --- 1. positive, parametrized ------------------------------------------------------------
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("producer", FUSIBLE)
def test_fuse_activations_folds_the_activation_into_its_producer(producer, act):
    g = producer_then_act(producer, act)
    assert fuse_activations(g) == 1
    assert [op.code for op in g.operators] == [producer]
    assert g.operators[0].options.fusedActivationFunction == ACTS[act]
    assert g.operators[0].outputs == g.outputs


@pytest.mark.parametrize("length", [2, 3])
def test_merge_reshapes_reads_the_chain_input(length):
    g = reshape_chain(length)
    x = g.inputs[0]
    assert merge_reshapes(g) == length - 1
    reshapes = [op for op in g.operators if op.code == "RESHAPE"]
    assert all(op.inputs[0] == x for op in reshapes)
    assert remove_dead_ops(g) == 0  # merge-reshapes erased the reshapes it reads past
    assert g.op_counts() == {"RESHAPE": 1, "RELU": 1}


def test_merge_reshapes_bypasses_a_chain_back_to_its_input_shape():
    g = reshape_chain(4)  # [2, 6] → [3, 4] → [12] → [4, 3] → [2, 6]: the identity
    result = MergeReshapes()(g)
    # The last RESHAPE is bypassed (seen through the two merged before it), not merged.
    assert result.stats == {"merged": 2, "bypassed": 1}
    assert g.operators[-1].inputs == [g.inputs[0]]  # the RELU reads x itself
    assert remove_dead_ops(g) == 0 and g.op_counts() == {"RELU": 1}
    assert not MergeReshapes()(g).changed  # idempotent
    # near misses: the same shape with other quantization parameters, or a graph output
    for change in ("quantization", "output"):
        g = reshape_chain(4)
        last = g.operators[-2].outputs[0]
        if change == "quantization":
            for index in (g.inputs[0], last):
                scale = 0.1 if index == last else 0.2
                g.tensors[index].quantization = Quantization((scale,), (0,))
        else:
            g.outputs.append(last)
        assert MergeReshapes()(g).stats["bypassed"] == 0, change


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_remove_dead_ops_removes_whole_dead_chains(depth):
    g = with_dead_chain(depth)
    assert remove_dead_ops(g) == depth
    assert g.op_counts() == {"RELU": 1}


# --- 2. near misses: one per guard --------------------------------------------------------
def _fc_relu() -> CircleGraph:
    return producer_then_act("FULLY_CONNECTED", "RELU")


def _on_graph_input(g):  # producer is None
    g.operators = [g.operators[1]]
    g.operators[0].inputs = [g.inputs[0]]


def _not_fusible(g):  # producer's code is not in the fusible set
    g.operators[0].code = "BATCH_MATMUL"


def _read_twice(g):  # the producer output has a second reader
    extra = g.add_tensor("extra", (2, 3), F32)
    g.add_op("TANH", [g.operators[0].outputs[0]], [extra])
    g.outputs.append(extra)
    g.output_names.append("output_1")


def _is_graph_output(g):  # fusing would change that output
    g.outputs.append(g.operators[0].outputs[0])
    g.output_names.append("output_1")


def _already_fused(g):
    g.operators[0].options.fusedActivationFunction = Act.RELU6


def _dtype_changes(g):
    g.tensors[g.operators[1].outputs[0]].dtype = np.dtype(np.float16)


def _activation_not_fusible(g):  # TANH: legal in the schema, fails in onert 0.1.0
    g.operators[1].code = "TANH"


FUSE_NEAR_MISSES = {
    f.__name__.lstrip("_"): f
    for f in (
        _on_graph_input,
        _not_fusible,
        _read_twice,
        _is_graph_output,
        _already_fused,
        _dtype_changes,
        _activation_not_fusible,
    )
}


# What --explain says for each near miss (None: not a candidate, so no reason is owed).
FUSE_REASONS = {
    "on_graph_input": "graph input or a constant",
    "not_fusible": "BATCH_MATMUL has no fused activation",
    "read_twice": "is also read by TANH",
    "is_graph_output": "inside the match is returned",
    "already_fused": "already has a fused activation",
    "dtype_changes": "dtypes differ",
    "activation_not_fusible": None,
}


@pytest.mark.parametrize("case", sorted(FUSE_NEAR_MISSES))
def test_fuse_activations_near_miss_changes_nothing_and_says_why(case):
    g = _fc_relu()
    FUSE_NEAR_MISSES[case](g)
    before = g.format()
    result = PassManager([FuseActivations()], copy=False).run(g)
    assert result.records[0].stats["fused"] == 0
    assert g.format() == before
    reasons = [skip.reason for skip in result.skipped]
    if FUSE_REASONS[case] is None:
        assert reasons == []
    else:
        assert len(reasons) == 1 and FUSE_REASONS[case] in reasons[0], reasons


def test_a_pass_that_breaks_the_circle_graph_is_named():
    g = _fc_relu()
    with pytest.raises(PassError, match=r"pass 'dropper'.*well-formed.*not computed before"):
        PassManager([_Dropper()], name="circle").run(g)
    assert len(g.operators) == 2  # the manager worked on a copy


class _Dropper(RemoveDeadOps):
    """Removes the first operator: the activation then reads a tensor nobody computes."""

    name = "dropper"

    def transform(self, graph, plan):
        graph.operators.pop(0)
        return PassResult(True)


def test_the_manager_refuses_the_wrong_kind_of_graph():
    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    with pytest.raises(PassError, match=r"takes a circle graph \(CircleGraph\), got ReLU"):
        PassManager([RemoveDeadOps()]).run(gm)
    with pytest.raises(ValueError, match="one kind of graph"):
        PassManager([RemoveDeadOps(), "cse"])


def test_merge_reshapes_near_misses_change_nothing():
    # a RESHAPE of a graph input, and a RESHAPE of a non-RESHAPE (RELU)
    g = reshape_chain(1)
    relu_out = g.outputs[0]
    again = g.add_tensor("again", (12,), F32)
    o = ReshapeOptionsT()
    o.newShape = [12]
    g.add_op(
        "RESHAPE",
        [relu_out, g.add_tensor("s", (1,), np.int32, np.asarray([12], np.int32))],
        [again],
        o,
    )
    g.outputs = [again]
    before = g.format()
    assert merge_reshapes(g) == 0
    assert g.format() == before


def same_reshape_twice(*, other_shape: bool = False, output: bool = False) -> CircleGraph:
    """x[2,6] → RESHAPE [3,4] twice (each with its own shape constant) → ADD → out;
    optionally the second reshape targets [4,3] (not a duplicate) or is a graph output."""
    g = CircleGraph()
    x = g.add_tensor("x", (2, 6), F32)
    outs = []
    for i, shape in enumerate([(3, 4), (4, 3) if other_shape else (3, 4)]):
        out = g.add_tensor(f"r{i}", shape, F32)
        o = ReshapeOptionsT()
        o.newShape = list(shape)
        const = g.add_tensor("s", (2,), np.int32, np.asarray(shape, np.int32))
        g.add_op("RESHAPE", [x, const], [out], o)
        outs.append(out)
    result = g.add_tensor("out", (3, 4), F32)
    second = outs[1]
    if other_shape:  # bring [4, 3] back to [3, 4] so the ADD still type-checks
        second = g.add_tensor("back", (3, 4), F32)
        o = ReshapeOptionsT()
        o.newShape = [3, 4]
        const = g.add_tensor("s", (2,), np.int32, np.asarray([3, 4], np.int32))
        g.add_op("RESHAPE", [outs[1], const], [second], o)
    g.add_op("ADD", [outs[0], second], [result], AddOptionsT())
    g.inputs, g.outputs = [x], [result]
    g.input_names, g.output_names = ["x"], ["output_0"]
    if output:
        g.outputs.append(outs[1])
        g.output_names.append("output_1")
    return g


def test_share_duplicates_reads_the_first_of_two_equal_reshapes():
    g = same_reshape_twice()
    assert share_duplicates(g) == 1
    add = g.operators[-1]
    assert add.inputs[0] == add.inputs[1] == g.operators[0].outputs[0]
    assert remove_dead_ops(g) == 1 and g.op_counts() == {"RESHAPE": 1, "ADD": 1}
    assert not ShareDuplicates()(g).changed  # idempotent


@pytest.mark.parametrize("variant", ["other_shape", "output"])
def test_share_duplicates_near_misses_change_nothing(variant):
    g = same_reshape_twice(**{variant: True})
    before = g.format()
    assert share_duplicates(g) == 0
    assert g.format() == before


def test_share_duplicates_keeps_outputs_of_another_quantization():
    g = same_reshape_twice()
    for i, scale in ((1, 0.1), (2, 0.2)):  # r0, r1: same shape, other parameters
        g.tensors[i + 1].quantization = Quantization((scale,), (0,))
    assert share_duplicates(g) == 0


def test_merge_reshapes_keeps_a_middle_reshape_that_is_still_read():
    g = reshape_chain(2, middle_also_read=True)
    assert merge_reshapes(g) == 1
    assert remove_dead_ops(g) == 0  # the first RESHAPE still feeds output_1
    assert g.op_counts() == {"RESHAPE": 2, "RELU": 2}


def test_remove_dead_ops_keeps_ops_that_feed_outputs_or_live_ops():
    g = reshape_chain(3)
    before = g.format()
    assert remove_dead_ops(g) == 0
    assert g.format() == before


# --- 3. numerical parity in onert -----------------------------------------------------------
PARITY = {
    **{f"fuse_{p}_{a}": (lambda p=p, a=a: producer_then_act(p, a)) for p in FUSIBLE for a in ACTS},
    "merge_reshapes_3": lambda: reshape_chain(3),
    "merge_reshapes_identity": lambda: reshape_chain(4),
    "share_duplicate_reshapes": same_reshape_twice,
    "merge_reshapes_shared": lambda: reshape_chain(2, middle_also_read=True),
    "remove_dead_ops": lambda: with_dead_chain(3),
    "concat_chain_4": lambda: concat_chain(4),
    "affine_fc": lambda: affine_around(),
    "affine_fc_layer_scale": lambda: affine_around(after=True),
    "affine_conv_valid": lambda: affine_around("CONV_2D"),
    "affine_scale_before_three_fcs": lambda: scale_before_fcs(("FULLY_CONNECTED",) * 3),
    "skip_fc_reshape_gelu_fc": fc_reshape_gelu_fc,
    "broadcast_residual_add": residual_after_fc,
    "broadcast_gate_mul": lambda: residual_after_fc(code="MUL"),
}
STEP_OF = {
    "fuse": fuse_activations,
    "merge": merge_reshapes,
    "remove": remove_dead_ops,
    "concat": merge_concatenations,
    "affine": fold_affine,
    "skip": skip_reshapes_into_fc,
    "share": share_duplicates,
    "broadcast": broadcast_past_reshapes,
}


@needs_onert
@pytest.mark.parametrize("case", sorted(PARITY))
def test_step_preserves_outputs_in_onert(case):
    g = PARITY[case]()
    inputs = inputs_for(g)
    if case.endswith("RELU_N1_TO_1"):
        # onert 0.1.0 has no standalone RELU_N1_TO_1 kernel (only the fused form): the
        # reference is the producer alone in onert, clipped to [-1, 1].
        alone = copy.deepcopy(g)
        alone.operators.pop()
        alone.outputs = alone.operators[-1].outputs
        expected = [np.clip(o, -1, 1) for o in run(alone, inputs)]
    else:
        expected = run(g, inputs)
    step = STEP_OF[case.split("_")[0]]
    assert step(g) > 0
    remove_dead_ops(g)
    got = run(g, inputs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@needs_onert
def test_copy_aliased_outputs_makes_onert_compute_the_output_right():
    g = output_also_reshaped()
    x = inputs_for(g)
    y = np.maximum(x[0], 0)
    before = run(g, x)
    # The runtime defect the pass exists for (if onert fixes it, this says so):
    assert not np.allclose(before[0], y)
    assert copy_aliased_outputs(g) == 1
    got = run(g, x)
    np.testing.assert_array_equal(got[0], y)
    np.testing.assert_array_equal(got[1], y.reshape(2, 6) + 1)
    assert [op.code for op in g.operators][-1] == "RESHAPE"


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: concat_chain(2, inner_axis=0), None),
        (lambda: concat_chain(2, inner_also_read=True), "its result is read elsewhere too"),
    ],
)
def test_merge_concatenations_near_misses_change_nothing(make, reason):
    g = make()
    before = g.format()
    result = PassManager([MergeConcatenations()], copy=False).run(g)
    assert result.records[0].stats["merged"] == 0
    assert g.format() == before
    if reason:
        assert [s.reason for s in result.skipped] == [f"not merged: {reason}"]


@pytest.mark.parametrize(
    "make, stays",
    [
        (lambda: affine_around("CONV_2D", padded=True), "ADD"),  # zero padding is not t
        (lambda: affine_around(shared=True), "ADD"),  # the ADD's result is read elsewhere
        (lambda: affine_around("CONV_2D", spatial_scale=True), "MUL"),  # varies along H
        (lambda: scale_before_fcs(("FULLY_CONNECTED", "RELU")), "MUL"),  # a reader is no FC
    ],
)
def test_fold_affine_near_misses_keep_the_op_that_cannot_fold(make, stays):
    g = make()
    fold_affine(g)
    assert stays in [op.code for op in g.operators]


@pytest.mark.parametrize("options", [{"keep_last": False}, {"shared": True}])
def test_skip_reshapes_into_fc_near_misses_change_nothing(options):
    g = fc_reshape_gelu_fc(**options)  # the last dim changes / the GELU result is read too
    before = g.format()
    assert skip_reshapes_into_fc(g) == 0
    assert g.format() == before


@pytest.mark.parametrize(
    "shape, residual",
    [
        ((2, 2), (2, 2)),  # not leading 1s: [1, 4] → [2, 2] moves the values
        ((1, 1, 4), (1, 3, 4)),  # [1, 4] against [1, 3, 4]: broadcasts the same, so it goes
        ((1, 1, 1, 4), (1, 4)),  # the result would lose the leading 1s it must have
    ],
)
def test_broadcast_past_reshapes_only_where_the_result_is_the_same(shape, residual):
    g = residual_after_fc(shape, residual)
    count = broadcast_past_reshapes(g)
    expected = 1 if (shape, residual) == ((1, 1, 4), (1, 3, 4)) else 0
    assert count == expected
    assert g.tensors[g.operators[-1].outputs[0]].shape == tuple(
        np.broadcast_shapes(shape, residual)
    )


def test_copy_aliased_outputs_leaves_outputs_no_reshape_reads():
    g = output_also_reshaped(reader="RELU")
    before = g.format()
    assert copy_aliased_outputs(g) == 0
    assert g.format() == before


# --- 4. idempotence and 5. honest changed flag ----------------------------------------------
STEPS = {
    "copy-aliased-outputs": (copy_aliased_outputs, output_also_reshaped),
    "merge-concatenations": (merge_concatenations, lambda: concat_chain(3)),
    "fold-affine": (fold_affine, lambda: affine_around(after=True)),
    "skip-reshapes-into-fc": (skip_reshapes_into_fc, fc_reshape_gelu_fc),
    "broadcast-past-reshapes": (broadcast_past_reshapes, residual_after_fc),
    "fuse-activations": (fuse_activations, _fc_relu),
    "merge-reshapes": (merge_reshapes, lambda: reshape_chain(3)),
    "remove-dead-ops": (remove_dead_ops, lambda: with_dead_chain(2)),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_second_run_changes_nothing_and_says_so(name):
    step, make = STEPS[name]
    g = make()
    assert step(g) > 0
    after = g.format()
    assert step(g) == 0
    assert g.format() == after


@pytest.mark.parametrize("name", sorted(STEPS))
def test_changed_count_matches_what_changed(name):
    step, make = STEPS[name]
    g = make()
    before = copy.deepcopy(g)
    count = step(g)
    if name == "merge-reshapes":
        rewired = sum(a.inputs != b.inputs for a, b in zip(before.operators, g.operators))
        assert count == rewired == 2
    elif name == "skip-reshapes-into-fc":  # the GELU reads the first FC; the RESHAPE goes
        (gelu,) = [op for op in g.operators if op.code == "GELU"]
        assert count == 1 and gelu.inputs[0] == before.operators[0].outputs[0]
        assert "RESHAPE" not in g.op_counts()
    elif name == "broadcast-past-reshapes":  # the ADD reads the FC's [1, 4] itself
        assert count == 1 and g.operators[-1].inputs[1] == before.operators[0].outputs[0]
    elif name == "fold-affine":  # MUL, ADD before and the layer-scale MUL after: gone
        assert count == 3
        assert [op.code for op in g.operators] == ["FULLY_CONNECTED", "RESHAPE"]
    elif name == "merge-concatenations":  # the outer two read their inner one's inputs
        rewired = sum(a.inputs != b.inputs for a, b in zip(before.operators, g.operators))
        assert count == rewired == 2
        assert len(g.operators[2].inputs) == 4
    elif name == "copy-aliased-outputs":
        assert count == len(g.operators) - len(before.operators) == 1
        assert g.outputs[1:] == before.outputs[1:] and g.outputs[0] != before.outputs[0]
    else:
        assert count == len(before.operators) - len(g.operators) > 0


# --- 6. golden printed graph ------------------------------------------------------------
def test_golden_fc_relu_reshape_chain_after_all_steps():
    g = producer_then_act("FULLY_CONNECTED", "RELU6")
    first = g.add_tensor("r1", (3, 2), F32)
    second = g.add_tensor("r2", (6,), F32)
    for src, dst, shape in ((g.outputs[0], first, (3, 2)), (first, second, (6,))):
        o = ReshapeOptionsT()
        o.newShape = list(shape)
        g.add_op(
            "RESHAPE",
            [src, g.add_tensor("s", (len(shape),), np.int32, np.asarray(shape, np.int32))],
            [dst],
            o,
        )
    g.outputs = [second]
    # (merge-reshapes erases the RESHAPE it reads past: remove-dead-ops finds nothing)
    assert (fuse_activations(g), merge_reshapes(g), remove_dead_ops(g)) == (1, 1, 0)
    assert g.format() == (
        "inputs: t0 float32[2, 4]\n"
        "t4 float32[2, 3] = FULLY_CONNECTED(t0, const float32[3, 4], const float32[3])"
        " fused=RELU6\n"
        "t6 float32[6] = RESHAPE(t4, const int32[1])\n"
        "outputs: t6"
    )


GOLDEN = {
    "fold-affine": (
        lambda: affine_around(after=True),
        fold_affine,
        "inputs: t0 float32[2, 5, 3]\n"
        "t7 float32[10, 4] = FULLY_CONNECTED(t0, const float32[4, 3], const float32[4])\n"
        "t8 float32[2, 5, 4] = RESHAPE(t7, const int32[3])\n"
        "outputs: t8",
    ),
    "skip-reshapes-into-fc": (
        fc_reshape_gelu_fc,
        skip_reshapes_into_fc,
        "inputs: t0 float32[6, 4]\n"
        "t1 float32[6, 5] = FULLY_CONNECTED(t0, const float32[5, 4], const float32[5])\n"
        "t10 float32[6, 5] = GELU(t1)\n"
        "t9 float32[6, 3] = FULLY_CONNECTED(t10, const float32[3, 5], const float32[3])\n"
        "outputs: t9",
    ),
    "merge-concatenations": (
        lambda: concat_chain(3),
        merge_concatenations,
        "inputs: t0 float32[2, 3], t1 float32[2, 3], t3 float32[2, 3], t5 float32[2, 3]\n"
        "t6 float32[2, 12] = CONCATENATION(t0, t1, t3, t5)\n"
        "t7 float32[2, 12] = RELU(t6)\n"
        "outputs: t7",
    ),
    "copy-aliased-outputs": (
        output_also_reshaped,
        copy_aliased_outputs,
        "inputs: t0 float32[3, 4]\n"
        "t1 float32[3, 4] = RELU(t0)\n"
        "t2 float32[2, 6] = RESHAPE(t1, const int32[2])\n"
        "t4 float32[2, 6] = ADD(t2, const float32[1])\n"
        "t6 float32[3, 4] = RESHAPE(t1, const int32[2])\n"
        "outputs: t6, t4",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_graph_after_pass(name):
    make, step, expected = GOLDEN[name]
    g = make()
    assert step(g) > 0
    remove_dead_ops(g)
    assert g.format() == expected


def _gathers_of(first: np.ndarray, second: np.ndarray, keys=(None, None)) -> CircleGraph:
    """Two GATHERs of the same ids from two constant tables, added."""
    g = CircleGraph()
    ids = g.add_tensor("ids", (3,), np.int32)
    outs = []
    for name, table, key in zip("ab", (first, second), keys):
        weights = g.add_tensor(name, table.shape, table.dtype, table, buffer_key=key)
        out = g.add_tensor(f"{name}_out", (3, table.shape[1]), F32)
        g.add_op("GATHER", [weights, ids], [out])
        outs.append(out)
    result = g.add_tensor("out", (3, first.shape[1]), F32)
    g.add_op("ADD", outs, [result], AddOptionsT())
    g.inputs, g.outputs = [ids], [result]
    g.input_names, g.output_names = ["ids"], ["output_0"]
    return g


def test_share_duplicates_compares_large_constants_by_storage_not_bytes():
    # A table read twice through one storage is shared; two equal tables that are not the
    # same storage are left alone (comparing a weight's bytes would copy it).
    table = np.random.default_rng(0).standard_normal((2048, 8)).astype(np.float32)
    same = _gathers_of(table, table, keys=("w", "w"))
    assert share_duplicates(same) == 1
    twins = _gathers_of(table, table.copy())
    assert share_duplicates(twins) == 0
    small = np.ones((4, 8), np.float32)  # small constants are compared by value
    assert share_duplicates(_gathers_of(small, small.copy())) == 1


def test_fold_affine_scales_in_the_weights_dtype_as_float64_would_round():
    from fxopt.circle.passes.fold_affine import _row_sums, _scaled

    rng = np.random.default_rng(1)
    weight = rng.standard_normal((300, 7, 5)).astype(np.float32)
    vector = rng.standard_normal(5).astype(np.float32)
    exact = (weight.astype(np.float64) * vector.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(_scaled(weight, vector), exact)  # rounded once either way
    sums = (weight.astype(np.float64) * vector).reshape(300, -1).sum(1)
    np.testing.assert_allclose(_row_sums(weight, vector.astype(np.float64)), sums, rtol=1e-12)
    wide = rng.standard_normal((5, 3000, 100)).astype(np.float32)  # rows summed in blocks
    vector = rng.standard_normal(100)
    sums = (wide.astype(np.float64) * vector).reshape(5, -1).sum(1)
    np.testing.assert_allclose(_row_sums(wide, vector), sums, rtol=1e-12)
