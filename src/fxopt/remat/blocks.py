"""Remat per block: each block's forward through ``torch.compile`` with fxopt's backend.

This is the way to plan recomputation under FSDP2 (``fully_shard``). Compiling the whole
sharded model does not work: Dynamo stops at FSDP's hooks and never calls any backend
(torch 2.13), and ``compile_step`` cannot capture a step whose parameters are gathered
and gradients scattered by hooks. Compiling each block's ``forward`` leaves FSDP's hooks
outside the graph, where FSDP runs them as usual (all-gather before the block, reduce-
scatter after its backward), and plans the block's own activations. It works the same on a
model without FSDP.

The blocks are planned together, against the process's activation peak: a block's
saved activations stay alive while every later block runs, so what matters is what each
block saves, not its own peak. On the first step each block is compiled when it first
runs, with a plan of its own against a shared process budget (what the blocks before it
saved counted against it); once every block has been compiled, the first call of the
next step plans them as one chain (:mod:`fxopt.remat.chain`), and each block whose plan
changed is compiled again with it. Activations outside the blocks (a CNN's stem, a
transformer's embeddings) are not planned.

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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fxopt.errors import UserInputError
from fxopt.remat.compile_backend import backend
from fxopt.remat.planners import Plan

_MARK = "_fxopt_remat_compiled"  # set on a block whose forward compile_blocks replaced


@dataclass
class CompiledBlocks:
    """The blocks :func:`compile_blocks` compiled, and the plan of every graph compiled
    so far (one per block once each has run forward)."""

    blocks: list[nn.Module]
    plans: list[Plan] = field(default_factory=list)

    def remove(self) -> None:
        """Give each block its own forward back."""
        for block in self.blocks:
            if getattr(block, _MARK, False):
                del block.forward
                delattr(block, _MARK)


def compile_blocks(
    blocks: nn.Module | Iterable[nn.Module],
    memory_budget: float | int = 0.5,
    planner: str = "greedy",
    **options,
) -> CompiledBlocks:
    """Compile each block's ``forward`` with :func:`~fxopt.remat.backend`, in place.

    ``blocks``: an ``nn.ModuleList`` / ``nn.Sequential`` (its children), one module, or an
    iterable of modules, e.g. a transformer's layers. Like ``nn.Module.compile`` and
    ``fully_shard``, this changes the blocks in place; :meth:`CompiledBlocks.remove` undoes
    it. ``options`` go to :func:`~fxopt.remat.backend` (``compiler``, ``strict``,
    ``profile_runs``, ...).
    """
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
    plans: list[Plan] = []
    # ``blocks`` tells the backend how many graphs make the chain planned together.
    compiler = backend(memory_budget, planner, plans=plans, blocks=len(blocks), **options)
    for block in blocks:
        block.forward = torch.compile(_own_frame(block.forward), backend=compiler, dynamic=False)
        setattr(block, _MARK, True)
    return CompiledBlocks(blocks, plans)


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
