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


def sizes(node: object) -> tuple | None:
    """The shape with symbolic dims as SymInts (see :mod:`fxopt.ir.facts` to compare them),
    or None when unknown."""
    val = _val(node)
    if val is None or not hasattr(val, "shape"):
        return None
    return tuple(val.shape)


def rank(node: object) -> int | None:
    """The number of dims, static even when sizes are symbolic; None when unknown."""
    found = sizes(node)
    return None if found is None else len(found)


def hint_shape(node: object) -> tuple[int, ...] | None:
    """The shape with each symbolic dim replaced by the example's size: for choices that
    only affect speed (a weight packed for a typical shape), never for correctness."""
    found = sizes(node)
    if found is None:
        return None
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    try:
        return tuple(int(d) if isinstance(d, int) else int(optimization_hint(d)) for d in found)
    except Exception:
        return None


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
