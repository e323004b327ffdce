"""fuse-kernels: run the graph on the fused CPU kernels PyTorch ships, chosen by the tiler.

    graph ── tile with the ``cpu`` library ── rewrite each chosen tile to its kernel

The ``cpu`` library (fxopt/tiling/library/cpu.yaml) has one pattern per kernel: conv +
activation, conv + residual add (+ relu), linear, linear + activation, linear + residual
add, and the attention block. :func:`fxopt.tiling.tile` matches every pattern, asks
:func:`fxopt.passes.cpu_kernels.bind` whether each placement can run on its kernel
(constant float32 weights, a residual of the same shape, a 4-D q/k/v, ...), and solves
for the optimal cover of the placements that can: every op some kernel runs, in the
fewest kernels. So in a ResNet block where two convs feed one add, the choice of which
conv takes the add (and its relu) is the solver's, not the order the graph was written
in, and ``--explain`` says for each placement left out which chosen tile it overlaps.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.passes import PassManager
    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    >>> gm = trace(model, (torch.randn(1, 3, 8, 8),))
    >>> result = PassManager([FuseKernels()]).run(gm)
    >>> result.records[0].stats["kernels"]
    'conv_relu: 1'
    >>> "aten.relu_" in result.module.code  # eager's ReLU, in place on the kernel's output
    True

(oneDNN's fused ReLU maps NaN to 0: exact by default, the activation runs after the
kernel; ``fast_math=True`` fuses it: :data:`fxopt.passes.cpu_kernels.INEXACT`.)

CPU float32 and inference only (the oneDNN kernels have no autograd formula), so this is
not a pass of any preset: the layout step (:mod:`fxopt.layout`) builds it as its
``onednn`` candidates and keeps one only when it verifies and measures faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx

from fxopt.ir import ops
from fxopt.ir.alias import AliasAnalysis
from fxopt.passes import cpu_kernels
from fxopt.passes.base import Pass, PassResult, Plan, Skip
from fxopt.tiling import Graph, Tiling, tile


@dataclass(frozen=True)
class KernelPlan(Plan):
    sites: tuple[cpu_kernels.KernelSite, ...] = ()
    tiling: Tiling | None = None


_GEMM = {"mkl_linear": "mkl", "linear": "onednn", "dense_linear": "onednn on the dense weight"}


class FuseKernels(Pass[KernelPlan]):
    name = "fuse-kernels"
    description = "inference, CPU: tile with fused kernels (conv/linear + post-ops, attention)"
    adds_parameters = True
    freezes_parameters = True  # packed weights; the kernels have no autograd
    inexact_rewrites: ClassVar[dict[str, str]] = {
        f"fused {key}": reason for key, reason in cpu_kernels.INEXACT.items()
    }

    def __init__(self, fast_math: bool = False, share_weights: bool = False):
        self.fast_math = fast_math
        # No packed copies: linears on oneDNN read the model's dense weights, the rest stays.
        self.share_weights = share_weights

    def analyze(self, gm: fx.GraphModule) -> KernelPlan:
        if not torch.backends.mkldnn.is_available():
            return KernelPlan(skipped=(Skip("(graph)", "this PyTorch build has no oneDNN"),))
        table = ops.table(gm)
        by_name = {n.name: n for n in gm.graph.nodes}
        alias = AliasAnalysis.of(gm)
        bound: dict[tuple, cpu_kernels.KernelSite] = {}
        cold = cpu_kernels.weights_stream(gm)

        def accept(t) -> str | None:
            nodes = {pid: by_name[gid] for pid, gid in t.nodes.items()}
            found = cpu_kernels.bind(
                gm,
                t.pattern,
                nodes,
                table,
                alias,
                fast_math=self.fast_math,
                cold=cold,
                share_weights=self.share_weights,
            )
            if isinstance(found, str):
                return found
            bound[_key(t)] = found
            return None

        tiling = tile(Graph.from_fx(gm), "cpu", accept=accept)
        sites = tuple(bound[_key(t)] for t in tiling.tiles)
        return KernelPlan(skipped=_explained(gm, tiling, table), sites=sites, tiling=tiling)

    def transform(self, gm: fx.GraphModule, plan: KernelPlan) -> PassResult:
        if not plan.sites:
            return PassResult(False, {"lowered": 0}, plan.skipped)
        for site in plan.sites:
            cpu_kernels.emit(gm, site)
        delete_unused_submodules(gm)
        counts: dict[str, int] = {}
        for site in plan.sites:
            counts[site.pattern] = counts.get(site.pattern, 0) + 1
        stats = {
            "lowered": len(plan.sites),
            "fused_ops": sum(len(s.nodes) for s in plan.sites) - len(plan.sites),
            "kernels": ", ".join(f"{p}: {n}" for p, n in sorted(counts.items(), key=_by_count)),
        }
        gemms = [_GEMM[s.kind] for s in plan.sites if s.kind in _GEMM]
        if gemms:  # which packed GEMM the linears got (timed per shape: gemm_timing)
            stats["gemms"] = ", ".join(f"{g}: {gemms.count(g)}" for g in sorted(set(gemms)))
        inexact: dict[str, int] = {}
        for site in plan.sites:
            if site.inexact:
                key = f"fused {site.inexact}"
                inexact[key] = inexact.get(key, 0) + 1
        return PassResult(True, stats, plan.skipped, inexact=inexact)

    def verify(self, gm: fx.GraphModule) -> None:
        left = [s.output.name for s in self.analyze(gm).sites]
        assert not left, f"fusable tiles left: {left[:8]}"


def _key(t) -> tuple:
    return (t.pattern, tuple(sorted(t.nodes.items())))


def _by_count(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


def _within_chosen(tiling: Tiling) -> Callable[[set[str]], bool]:
    """A test of whether a set of nodes lies within one chosen tile. Only the chosen tiles
    holding one of its nodes can hold them all: checking those alone, not every chosen
    tile, keeps ``--explain`` linear (25k tiles on a 100k-node graph took minutes)."""
    chosen = [set(t.nodes.values()) for t in tiling.tiles]
    holders: dict[str, list[int]] = {}  # node -> the chosen tiles that hold it
    for index, nodes in enumerate(chosen):
        for name in nodes:
            holders.setdefault(name, []).append(index)

    def within(nodes: set[str]) -> bool:
        candidates = holders.get(next(iter(nodes)), ()) if nodes else ()
        return any(nodes <= chosen[i] for i in candidates)

    return within


def _explained(gm: fx.GraphModule, tiling: Tiling, table) -> tuple[Skip, ...]:
    """Why each conv / linear is not on a kernel, and why each placement that could run
    was not chosen (``--explain``)."""
    covered = {g for t in tiling.tiles for g in t.nodes.values()}
    refused_nodes = {g for t, _ in tiling.refused for g in t.nodes.values()}
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}

    def last(t) -> str:  # where --explain names a tile: its last node
        return max(t.nodes.values(), key=order.__getitem__)

    skipped: list[Skip] = []
    reported: set[str] = set()
    for t, reason in tiling.refused:
        anchor = t.nodes.get("c") or t.nodes.get("l") or t.nodes.get("o")
        if len(t.nodes) == 1 and anchor not in covered and anchor not in reported:
            skipped.append(Skip(anchor, reason))  # a conv / linear left as it is
            reported.add(anchor)
        elif len(t.nodes) > 1:
            skipped.append(Skip(last(t), f"{t.pattern} cannot run: {reason}"))
    within_chosen = _within_chosen(tiling)
    for t, reason in tiling.not_chosen:
        if within_chosen(set(t.nodes.values())):
            continue  # a part of a chosen tile (the conv of a chosen conv_relu)
        skipped.append(Skip(last(t), f"{t.pattern} matched, not chosen: {reason}"))
    for node in gm.graph.nodes:
        if node.name not in covered and node.name not in reported:
            if table[node].name == "conv_transpose":
                skipped.append(Skip(node.name, "transposed convolution is not lowered"))
            elif table[node].name == "conv" and node.name not in refused_nodes:
                skipped.append(Skip(node.name, "no kernel pattern matches it"))
    return tuple(skipped)


def delete_unused_submodules(gm: fx.GraphModule) -> None:
    """``GraphModule.delete_all_unused_submodules``, with the names in use in a set: torch
    keeps them in a list and tests every module name against it, which is quadratic (on a
    100k-node graph with 30k fused convolutions, minutes)."""
    used: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr") or not isinstance(node.target, str):
            continue
        parts = node.target.split(".")
        used.update(".".join(parts[: i + 1]) for i in range(len(parts)))
        if node.op == "call_module":
            try:
                module = gm.get_submodule(node.target)
            except AttributeError:
                continue
            used.update(f"{node.target}.{name}" for name, _ in module.named_modules() if name)
    for name in [name for name, _ in gm.named_modules() if name and name not in used]:
        gm.delete_submodule(name)
