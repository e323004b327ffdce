"""Apply a recompute plan to a joint graph.

For every recomputed node that the backward needs, copy it once into the backward, right
before its earliest backward consumer, and point the backward's uses at the copy:

    forward:  a = f(x) ── b = g(a) ── ...            (a dies after g: its last forward use)
    backward: ... ── a' = f(x) ── ga = h(a', gb) ── gx = k(a', ...)
                      ▲ copy inserted before the first backward use; later uses reuse a'

The copy's inputs are the copies of recomputed inputs (made earlier, since a node's
inputs are consumed before it) or the kept originals, so the recompute subgraph of each
activation reaches back exactly to kept values and placeholders, and nothing is copied
twice. Placement is :func:`fxopt.remat.simulate.anchors_of`, the function the planners'
cost model uses, so the rewritten graph is the schedule that was simulated. fx's code
generation frees every value after its last use, so the forward original dies after its
last forward use and each recomputed value after its last backward use. A random op is
copied as ``rng.replay(device, snapshot, op, *args)``, drawing what the forward drew; RNG
snapshots no replay reads are erased.

    >>> import torch
    >>> from torch import fx
    >>> from fxopt.remat.capture import tag_phases
    >>> def f(x):
    ...     a = torch.sin(x)
    ...     b = torch.cos(a)
    ...     return b, torch.mul(a, b)
    >>> gm = fx.symbolic_trace(f)
    >>> out = list(gm.graph.nodes)[-1]
    >>> _ = tag_phases(gm, forward_outputs=[out.args[0][0]])
    >>> copies = recompute(gm, ["sin"])
    >>> [n.name for n in gm.graph.nodes]
    ['x', 'sin', 'cos', 'sin_1', 'mul', 'output']
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from fxopt.errors import PassError
from fxopt.ir import ops
from fxopt.remat import rng
from fxopt.remat.capture import BACKWARD, PHASE, phase
from fxopt.remat.simulate import anchors_of
from fxopt.remat.table import Row, Table

RECOMPUTED_FROM = "fxopt.recomputed_from"


def recompute(gm: fx.GraphModule, names: Iterable[str]) -> dict[str, fx.Node]:
    """Rewrite ``gm`` in place so the named forward nodes are recomputed in the backward.

    Returns original name → copy for every node that got a copy (a recomputed node that
    nothing in the backward needs gets none). Lints and recompiles. Refuses a random node
    without an RNG-state snapshot (see :mod:`fxopt.remat.rng`).
    """
    nodes = list(gm.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    by_name = {node.name: node for node in nodes}
    wanted = []
    for name in names:
        node = by_name.get(name)
        if node is None:
            raise PassError("remat", f"no node named '{name}' in the graph")
        if phase(node) != "forward":
            raise PassError("remat", f"'{name}' is not a forward node ({phase(node)})")
        wanted.append(index[node])
    anchors = anchors_of(_structure(nodes, index), wanted)

    copies: dict[fx.Node, fx.Node] = {}
    for x in sorted(anchors, key=lambda i: (anchors[i], i)):
        original, anchor = nodes[x], nodes[anchors[x]]
        snapshot = rng.snapshot_of(original, by_name)
        if snapshot is None and ops.info(original, gm).random:
            raise PassError(
                "remat", f"'{original.name}' is random and has no RNG-state snapshot to replay"
            )
        with gm.graph.inserting_before(anchor):
            if snapshot is not None:  # same draws as the forward, generator restored after
                copy = rng.replay_node(gm.graph, original, snapshot, lambda a: copies.get(a, a))
            else:
                copy = gm.graph.node_copy(original, lambda a: copies.get(a, a))
        copy.meta = dict(original.meta)
        copy.meta[PHASE] = BACKWARD
        copy.meta[RECOMPUTED_FROM] = original.name
        if "partitioner_tag" in copy.meta:  # AOTAutograd's own forward/backward marker
            copy.meta["partitioner_tag"] = "is_backward"
        copies[original] = copy
    for original, copy in copies.items():
        for user in list(original.users):
            if phase(user) == BACKWARD and user.meta.get(RECOMPUTED_FROM) is None:
                user.replace_input_with(original, copy)
    rng.erase_unused_snapshots(gm)  # no cost for random ops the plan keeps
    try:
        gm.graph.lint()
    except Exception as error:
        raise PassError("remat", f"the rewritten graph is malformed: {error}") from error
    gm.recompile()
    return {original.name: copy for original, copy in copies.items()}


def _structure(nodes: list[fx.Node], index: dict[fx.Node, int]) -> Table:
    """The graph's shape as a Table (phases and arguments only), for placement."""
    rows = tuple(
        Row(name=n.name, phase=phase(n), args=tuple(index[a] for a in n.all_input_nodes))
        for n in nodes
    )
    return Table(rows, ())
