"""What a node's metadata says about the value it produces (shape, dtype, layout).

Capture fills either ``meta["tensor_meta"]`` (fx level, ShapeProp) or ``meta["val"]``
(export level, a fake tensor). These helpers read whichever is there and return None when
nothing is known, so a pass can skip a site instead of guessing.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.ir import meta
    >>> gm = trace(torch.nn.ReLU(), torch.randn(2, 3))
    >>> relu = list(gm.graph.nodes)[1]
    >>> meta.shape(relu), meta.dtype(relu), meta.is_contiguous(relu)
    ((2, 3), torch.float32, True)
"""

from __future__ import annotations

import torch
from torch import fx


def _val(node: object):
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val
    return node.meta.get("tensor_meta")


def shape(node: object) -> tuple[int, ...] | None:
    """The static shape, or None when unknown or symbolic."""
    val = _val(node)
    if val is None or not hasattr(val, "shape"):
        return None
    dims = tuple(val.shape)
    if not all(isinstance(d, int) for d in dims):
        return None  # symbolic (dynamic) dimensions
    return dims


def dtype(node: object) -> torch.dtype | None:
    val = _val(node)
    return getattr(val, "dtype", None)


def device(node: object) -> torch.device | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.device if isinstance(val, torch.Tensor) else None


def is_contiguous(node: object) -> bool | None:
    """True/False when the layout is known, None otherwise."""
    val = _val(node)
    if val is None:
        return None
    if isinstance(val, torch.Tensor):
        try:
            return bool(val.is_contiguous())
        except Exception:  # symbolic strides
            return None
    dims, strides = shape(node), getattr(val, "stride", None)
    if dims is None or not isinstance(strides, tuple):
        return None
    expected = 1
    for size, stride in zip(reversed(dims), reversed(strides)):
        if size != 1 and stride != expected:  # size-1 dims may have any stride
            return False
        expected *= size
    return True
