"""What remat records on the nodes of a joint graph (``node.meta`` keys), for the passes
that read it without importing capture, which runs them.

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> node = next(iter(gm.graph.nodes))
    >>> node.meta[PHASE] = FORWARD
    >>> phase(node)
    'forward'
"""

from __future__ import annotations

from torch import fx

from fxopt.remat.table import BACKWARD, FORWARD, INPUT, OUTPUT

__all__ = ["BACKWARD", "FORWARD", "INPUT", "MUST_SAVE", "OUTPUT", "PHASE", "phase"]

PHASE = "fxopt.phase"  # node meta key; its value is one of the Table's phases
#: Node meta key: the node's value must be saved, never recomputed; the value says why.
MUST_SAVE = "fxopt.must_save"


def phase(node: fx.Node) -> str:
    """The node's phase: "input", "forward", "backward" or "output"."""
    return node.meta.get(PHASE, "")
