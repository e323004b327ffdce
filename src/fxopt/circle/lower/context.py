"""What a lowering function sees: the node's arguments as Circle tensors in the layout it
asks for, and a way to emit operators.

A lowering is ``fn(ctx, node) -> None``: it reads ``ctx.input(arg, perm)`` for each operand
(layout conversions and constant materialization happen here, once per value and layout),
emits operators with ``ctx.emit`` and binds the node's result with ``ctx.bind`` or
``ctx.result``. It raises :class:`Unlowerable` with a reason for a form it cannot handle;
the driver collects those, with the op's name and source line, and reports them all at once.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import fx

from fxopt.circle import layout as L
from fxopt.circle.config import CircleConfig
from fxopt.circle.graph import CircleGraph, Grid
from fxopt.ir import attributes

_NP_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


class Unlowerable(Exception):
    """This node's form has no Circle lowering; the message says why."""


def np_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return np.dtype(_NP_DTYPES[dtype])
    except KeyError:
        raise Unlowerable(f"dtype {dtype} has no Circle tensor type") from None


def static_shape(shape: Sequence) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """(shape, signature): a dynamic dim is 1 in the shape and -1 in the signature (the
    TFLite convention; onert 0.1.0 then resizes to the real input), signature None when
    every dim is static."""
    dims, signature, dynamic = [], [], False
    for d in shape:
        if isinstance(d, int):
            dims.append(d)
            signature.append(d)
        else:  # a SymInt: the dim is dynamic
            dims.append(1)
            signature.append(-1)
            dynamic = True
    return tuple(dims), (tuple(signature) if dynamic else None)


def permuted(seq: Sequence, perm: Sequence[int]) -> tuple:
    return tuple(seq[p] for p in perm)


class LoweringContext:
    def __init__(self, gm: fx.GraphModule, layouts: dict, config: CircleConfig, graph: CircleGraph):
        self.gm = gm
        self.layouts = layouts
        self.config = config
        self.graph = graph
        # node → (tensor index, perm) or a list of those for multi-output nodes
        self.values: dict[fx.Node, object] = {}
        self._converted: dict[tuple, int] = {}
        self._constants: dict[tuple, int] = {}
        self._grids = _weight_grids(gm)

    # --- what a node is -------------------------------------------------------------------
    def val(self, node: fx.Node):
        return node.meta["val"]

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        if node.op == "get_attr" and "val" not in node.meta:  # a constant a pass made
            return tuple(self.constant_value(node).shape)
        return static_shape(self.val(node).shape)[0]

    def dtype(self, node: fx.Node) -> np.dtype:
        return np_dtype(self.val(node).dtype)

    def dtype_of(self, val) -> np.dtype:
        return np_dtype(val.dtype)

    def held_perm(self, value: object) -> L.Perm:
        """The layout ``value`` is held in now (torch layout for constants and scalars)."""
        held = self.values.get(value) if isinstance(value, fx.Node) else None
        if isinstance(held, tuple):
            return held[1]
        rank = len(self.shape(value)) if isinstance(value, fx.Node) else 0
        return L.identity(rank)

    def perm(self, node: fx.Node) -> L.Perm:
        held = self.layouts.get(node)
        return held if isinstance(held, tuple) else L.identity(len(self.shape(node)))

    # --- operands ---------------------------------------------------------------------------
    def is_constant(self, value: object) -> bool:
        return not isinstance(value, fx.Node) or value.op == "get_attr"

    def constant_value(self, value: object) -> torch.Tensor:
        if isinstance(value, fx.Node):
            assert value.op == "get_attr"
            return attributes.get(self.gm, str(value.target)).detach()
        return torch.as_tensor(value)

    def input(self, value: object, perm: L.Perm | None = None, *, dtype=None) -> int:
        """``value`` as a Circle tensor held in ``perm`` (torch layout when None)."""
        if not isinstance(value, fx.Node):
            return self.scalar(value, dtype)
        if value.op == "get_attr":
            tensor = attributes.get(self.gm, str(value.target))
            return self.const_tensor(tensor, perm, name=str(value.target))
        held = self.values.get(value)
        if held is None:
            raise Unlowerable(f"operand {value.name} was not lowered")
        if isinstance(held, list):
            raise Unlowerable(f"operand {value.name} is a tuple, not a tensor")
        index, stored = held
        wanted = perm if perm is not None else L.identity(len(stored))
        if wanted == stored:
            return index
        return self._convert(value, index, stored, wanted)

    def input_broadcast(self, value: object, perm: L.Perm, rank: int, *, dtype=None) -> int:
        """Operand of an elementwise op whose result has ``rank`` dims held in ``perm``."""
        if not isinstance(value, fx.Node):
            return self.scalar(value, dtype)
        own_rank = len(self.shape(value))
        if own_rank == rank:
            return self.input(value, perm)
        if perm == L.identity(rank) or own_rank == 0:
            return self.input(value)  # Circle broadcasts right-aligned, like torch
        # Lower-rank operand of an NHWC result: view it at full rank, then permute.
        if value.op == "get_attr":
            tensor = attributes.get(self.gm, str(value.target))
            full = tensor.reshape((1,) * (rank - own_rank) + tuple(tensor.shape))
            return self.const_tensor(full, perm, name=str(value.target))
        shape = (1,) * (rank - own_rank) + self.shape(value)
        expanded = self.reshape(self.input(value), shape, self.dtype(value))
        return self.transpose(expanded, shape, self.dtype(value), perm)

    def const_cast(self, value: fx.Node, dtype, perm: L.Perm, rank: int, *, edit=None) -> int:
        """The constant ``value`` converted to ``dtype`` now (an int64 or bool constant in a
        float op), ``edit``-ed (a numpy array → array function) when given, right-aligned
        to ``rank`` dims and held in ``perm``."""
        array = self.constant_value(value).cpu().numpy().astype(dtype)
        if edit is not None:
            array = edit(array)
        array = array.reshape((1,) * (rank - array.ndim) + array.shape)
        if perm != L.identity(rank):
            array = array.transpose(perm)
        return self.const(array, str(value.target))

    def graph_constant(self, key: object) -> int | None:
        """The tensor already made for constant ``key`` (None: none yet)."""
        return self._constants.get(key)

    def remember_constant(self, key: object, index: int) -> None:
        self._constants[key] = index

    def scalar(self, value: object, dtype=None) -> int:
        dtype = np.dtype(dtype) if dtype is not None else _scalar_dtype(value)
        return self.const(np.asarray([value], dtype=dtype), "scalar")

    def const(self, array: np.ndarray, name: str = "const", key: object = None) -> int:
        """A constant tensor; equal small constants (shapes, scalars) are shared."""
        array = np.ascontiguousarray(array)
        if key is None and array.nbytes <= 256:
            key = ("small", array.dtype.str, array.shape, array.tobytes())
        if key is not None and key in self._constants:
            return self._constants[key]
        index = self.graph.add_tensor(f"{name}", array.shape, array.dtype, array, buffer_key=key)
        if key is not None:
            self._constants[key] = index
        return index

    def const_tensor(
        self, tensor: torch.Tensor, perm: L.Perm | None = None, *, name: str, transform=None
    ) -> int:
        """A torch constant held in ``perm``; one storage → one buffer (tied weights)."""
        tensor = tensor.detach()
        transform_key = transform if transform is not None else perm
        key = (
            "storage",
            tensor.untyped_storage().data_ptr() if tensor.numel() else 0,
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype),
            transform_key,
        )
        if key in self._constants:
            return self._constants[key]
        array = tensor.cpu().numpy() if tensor.dtype != torch.bfloat16 else None
        if array is None:
            raise Unlowerable("bfloat16 constants are not supported")
        if perm is not None and perm != L.identity(array.ndim):
            array = array.transpose(perm)
        if transform is not None and transform != perm:
            raise AssertionError("const_tensor: pass either perm or a named transform")
        array = np.ascontiguousarray(array)
        index = self.graph.add_tensor(name, array.shape, array.dtype, array, buffer_key=key)
        grid = self._grids.get(_view_key(tensor))
        if grid is not None:  # a dequantized weight: its per-channel axis moves with perm
            axis = grid.quantization.axis
            moved = tuple(perm).index(axis) if perm is not None else axis
            self.graph.tensors[index].grid = replace(
                grid, quantization=replace(grid.quantization, axis=moved)
            )
        self._constants[key] = index
        return index

    def _convert(self, node: fx.Node, index: int, stored: L.Perm, wanted: L.Perm) -> int:
        cache_key = (node, wanted)
        if cache_key in self._converted:
            return self._converted[cache_key]
        shape, dtype = self.shape(node), self.dtype(node)
        held_shape = permuted(shape, stored)
        out = self.transpose(index, held_shape, dtype, L.conversion(stored, wanted))
        self._converted[cache_key] = out
        return out

    # --- emitting -------------------------------------------------------------------------
    def tensor(self, shape, dtype, name: str = "t", signature=None) -> int:
        return self.graph.add_tensor(name, shape, dtype, shape_signature=signature)

    def emit(self, code: str, inputs: list[int], outputs: list[int], options=None) -> None:
        self.graph.add_op(code, inputs, outputs, options)

    def result(self, node: fx.Node, perm: L.Perm | None = None) -> int:
        """A new tensor for ``node``'s value held in ``perm`` (its planned layout by default),
        bound to the node."""
        perm = self.perm(node) if perm is None else perm
        shape, signature = static_shape(self.val(node).shape)
        index = self.graph.add_tensor(
            node.name,
            permuted(shape, perm),
            self.dtype(node),
            shape_signature=permuted(signature, perm) if signature else None,
        )
        self.values[node] = (index, perm)
        return index

    def bind(self, node: fx.Node, index: int, perm: L.Perm | None = None) -> None:
        self.values[node] = (index, perm if perm is not None else L.identity(len(self.shape(node))))

    def transpose(self, index: int, shape, dtype, perm: Sequence[int]) -> int:
        """TRANSPOSE by ``perm``; a RESHAPE when only size-1 dims move (same memory order)."""
        perm = tuple(perm)
        out_shape = permuted(shape, perm)
        if perm == L.identity(len(perm)):
            return index
        moved = [p for p in perm if shape[p] != 1]
        if moved == sorted(moved):
            return self.reshape(index, out_shape, dtype)
        out = self.tensor(out_shape, dtype, "transpose")
        self.emit("TRANSPOSE", [index, self.const(np.asarray(perm, np.int32), "perm")], [out])
        return out

    def reshape(self, index: int, shape, dtype, out: int | None = None) -> int:
        from circle_schema.v0_10.circle.ReshapeOptions import ReshapeOptionsT

        options = ReshapeOptionsT()
        options.newShape = [int(d) for d in shape]
        out = self.tensor(shape, dtype, "reshape") if out is None else out
        shape_tensor = self.const(np.asarray(shape, np.int32), "shape")
        self.emit("RESHAPE", [index, shape_tensor], [out], options)
        return out


def _view_key(tensor: torch.Tensor) -> tuple:
    """Which tensor this is, as a view of a storage (a reshaped or sliced weight is not)."""
    ptr = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
    return ptr, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride())


def _weight_grids(gm: fx.GraphModule) -> dict[tuple, Grid]:
    """The grids ``quantized-weights`` recorded, keyed by the weight tensors' views."""
    from fxopt.circle.passes.quantized_weights import WEIGHT_GRIDS_KEY

    grids = {}
    for name, grid in gm.meta.get(WEIGHT_GRIDS_KEY, {}).items():
        tensor = attributes.get(gm, name, None)
        if isinstance(tensor, torch.Tensor):
            grids[_view_key(tensor)] = grid
    return grids


def _scalar_dtype(value: object) -> np.dtype:
    if isinstance(value, bool):
        return np.dtype(np.bool_)
    if isinstance(value, int):
        return np.dtype(np.int64)
    return np.dtype(np.float32)


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
