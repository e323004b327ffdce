"""Shared helpers for the tests of the graph passes (cse, dce) and of the IR they rely on.

* small wrappers that turn a function into a capturable module (:class:`Fn`, :class:`Fn2`);
* :func:`capture` (both capture levels), :func:`run_passes`, :func:`names`, :func:`count`;
* :func:`assert_same_effects`: outputs, inputs written in place and buffers agree exactly,
  both programs run under the same seed;
* :func:`assert_kept_analysis_sound`: an alias analysis a pass kept allows no more than a
  fresh one;
* :func:`random_graphs`: a hypothesis strategy of random fx graphs mixing pure, random,
  in-place and view ops, with duplicates made likely.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import fx, nn

from fxopt.capture import trace
from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.ir.copying import clone_module
from fxopt.passes import PassManager, PipelineResult
from fxopt.verify import run_seeded

MODES = ("fx", "export")


class Fn(nn.Module):
    """``forward(x) = fn(x)``: a plain function as a module both capture modes can trace."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Fn2(Fn):
    """``forward(x, y) = fn(x, y)``."""

    def forward(self, x, y):
        return self.fn(x, y)


def module_for(fn: Callable, arity: int) -> nn.Module:
    return Fn(fn) if arity == 1 else Fn2(fn)


def capture(model: nn.Module, inputs: Sequence, mode: str) -> fx.GraphModule:
    return trace(model, tuple(inputs), mode=mode)


def run_passes(gm: fx.GraphModule, *passes: str) -> PipelineResult:
    """Run ``passes`` once each through the PassManager (lint, invariants, verify)."""
    return PassManager(list(passes)).run(gm)


def stats(result: PipelineResult, name: str) -> dict:
    (record,) = [r for r in result.records if r.name == name]
    return record.stats


def unguarded(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of an optimized module without its input guard: the graph the passes made."""
    from fxopt.ir import contract

    return contract.remove(clone_module(gm))


def names(gm: fx.GraphModule) -> list[str]:
    """Canonical names of every node, in graph order (robust to torch's printing)."""
    return [ops.info(n, gm).name for n in gm.graph.nodes]


def count(gm: fx.GraphModule, name: str) -> int:
    return sum(1 for _ in ops.calls(gm, name))


def guarded_nodes(gm: fx.GraphModule) -> Counter:
    """Names of the nodes no pass may merge or remove: random, in-place, impure, stateful."""
    found: Counter = Counter()
    for node in gm.graph.nodes:
        if not ops.is_compute(node):
            continue
        op = ops.info(node, gm)
        if op.random or op.inplace or op.stateful or not op.removable:
            found[node.name] += 1
    return found


def compute_count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if ops.is_compute(n))


def _fresh(inputs: Sequence) -> list:
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]


def run_effects(module: nn.Module, inputs: Sequence, seed: int = 0):
    """Outputs, the inputs after the call (in-place writes) and the buffers after the call."""
    module = clone_module(module)
    args = _fresh(inputs)
    with torch.no_grad():
        out = run_seeded(module, args, seed)
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    return out, args, buffers


def assert_same_effects(reference: nn.Module, candidate: nn.Module, inputs: Sequence) -> None:
    """Both programs, run under one seed, give bit-identical outputs, input writes and
    buffer updates (cse and dce never change arithmetic, so exact equality is expected)."""
    out_a, in_a, buf_a = run_effects(reference, inputs)
    out_b, in_b, buf_b = run_effects(candidate, inputs)
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(out_b, out_a, **exact, msg=lambda m: f"outputs differ: {m}")
    torch.testing.assert_close(in_b, in_a, **exact, msg=lambda m: f"input writes differ: {m}")
    shared = sorted(set(buf_a) & set(buf_b))
    assert shared == sorted(buf_a), f"buffers lost: {sorted(set(buf_a) - set(buf_b))}"
    for key in shared:
        torch.testing.assert_close(
            buf_b[key], buf_a[key], **exact, msg=lambda m, k=key: f"buffer {k} differs: {m}"
        )


def assert_kept_analysis_sound(kept: AliasAnalysis, gm: fx.GraphModule, *, exact: bool):
    """``kept`` (an analysis a pass updated or kept across its change) allows no more than
    a fresh analysis of ``gm``: every fresh storage class lies inside one kept class and
    every write a fresh analysis sees, the kept one sees too. ``exact``: and no less."""
    nodes = list(gm.graph.nodes)
    fresh = AliasAnalysis(gm)
    positions = [kept.position[n] for n in nodes]
    assert positions == sorted(positions), "kept positions lost the graph order"
    at_kept = {kept.position[n]: n for n in nodes}

    def classes(analysis):
        found: dict[fx.Node, set[fx.Node]] = {}
        for n in nodes:
            found.setdefault(analysis.storage_class(n), set()).add(n)
        return [frozenset(c) for c in found.values()]

    kept_class_of = {n: c for c in classes(kept) for n in c}
    for fresh_class in classes(fresh):
        first = next(iter(fresh_class))
        assert fresh_class <= kept_class_of[first], f"{sorted(map(str, fresh_class))} split"
    fresh_at = {fresh.position[n]: n for n in nodes}
    for n in nodes:
        assert all(p in at_kept for p in kept.writers(n)), f"{n}: a writer was erased"
        kept_writers = {at_kept[p] for p in kept.writers(n)}
        fresh_writers = {fresh_at[p] for p in fresh.writers(n)}
        assert fresh_writers <= kept_writers, f"{n}: writes {fresh_writers - kept_writers} lost"
        assert kept.info[n] == fresh.info[n], f"{n}: op info changed"
    if exact:
        assert set(classes(kept)) == set(classes(fresh)), "kept classes are coarser"
        for n in nodes:
            assert [at_kept[p] for p in kept.writers(n)] == [fresh_at[p] for p in fresh.writers(n)]


# --------------------------------------------------------------------------------------
# Random graphs for property tests.
#
# Every value has shape SHAPE, so any op can take any earlier value. Instructions pick their
# operands by index (modulo the number of values so far); "repeat" re-emits an earlier pure
# instruction on the same operands, which makes duplicates (and duplicates separated by an
# in-place write) frequent.

SHAPE = (3, 4)
_BINARY = (operator.add, operator.mul, operator.sub, torch.add, torch.mul)
_UNARY = (torch.relu, torch.sigmoid, F.relu)
_METHODS = ("relu", "sigmoid", "add", "mul")
_INPLACE = ("add_", "mul_")
_CONSTANTS = (1, 2.0, 0.5, -0.0, 0.0)

_index = st.integers(0, 31)
_instruction = st.one_of(
    st.tuples(st.just("binary"), st.integers(0, len(_BINARY) - 1), _index, _index),
    st.tuples(st.just("unary"), st.integers(0, len(_UNARY) - 1), _index),
    st.tuples(
        st.just("const"),
        st.integers(0, len(_BINARY) - 1),
        _index,
        st.integers(0, len(_CONSTANTS) - 1),
    ),
    st.tuples(st.just("method"), st.integers(0, len(_METHODS) - 1), _index),
    st.tuples(st.just("repeat"), _index),
    st.tuples(st.just("repeat"), _index),
    st.tuples(st.just("random"), _index),
    st.tuples(
        st.just("inplace"),
        st.integers(0, len(_INPLACE) - 1),
        _index,
        st.integers(0, len(_CONSTANTS) - 1),
    ),
    st.tuples(
        st.just("view_inplace"),
        st.integers(0, len(_INPLACE) - 1),
        _index,
        st.integers(0, len(_CONSTANTS) - 1),
    ),
    st.tuples(st.just("view"), _index),
)


# One branch per instruction kind: the ladder is the program's grammar, read top to
# bottom, so it stays one function.
@st.composite
def random_graphs(draw, buffers: bool = False) -> fx.GraphModule:  # noqa: C901
    """A random fx graph over two (3, 4) float inputs; see the module notes above.
    ``buffers``: two (3, 4) buffers read with ``get_attr`` are values too (constants for
    fold-constants, unless an in-place op writes into them)."""
    program = draw(st.lists(_instruction, min_size=1, max_size=24))
    outputs = draw(st.lists(_index, min_size=1, max_size=4))
    graph = fx.Graph()
    root = nn.Module()
    values: list[fx.Node] = [graph.placeholder("x"), graph.placeholder("y")]
    if buffers:
        generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
        for name in ("w", "b"):
            root.register_buffer(name, torch.randn(SHAPE, generator=generator))
            values.append(graph.get_attr(name))
    pure: list[tuple[str, object, tuple]] = []  # (op, target, args) of emitted pure nodes

    def pick(i: int) -> fx.Node:
        return values[i % len(values)]

    def emit(op: str, target, args: tuple, *, is_pure: bool) -> fx.Node:
        node = graph.create_node(op, target, args)
        values.append(node)
        if is_pure:
            pure.append((op, target, args))
        return node

    for kind, *rest in program:
        if kind == "binary":
            fn, a, b = rest
            emit("call_function", _BINARY[fn], (pick(a), pick(b)), is_pure=True)
        elif kind == "unary":
            fn, a = rest
            emit("call_function", _UNARY[fn], (pick(a),), is_pure=True)
        elif kind == "const":
            fn, a, c = rest
            emit("call_function", _BINARY[fn], (pick(a), _CONSTANTS[c]), is_pure=True)
        elif kind == "method":
            name, a = rest
            method = _METHODS[name]
            args = (pick(a),) if method in ("relu", "sigmoid") else (pick(a), pick(a + 1))
            emit("call_method", method, args, is_pure=True)
        elif kind == "repeat":
            if pure:
                op, target, args = pure[rest[0] % len(pure)]
                emit(op, target, args, is_pure=True)
        elif kind == "random":
            emit("call_function", torch.randn_like, (pick(rest[0]),), is_pure=False)
        elif kind == "inplace":
            name, a, c = rest
            emit("call_method", _INPLACE[name], (pick(a), _CONSTANTS[c]), is_pure=False)
        elif kind == "view_inplace":
            name, a, c = rest
            flat = graph.call_method("view", (pick(a), -1))
            graph.call_method(_INPLACE[name], (flat, _CONSTANTS[c]))
        elif kind == "view":
            emit("call_method", "view", (pick(rest[0]), *SHAPE), is_pure=False)
    graph.output(tuple(pick(i) for i in outputs))
    graph.lint()
    return fx.GraphModule(root, graph)


def random_graph_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(SHAPE, generator=generator) for _ in range(2))


def wiring(gm: fx.GraphModule) -> list[tuple[str, tuple[str, ...]]]:
    """(canonical name, canonical names of its node arguments in order) for every node."""
    rows = []
    for node in gm.graph.nodes:
        inputs: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), inputs.append)
        rows.append((ops.info(node, gm).name, tuple(ops.info(a, gm).name for a in inputs)))
    return rows
