"""Which storage a joint-graph node's value is, and who reads it: the liveness questions
capture's node order and the in-place rewrite ask (views and in-place ops are their
base's storage, as the profile counts them by data pointer).

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> gm = make_fx(lambda x: (x * 2).t() + 1, tracing_mode="fake")(torch.ones(2, 3))
    >>> mul, t, add = [n for n in gm.graph.nodes if n.op == "call_function"]
    >>> storage_base(gm, t) is mul, storage_readers(gm, mul) == [add], value_bytes(gm, mul)
    (True, True, 24)
"""

from __future__ import annotations

import torch
from torch import fx

from fxopt.ir import ops


def storage_base(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The node whose storage ``node``'s value is (itself, unless a view or alias)."""
    while ops.info(node, gm).view and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def storage_readers(gm: fx.GraphModule, base: fx.Node) -> list[fx.Node]:
    """The nodes that read ``base``'s storage other than through a view of it. A view or
    in-place op passes the storage of its first input on (as :func:`storage_base` reads
    it): ``addmm_(total, a, b)`` is ``total``'s storage, and only reads ``a`` and ``b``."""
    found, stack = [], [(base, user) for user in base.users]
    while stack:
        source, user = stack.pop()
        passes_on = user.op == "call_function" and user.all_input_nodes[:1] == [source]
        if passes_on and ops.info(user, gm).view:
            stack.extend((user, reader) for reader in user.users)
        else:
            found.append(user)
    return found or list(base.users)


def value_bytes(gm: fx.GraphModule, node: fx.Node) -> int:
    """Bytes of the storage ``node`` makes (none for a view)."""
    if ops.info(node, gm).view:
        return 0
    values = node.meta.get("val")
    values = values if isinstance(values, (tuple, list)) else [values]
    return sum(
        v.numel() * v.element_size()
        for v in values
        if isinstance(v, torch.Tensor) and not isinstance(v.numel(), torch.SymInt)
    )
