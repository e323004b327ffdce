"""Remat per block: each block's forward through ``torch.compile`` with fxopt's backend.

The way to plan recomputation under FSDP2 (``fully_shard``), whose hooks then stay
outside the graphs; it works without FSDP too. The blocks share one budget and are planned
together as one chain; ``root=`` plans the code between them as well. Why, and its limits:
docs/remat_design.md.

    >>> import torch
    >>> from fxopt.remat import compile_blocks
    >>> layers = torch.nn.ModuleList(
    ...     torch.nn.Sequential(*[m for _ in range(3)
    ...                           for m in (torch.nn.Linear(32, 32), torch.nn.Tanh())])
    ...     for _ in range(2))
    >>> compiled = compile_blocks(layers, memory_budget=0.9, profile_runs=1)
    >>> x = torch.randn(64, 32)
    >>> for layer in layers:
    ...     x = layer(x)
    >>> x.sum().backward()
    >>> len(compiled.plans), sum(p.saved for p in compiled.plans) <= 0.9 * sum(
    ...     p.baseline_saved for p in compiled.plans)
    (2, True)
    >>> compiled.remove()  # the blocks' own forward again
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fxopt.errors import UserInputError
from fxopt.remat.compile_backend import backend
from fxopt.remat.planners import RematPlan

_MARK = "_fxopt_remat_compiled"  # set on a block whose forward compile_blocks replaced


@dataclass
class CompiledBlocks:
    """The blocks :func:`compile_blocks` compiled, and the plan of every graph compiled
    so far (one per block once each has run forward)."""

    blocks: list[nn.Module]
    plans: list[RematPlan] = field(default_factory=list)
    root: nn.Module | None = None

    def remove(self) -> None:
        """Give each block (and the root) its own forward back."""
        modules = self.blocks if self.root is None else [*self.blocks, self.root]
        for module in modules:
            if getattr(module, _MARK, False):
                del module.forward
                delattr(module, _MARK)


def compile_blocks(
    blocks: nn.Module | Iterable[nn.Module],
    memory_budget: float | int = 0.5,
    planner: str = "greedy",
    *,
    root: nn.Module | None = None,
    **options,
) -> CompiledBlocks:
    """Compile each block's ``forward`` with :func:`~fxopt.remat.backend`, in place.

    ``blocks``: an ``nn.ModuleList`` / ``nn.Sequential`` (its children), one module, or an
    iterable of modules, e.g. a transformer's layers. ``root``: the model the blocks sit
    in; its forward is compiled too, so what runs outside the blocks (a stem, a head) is
    planned with them (see the module docstring). Like ``nn.Module.compile`` and
    ``fully_shard``, this changes the modules in place; :meth:`CompiledBlocks.remove`
    undoes it. ``options`` go to :func:`~fxopt.remat.backend` (``compiler``, ``strict``,
    ``profile_runs``, ...).
    """
    blocks = _checked(blocks, root)
    plans: list[RematPlan] = []
    # ``blocks`` tells the backend how many graphs make the chain planned together; with a
    # root, how many graphs its forward breaks into is known only once it has run (-1).
    count = len(blocks) if root is None else -1
    compiler = backend(memory_budget, planner, plans=plans, blocks=count, **options)
    for block in blocks:
        compiled = torch.compile(_own_frame(block.forward), backend=compiler, dynamic=False)
        block.forward = compiled if root is None else _graph_break(compiled)
        setattr(block, _MARK, True)
    if root is not None:
        compiles = _RootCompiles(compiler, type(root).__name__)
        compiled = torch.compile(_own_code(root.forward), backend=compiles, dynamic=False)
        root.forward = compiles.reporting(compiled)
        setattr(root, _MARK, True)
    return CompiledBlocks(blocks, plans, root)


class _RootCompiles:
    """The backend as the root's frames call it, counting the graphs they hand it, so the
    first call can say when Dynamo compiled nothing of the root (it ran it eagerly)."""

    def __init__(self, compiler: Callable, name: str):
        self._compiler, self._name, self.graphs = compiler, name, 0

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs += 1
        return self._compiler(gm, example_inputs, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._compiler, name)

    def reporting(self, compiled: Callable) -> Callable:
        """``compiled``, warning after its first call if no graph of it was compiled."""
        checked = False

        def root_forward(*args, **kwargs):
            nonlocal checked
            result = compiled(*args, **kwargs)
            if not checked:
                checked = True
                if not self.graphs:
                    warnings.warn(
                        f"fxopt remat: compile_blocks compiled nothing of {self._name}."
                        "forward outside the blocks: Dynamo ran it eagerly (a graph break "
                        "inside a loop, as in `for layer in self.layers`, does that on torch "
                        "2.13), so only the blocks are planned; pass the modules it calls "
                        "outside the loop (embeddings, a final norm, a head) among the blocks "
                        "instead of root",
                        stacklevel=2,
                    )
            return result

        return root_forward


def _own_code(forward: Callable) -> Callable:
    """The root's ``forward`` itself, bound to a copy of its code object.

    Dynamo compiles the code after each graph break (each block's call) as functions it
    derives from the code object of the frame that broke. Compiled through a wrapper, as
    blocks are (:func:`_own_frame`), the break would be in the class's shared ``forward``,
    and a second model of the class in the process would recompile those functions: graphs
    of another round of compiles, outside this model's chain (and past Dynamo's limit of 8,
    eager code)."""
    func = getattr(forward, "__func__", None)
    if not isinstance(func, types.FunctionType):  # not a plain method: a wrapper will do
        return _own_frame(forward)
    return types.MethodType(_copied(func), forward.__self__)


def _copied(func: types.FunctionType) -> types.FunctionType:
    """``func`` with a code object of its own; a decorator's wrapper (``functools.wraps``,
    as transformers' forwards have) with a copy of the function it wraps in its closure,
    since the graph breaks fall in that function's code."""
    wrapped, closure = getattr(func, "__wrapped__", None), func.__closure__
    if isinstance(wrapped, types.FunctionType) and closure:
        inner = _copied(wrapped)
        closure = tuple(
            types.CellType(inner) if _holds(cell, wrapped) else cell for cell in closure
        )
    else:
        inner = wrapped
    code = func.__code__
    copy = types.FunctionType(
        code.replace(co_varnames=code.co_varnames),
        func.__globals__,
        func.__name__,
        func.__defaults__,
        closure,
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__dict__.update(func.__dict__)
    if inner is not None:
        copy.__wrapped__ = inner
    return copy


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _graph_break(compiled: Callable) -> Callable:
    """``compiled`` behind a call Dynamo does not trace: compiling the root's forward
    breaks its graph there, and the block runs its own compiled code. (A plain function
    in between: ``torch.compiler.disable`` of a compiled function disables the compile.)"""

    def block_call(*args, **kwargs):
        return compiled(*args, **kwargs)

    return torch.compiler.disable(block_call)


def _checked(blocks, root: nn.Module | None) -> list[nn.Module]:
    """``compile_blocks``' blocks as a list, after the checks that refuse bad input."""
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        blocks = list(blocks.children())
    elif isinstance(blocks, nn.Module):
        blocks = [blocks]
    else:
        try:
            blocks = list(blocks)
        except TypeError:
            raise UserInputError(
                f"blocks must be modules or an iterable of modules, got {type(blocks).__name__}"
            ) from None
    for position, block in enumerate(blocks):
        if not isinstance(block, nn.Module):
            raise UserInputError(
                f"blocks[{position}] is a {type(block).__name__}, not an nn.Module"
            )
        if getattr(block, _MARK, False):
            raise UserInputError(
                f"blocks[{position}] ({type(block).__name__}) is already compiled by "
                "compile_blocks; call .remove() on the earlier result first"
            )
    if root is not None:
        if not isinstance(root, nn.Module):
            raise UserInputError(f"root must be an nn.Module, got {type(root).__name__}")
        if any(block is root for block in blocks):
            raise UserInputError("root is one of the blocks; pass the model the blocks sit in")
        if getattr(root, _MARK, False):
            raise UserInputError(
                f"root ({type(root).__name__}) is already compiled by compile_blocks; "
                "call .remove() on the earlier result first"
            )
    return blocks


def _own_frame(forward: Callable) -> Callable:
    """``forward`` called from a function with a code object of its own.

    Dynamo keeps compiled code per code object, and a forward defined in torch's files
    (``nn.Sequential``, ``nn.TransformerEncoderLayer``) is compiled through one shared
    wrapper (``torch._dynamo.external_utils.wrap_inline``): every such block in the
    process would share one cache, and past its recompile limit (8) Dynamo would run the
    rest eagerly, without remat and without a word. (torch does the same for its own
    nested calls: a replaced code object is a new one.)
    """

    def block_forward(*args, **kwargs):
        return forward(*args, **kwargs)

    code = block_forward.__code__
    block_forward.__code__ = code.replace(co_varnames=code.co_varnames)
    return block_forward
