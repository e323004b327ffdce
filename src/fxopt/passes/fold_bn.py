"""Fold an inference-mode BatchNorm into the convolution or Linear that feeds it.

    x -- conv(W, b) -- batch_norm(γ, β, μ, σ², ε) -- y
    x -- conv(W', b') ------------------------------ y

    s = γ / sqrt(σ² + ε)           (γ = 1 when affine=False)
    W' = W · s  along the weight's output-channel axis
    b' = (b − μ) · s + β           (b = 0 without bias, β = 0 when affine=False)

The output-channel axis is dim 0 for ``Conv{1,2,3}d`` and ``Linear``, and dim 1 *per
group* for ``ConvTranspose{1,2,3}d`` (weight ``[in, out/groups, k...]``). The products are
computed in float64 and cast back, so folding adds no more rounding than one multiply.

Three spellings are folded: modules (``nn.Conv2d`` → ``nn.BatchNorm2d``, fx level),
functions (``F.conv2d`` → ``F.batch_norm`` with attribute weights and statistics, fx level)
and ATen (``aten.convolution`` → ``aten._native_batch_norm_legit_no_training``, export
level). Skipped, with the reason in the plan:

* BatchNorm in training mode (its output uses batch statistics and it updates them);
* ``track_running_stats=False`` (normalizes with batch statistics even in eval mode);
* statistics or weights that are not constants (graph inputs, computed values);
* a producer whose output has other users (the rule engine's refusal): they would see the
  folded values, and an unfolded copy for them costs more than the BatchNorm saved;
* ``BatchNorm1d`` after a ``Linear`` whose output is not 2-D (then it normalizes dim 1,
  which is not the Linear's feature axis);
* a producer module with forward (pre-)hooks (an unknown op to the engine) or parametrized
  weights (fx level; export traces both into the graph).

A conv module called at several sites (or reachable under several names, or whose weight
is also read directly by a ``get_attr`` node, as tied weights are) is not changed: the
folded call site gets a new folded copy, the other sites keep the original. The folded
module's ``state_dict``: a module-form fold rewrites the conv's weight/bias in place (the
BatchNorm module stays attached, unused); functional and ATen folds add ``_fxopt_fold_*``
attributes. Folding is for inference: parameters are treated as constants.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.modules.module import _global_parameter_registration_hooks

from fxopt.ir import attributes, meta, ops, shared
from fxopt.ir.copying import shared_copy
from fxopt.ir.op_table import Group
from fxopt.ir.pattern import Match, Op, Var
from fxopt.ir.weights import note_derived
from fxopt.passes.base import PassResult, Skip
from fxopt.passes.rules import Rule, RulePass, RulePlan

# Modules carry their own description: every conv and conv-transpose module derives from
# _ConvNd and says `transposed`; no list of spellings needed.
_ConvNd = nn.modules.conv._ConvNd

# How the producer is spelled: a module call (fx level), or a conv / linear (addmm, mm)
# call at either level, read through ops.args.
_FORMS = ("module", "conv", "linear")


@dataclass(slots=True)  # not frozen: one per BatchNorm, and frozen __init__ is slow
class _Fold:
    form: str  # one of _FORMS
    producer: fx.Node
    batch_norm: fx.Node
    modules: tuple[nn.Module, nn.Module] | None = None  # module form: (producer, batch norm)
    # Module form, non-transposed: sites with equal keys fold in one stacked batch (see
    # _fold_module_weights).
    batch: tuple | None = None


@dataclass(frozen=True)
class FoldPlan(RulePlan):
    folds: tuple[_Fold, ...] = ()  # one per site, in the same order


@dataclass(slots=True)  # not frozen: one per site, read once
class _Statistics:
    mean: torch.Tensor
    var: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


_PRODUCERS = ("conv", "conv_transpose", "linear", "addmm", "mm")


class IntoProducer(Rule):
    """A batch norm (module, ``F.batch_norm``, ATen) after a conv / conv-transpose / linear
    called the same way (module after module, call after call)."""

    name = "batch norm into the conv or linear before it"
    pattern = Op("batch_norm", input=Op(_PRODUCERS, bind="producer"))
    near = Op("batch_norm", input=Op("*", bind="producer") | Var("input"))

    def applies(self, match: Match) -> bool:
        return (match.root.op == "call_module") == (match["producer"].op == "call_module")

    def near_miss(self, match: Match) -> str | None:
        producer, module_form = match.get("producer"), match.root.op == "call_module"
        reason = _batch_norm_reason(match.graph, match.root)
        if reason or producer is None or module_form != (producer.op == "call_module"):
            what = "a conv / conv-transpose / linear module call" if module_form else None
            return reason or f"input is not {what or 'a convolution or a linear'}"
        if module_form:
            module = type(ops.submodule(match.graph, str(producer.target))).__name__
            return f"input is a {module}, not a conv / conv-transpose / linear"
        name = ops.info(producer).name
        if name in Group.FLATTENS and ops.is_call((ops.args(producer) or {}).get("input"), "addmm"):
            # A Linear on a 3-D input is view → addmm → view at ATen level.
            return "BatchNorm1d after a Linear with a non-2-D output normalizes another axis"
        return f"input is a {name}, not a convolution or a linear"

    def check(self, match: Match) -> str | None:
        """Why not, or None; an accepted match's notes keep its :class:`_Fold` (the
        modules looked up once: on 30k sites a second lookup cost more than the check)."""
        gm, bn, producer = match.graph, match.root, match["producer"]
        if bn.op != "call_module":
            reason = _batch_norm_reason(gm, bn)
            linear = ops.info(producer).name in ("addmm", "mm")
            form = "linear" if linear else "conv"
            reason = reason or (_linear_reason(producer) if linear else _conv_call_reason(producer))
            reason = reason or _call_values_reason(gm, producer, ops.args(bn), form)
            match.notes["fold"] = _Fold(form, producer, bn)
            return reason
        module, conv = ops.submodule(gm, str(bn.target)), ops.submodule(gm, str(producer.target))
        reason = _batch_norm_module_reason(module) or _producer_module_reason(producer, conv)
        if reason:
            return reason
        # Output channels: weight dim 0, or dim 1 times groups for a transposed conv.
        shape, transposed = conv._parameters["weight"].shape, _is_transposed(conv)
        if (shape[1] * conv.groups if transposed else shape[0]) != module.num_features:
            return "channel counts of the producer and the batch norm differ"
        batch = None if transposed else _batch_key(conv, module)
        match.notes["fold"] = _Fold("module", producer, bn, (conv, module), batch)
        return None


def _batch_norm_reason(gm: fx.GraphModule, bn: fx.Node) -> str | None:
    """Why a batch norm (module or call) cannot be folded, whatever feeds it."""
    if bn.op == "call_module":
        return _batch_norm_module_reason(ops.submodule(gm, str(bn.target)))
    args = ops.args(bn)
    return _batch_norm_call_reason(bn, args) if args else f"cannot read {_describe(bn)}"


class FoldBatchNorm(RulePass):
    name = "fold-bn"
    description = "fold inference BatchNorm into the preceding conv / conv-transpose / linear"
    adds_parameters = True  # functional and ATen folds add _fxopt_fold_* attributes
    freezes_parameters = True  # the folded weights are new tensors: no gradient reaches BN
    counters, leftovers = ("folded",), "foldable batch norms"
    rules = (IntoProducer(),)

    def analyze(self, gm: fx.GraphModule) -> FoldPlan:
        plan = super().analyze(gm)
        folds = [site.match.notes["fold"] for site in plan.sites]
        inexact = _module_folds_inexact(folds)
        kept = [(s, f) for s, f in zip(plan.sites, folds) if not inexact.get(id(f))]
        skipped = [Skip(f.batch_norm.name, inexact[id(f)]) for f in folds if inexact.get(id(f))]
        return FoldPlan(
            skipped=(*plan.skipped, *skipped),
            sites=tuple(s for s, _ in kept),
            folds=tuple(f for _, f in kept),
        )

    def transform(self, gm: fx.GraphModule, plan: FoldPlan) -> PassResult:
        module_folds = [f for f in plan.folds if f.form == "module"]
        folded = iter(_fold_module_weights(module_folds))  # in module_folds' order
        # A module fold only moves the BatchNorm's users to the conv: the op table stays
        # sound (as after dce) and the shared alias analysis follows it. The other forms
        # add nodes, so the next pass rebuilds both.
        only_modules = len(module_folds) == len(plan.folds)
        alias = shared.peek(gm, "alias") if only_modules else None
        call_counts = _module_call_counts(gm) if module_folds else {}
        # What each folded weight was computed from: it follows none of them any more.
        sources: list[torch.Tensor | None] = []
        copied = 0
        for index, fold in enumerate(plan.folds):
            if fold.form == "module":
                conv, bn_module = fold.modules  # type: ignore[misc]
                sources += _own_tensors(conv) + _own_tensors(bn_module)
                shared_conv = call_counts.get(id(conv), 0) > 1
                copied += shared_conv
                _fold_module(gm, fold, next(folded), shared_conv)
                if alias is not None:
                    alias.replace(fold.batch_norm, fold.producer)
            else:
                _fold_call(gm, fold, index, sources)
        note_derived(gm, sources, by=self.name)
        counts = Counter(f.form for f in plan.folds)
        stats = {"folded": len(plan.folds)}
        stats.update((form, counts[form]) for form in _FORMS if counts[form])
        if copied:
            stats["copied_shared"] = copied
        return PassResult(
            bool(plan.folds),
            stats,
            plan.skipped,
            keeps=("ops", "alias") if alias is not None else ("ops",) if only_modules else (),
        )


# --- analysis helpers -------------------------------------------------------------------


def _describe(node: fx.Node) -> str:
    return f"'{node.name}' ({node.op} {getattr(node.target, '__name__', node.target)})"


def _module_call_counts(gm: fx.GraphModule) -> dict[int, int]:
    """How often each module object is used: called, or its attributes read by ``get_attr``
    (``x @ self.fc.weight.t()``: folding ``fc`` in place would change what that reads).
    Aliases of one object count together."""
    counts: dict[int, int] = {}
    # find_nodes reads fx's per-opcode index: no walk over the whole graph.
    called = gm.graph.find_nodes(op="call_module", sort=False)
    read = gm.graph.find_nodes(op="get_attr", sort=False)
    owners = [str(n.target) for n in called] + [str(n.target).rpartition(".")[0] for n in read]
    for owner in owners:
        try:
            module = ops.submodule(gm, owner)
        except AttributeError:
            continue
        counts[id(module)] = counts.get(id(module), 0) + 1
    return counts


def _batch_norm_module_reason(module: nn.Module) -> str | None:
    """Why a BatchNorm module call cannot be folded (it uses or updates batch statistics)."""
    if not isinstance(module, nn.modules.batchnorm._BatchNorm):
        return f"{type(module).__name__} is not a BatchNorm module"
    if module.training:
        return "batch_norm is in training mode; call model.eval() first"
    # (Registries read directly: nn.Module.__getattr__ is slow and this runs per site.)
    buffers = module._buffers
    if buffers.get("running_mean") is None or buffers.get("running_var") is None:
        return "track_running_stats=False: it normalizes with batch statistics"
    return None


def _producer_module_reason(producer: fx.Node, conv: nn.Module) -> str | None:
    """Why the module called by ``producer`` cannot take the folded weights."""
    if not isinstance(conv, (_ConvNd, nn.Linear)):
        return f"input is a {type(conv).__name__}, not a conv / conv-transpose / linear"
    # parametrize.is_parametrized(conv), without its getattr miss (an AttributeError
    # raised and caught per site): parametrizations live in a registered ModuleDict.
    if isinstance(conv._modules.get("parametrizations"), nn.ModuleDict):
        # weight is computed from other tensors at every call: it cannot be assigned.
        return f"{producer.name}'s weight is parametrized (torch.nn.utils.parametrize)"
    if isinstance(conv, nn.Linear) and meta.rank(producer) != 2:
        return "BatchNorm1d after a Linear with a non-2-D output normalizes another axis"
    return None


def _batch_key(conv: nn.Module, bn_module: nn.Module) -> tuple:
    """_Fold.batch of a non-transposed module site: sites with equal keys fold together."""
    weight = conv._parameters["weight"]
    bn_parameters = bn_module._parameters
    return (
        weight.shape,
        weight.dtype,
        weight.device,
        conv._parameters["bias"] is None,
        bn_parameters.get("weight") is None,
        bn_parameters.get("bias") is None,
        bn_module._buffers["running_mean"].dtype,
    )


def _batch_norm_call_reason(bn: fx.Node, args: dict) -> str | None:
    """Why a batch norm call cannot be folded: batch statistics, training mode, tensors
    that are not constants, or saved statistics someone reads."""
    if args.get("running_mean") is None or args.get("running_var") is None:
        return "track_running_stats=False: it normalizes with batch statistics"
    if args.get("training", False) is not False:
        return "batch_norm is in training mode; call model.eval() first"
    for key in ("running_mean", "running_var", "weight", "bias"):
        if args[key] is not None and not _is_constant(args[key]):
            return f"{key} is not a constant attribute"
    if _returns_tuple(bn) and any(not _is_getitem(user, 0) for user in bn.users):
        return "the batch norm's saved statistics are used"
    return None


@torch.no_grad()  # instead of a detach() per stacked tensor (as in _fold_batch)
def _module_folds_inexact(sites: list[_Fold]) -> dict[int, str | None]:
    """id(site) → :func:`_inexact_reasons`' answer for each module site, stacked by
    ``_Fold.batch`` as the fold stacks them."""
    groups: dict[object, list[_Fold]] = {}
    for site in sites:
        if site.form == "module":
            groups.setdefault(site.batch if site.batch is not None else id(site), []).append(site)
    found: dict[int, str | None] = {}
    for members in groups.values():
        if len(members) == 1:
            conv, bn = members[0].modules  # type: ignore[misc]
            weights = conv._parameters
            reason = _inexact_reason(weights["weight"], weights["bias"], _module_statistics(bn))
            found[id(members[0])] = reason
            continue
        convs = [s.modules[0]._parameters for s in members]  # type: ignore[index]
        bns = [s.modules[1] for s in members]  # type: ignore[index]

        def stacked(tensors: list) -> torch.Tensor | None:
            return None if tensors[0] is None else torch.stack(tensors)

        eps = torch.tensor([[b.eps] for b in bns], dtype=torch.float64)
        reasons = _inexact_reasons(
            stacked([c["weight"] for c in convs]),
            stacked([c["bias"] for c in convs]),
            stacked([b._buffers["running_mean"] for b in bns]),
            stacked([b._buffers["running_var"] for b in bns]),
            stacked([b._parameters.get("weight") for b in bns]),
            stacked([b._parameters.get("bias") for b in bns]),
            eps.to(bns[0]._buffers["running_var"].device),
        )
        found.update((id(site), reason) for site, reason in zip(members, reasons))
    return found


def _call_statistics(gm: fx.GraphModule, args: dict) -> _Statistics:
    """The statistics and affine of a batch norm call, its constant attributes."""
    return _Statistics(
        _attr(gm, args["running_mean"]),
        _attr(gm, args["running_var"]),
        _attr(gm, args["weight"]),
        _attr(gm, args["bias"]),
        float(args["eps"]),
    )


def _call_values_reason(gm, producer: fx.Node, args: dict, form: str) -> str | None:
    """:func:`_inexact_reason` for a call site's constants (weight, bias, statistics)."""
    stats = _call_statistics(gm, args)
    produced = ops.args(producer)
    if produced is None:
        return f"cannot read the arguments of {_describe(producer)}"
    if form == "linear":
        transposed = produced["mat2"]
        weight = _attr(gm, (ops.args(transposed) or {}).get("input"))
        bias = _attr(gm, produced["input"]) if ops.info(producer).name == "addmm" else None
    else:
        weight, bias = _attr(gm, produced["weight"]), _attr(gm, produced["bias"])
    if weight is None:
        return "the producer's weight is not a constant attribute"
    return _inexact_reason(weight, bias, stats)


def _conv_call_reason(conv_node: fx.Node) -> str | None:
    """Why a convolution call does not have a constant weight and bias to fold into."""
    conv = ops.args(conv_node)
    if conv is None or not _is_constant(conv["weight"]):
        return "convolution weight is not a constant attribute"
    if conv["bias"] is not None and not _is_constant(conv["bias"]):
        return "convolution bias is not a constant attribute"
    return None


def _is_transposed(module: nn.Module) -> bool:
    return isinstance(module, _ConvNd) and module.transposed


def _is_constant(value: object) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr"


def _linear_reason(matmul: fx.Node) -> str | None:
    """Why ``addmm(bias, x, Wᵀ)`` / ``mm(x, Wᵀ)`` is not a Linear with constant weights
    (at ATen level, a Linear on a 2-D input is spelled so)."""
    args = ops.args(matmul)
    if args is None or args.get("beta", 1) != 1 or args.get("alpha", 1) != 1:
        return "addmm with alpha/beta is not a plain linear"
    bias = args["input"] if ops.info(matmul).name == "addmm" else None
    if (bias is not None and not _is_constant(bias)) or not _is_transposed_constant(args["mat2"]):
        return "matmul operands are not a constant bias and a transposed constant weight"
    return None


def _is_transposed_constant(node: object) -> bool:
    """``W.t()`` or ``W.permute(1, 0)`` of a constant ``W``."""
    if not isinstance(node, fx.Node) or not ops.is_compute(node):
        return False
    args = ops.args(node)
    if args is None or not _is_constant(args["input"]):
        return False
    name = ops.info(node).name
    return name == "t" or (name == "permute" and list(args["dims"]) == [1, 0])


def _returns_tuple(node: fx.Node) -> bool:
    """An ATen batch norm returns (output, saved mean, saved invstd)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and len(target._schema.returns) > 1


def _is_getitem(node: fx.Node, index: int) -> bool:
    return ops.is_call(node, "getitem") and (ops.args(node) or {}).get("index") == index


def _attr(gm: fx.GraphModule, node: fx.Node | None) -> torch.Tensor | None:
    return None if node is None else attributes.constant(gm, node)


_NOT_FINITE = "a weight or statistic is NaN or infinite (folded, it would reach every product)"


def _inexact_reason(
    weight: torch.Tensor, bias: torch.Tensor | None, stats: _Statistics
) -> str | None:
    """Why folding these values would not be exact for every input, NaN and ±inf included
    (or None): :func:`_inexact_reasons` for one site."""

    def one(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.detach().unsqueeze(0)

    eps = torch.tensor([[stats.eps]], dtype=torch.float64, device=stats.var.device)
    stacked = (one(weight), one(bias), one(stats.mean), one(stats.var), one(stats.weight))
    return _inexact_reasons(*stacked, one(stats.bias), eps)[0]


@torch.no_grad()
def _inexact_reasons(weight, bias, mean, var, gamma, beta, eps) -> list[str | None]:
    """Per site of a stack (dim 0: the sites; ``eps`` [sites, 1]), why folding it would not
    be exact for every input, NaN and ±inf included, or None. Folded, a non-finite weight
    or statistic reaches every product of its output channel (``0 · inf`` is NaN where
    eager computed ``inf`` from ``(W·x - mean) · s``); a folded weight that overflows, or a
    nonzero one that underflows to 0, turns an input's inf into another value than eager's.
    Vectorized: a generated 100k-node graph has 30k sites (one check each cost as much as
    the fold)."""
    sites = weight.shape[0]

    def finite(tensor: torch.Tensor | None) -> torch.Tensor:
        if tensor is None:
            return torch.ones(sites, dtype=torch.bool, device=weight.device)
        return torch.isfinite(tensor.reshape(sites, -1)).all(1)

    ok_values = finite(weight) & finite(bias) & finite(mean) & finite(var)
    ok_values &= finite(gamma) & finite(beta)
    scale = torch.rsqrt(var.double() + eps)
    if gamma is not None:
        scale = scale * gamma.double()
    scale = scale.abs()
    ok_scale = torch.isfinite(scale).all(1)
    w = weight.reshape(sites, -1).abs().double()
    limits = torch.finfo(weight.dtype)
    overflow = w.amax(1) * scale.amax(1) > limits.max / 2
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=w.device)
    smallest_w = torch.where(w > 0, w, inf).amin(1)
    smallest_s = torch.where(scale > 0, scale, inf).amin(1)
    underflow = smallest_w * smallest_s < limits.smallest_normal
    reasons: list[str | None] = []
    for good, fine, over, under in zip(
        ok_values.tolist(), ok_scale.tolist(), overflow.tolist(), underflow.tolist()
    ):
        if not good:
            reasons.append(_NOT_FINITE)
        elif not fine:
            reasons.append("a running variance is below -eps (the scale is not a number)")
        elif over:
            reasons.append(f"the folded weights would overflow {weight.dtype}")
        elif under:
            reasons.append("a folded weight would underflow to a subnormal or zero")
        else:
            reasons.append(None)
    return reasons


# --- the math ---------------------------------------------------------------------------


def folded_weight_and_bias(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: _Statistics,
    *,
    transposed: bool = False,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """W' and b' for a conv / conv-transpose / linear weight followed by ``stats``."""
    dtype = weight.dtype
    # In float64, all per-channel vectors in one stack: a model-sized fold is dominated by
    # the fixed cost of each small torch call (a 100k-node graph has ~30k of these).
    channels = stats.mean.shape[0]
    ones = stats.mean.new_ones(channels) if stats.weight is None else None
    zeros = stats.mean.new_zeros(channels) if stats.bias is None or bias is None else None
    gamma = stats.weight.detach() if stats.weight is not None else ones
    beta = stats.bias.detach() if stats.bias is not None else zeros
    old_bias = bias.detach() if bias is not None else zeros
    var, mean, gamma, beta, old_bias = torch.stack(
        (stats.var, stats.mean, gamma, beta, old_bias)
    ).double()
    scale = torch.rsqrt(var + stats.eps) * gamma
    new_bias = (old_bias - mean) * scale + beta
    w = weight.detach().double()
    if transposed:
        # [in, out/groups, k...] → [groups, in/groups, out/groups, k...]; scale per output.
        grouped = w.reshape(groups, w.shape[0] // groups, *w.shape[1:])
        per_out = scale.reshape(groups, 1, w.shape[1], *([1] * (w.dim() - 2)))
        new_weight = (grouped * per_out).reshape(w.shape)
    else:
        new_weight = w * scale.reshape(-1, *([1] * (w.dim() - 1)))
    return new_weight.to(dtype), new_bias.to(dtype)


# --- rewrites ---------------------------------------------------------------------------


def _tensors(stats: _Statistics) -> list[torch.Tensor | None]:
    return [stats.mean, stats.var, stats.weight, stats.bias]


def _module_statistics(bn_module: nn.Module) -> _Statistics:
    buffers, parameters = bn_module._buffers, bn_module._parameters
    return _Statistics(
        buffers["running_mean"],
        buffers["running_var"],
        parameters.get("weight"),
        parameters.get("bias"),
        bn_module.eps,
    )


def _fold_module_weights(sites: list[_Fold]) -> list[tuple]:
    """Folded (weight, bias) of every module site, in order, computed before any is applied.

    Sites with equal ``batch`` keys (weight shape, dtypes, device, which optional tensors
    exist) are folded in one batch: on a large graph the math is a few torch calls per
    batch instead of a dozen per site (a generated 100k-node conv-bn graph has 30k sites;
    per site, the fixed cost of small torch calls was most of fold-bn's time). Elementwise
    float64 math, so a batch gives the very same bits.
    """
    folded: list[tuple | None] = [None] * len(sites)
    batches: dict[tuple, list[int]] = {}
    for index, site in enumerate(sites):
        if site.batch is not None:
            batches.setdefault(site.batch, []).append(index)
            continue
        conv, bn = site.modules  # type: ignore[misc]
        folded[index] = folded_weight_and_bias(
            conv.weight,
            conv.bias,
            _module_statistics(bn),
            transposed=_is_transposed(conv),
            groups=conv.groups,
        )
    for members in batches.values():
        weights, biases = _fold_batch([sites[i].modules for i in members])  # type: ignore[misc]
        for i, weight, bias in zip(members, weights, biases, strict=True):
            folded[i] = (weight, bias)
    return folded  # type: ignore[return-value]


@torch.no_grad()  # instead of a detach() per stacked tensor: 180k calls on 30k sites
def _fold_batch(pairs: list[tuple[nn.Module, nn.Module]]):
    """folded_weight_and_bias for (conv, bn) pairs with equally shaped, non-transposed
    weights and the same optional tensors, stacked."""

    def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(tensors).double()

    convs, bns = [c._parameters for c, _ in pairs], [b._parameters for _, b in pairs]
    var = stacked([b._buffers["running_var"] for _, b in pairs])
    mean = stacked([b._buffers["running_mean"] for _, b in pairs])
    eps = torch.tensor([[b.eps] for _, b in pairs], dtype=torch.float64, device=var.device)
    scale = torch.rsqrt(var + eps)
    if bns[0].get("weight") is not None:
        scale = scale * stacked([p["weight"] for p in bns])
    old_bias = stacked([p["bias"] for p in convs]) if convs[0]["bias"] is not None else 0.0
    new_bias = (old_bias - mean) * scale
    if bns[0].get("bias") is not None:
        new_bias = new_bias + stacked([p["bias"] for p in bns])
    w = stacked([p["weight"] for p in convs])
    new_weight = w * scale.reshape(*scale.shape, *([1] * (w.dim() - 2)))
    dtype = convs[0]["weight"].dtype
    return new_weight.to(dtype).unbind(0), new_bias.to(dtype).unbind(0)


def _fold_module(gm: fx.GraphModule, site: _Fold, folded: tuple, shared_conv: bool) -> None:
    weight, bias = folded
    conv = site.modules[0]  # type: ignore[index]
    if shared_conv:
        conv = shared_copy(conv)  # its weights are replaced below: no need to copy them
        name = attributes.free_name(gm, f"{str(site.producer.target).replace('.', '_')}_folded")
        gm.add_submodule(name, conv)
        site.producer.target = name
    requires_grad = conv._parameters["weight"].requires_grad
    _replace_parameter(conv, "weight", nn.Parameter(weight, requires_grad=requires_grad))
    _replace_parameter(conv, "bias", nn.Parameter(bias, requires_grad=requires_grad))
    site.batch_norm.replace_all_uses_with(site.producer)
    gm.graph.erase_node(site.batch_norm)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    """``[*module.parameters(), *module.buffers()]`` read from the registries (a third of
    the fold's time on a 30k-site graph went to the generic walk); None entries are in
    the registries, not in ``parameters()`` (note_derived skips them)."""
    if module._modules:  # not a leaf: the walk finds its children's tensors too
        return [*module.parameters(), *module.buffers()]
    return [*module._parameters.values(), *module._buffers.values()]


def _replace_parameter(module: nn.Module, name: str, value: nn.Parameter) -> None:
    """``setattr(module, name, value)`` for a name already registered as a parameter.

    Conv and Linear register ``bias`` even when it is None, so both names are always there.
    Assigning into ``_parameters`` skips ``nn.Module.__setattr__``'s search of the other
    registries, which cost 60 % of the swap on a 30k-site graph; with global parameter
    registration hooks installed, the ordinary path runs them.
    """
    if name in module._parameters and not _global_parameter_registration_hooks:
        module._parameters[name] = value
    else:
        setattr(module, name, value)


def _fold_call(gm: fx.GraphModule, site: _Fold, index: int, sources: list) -> None:
    """Fold a batch norm call into the conv or linear call before it (either level)."""
    producer, bn = site.producer, site.batch_norm
    args = ops.args(bn)
    assert args is not None  # checked by the analysis
    stats = _call_statistics(gm, args)
    if site.form == "linear":
        folded = _fold_linear(gm, producer, stats, index, sources)
    else:
        conv = ops.args(producer)
        assert conv is not None
        transposed = conv.get("transposed", ops.info(producer).name == "conv_transpose")
        weight, bias = folded_weight_and_bias(
            _attr(gm, conv["weight"]),
            _attr(gm, conv["bias"]),
            stats,
            transposed=bool(transposed),
            groups=int(conv["groups"]),
        )
        sources += [_attr(gm, conv["weight"]), _attr(gm, conv["bias"]), *_tensors(stats)]
        weight_node, bias_node = _constant_nodes(gm, producer, index, weight, bias)
        ops.set_args(producer, weight=weight_node, bias=bias_node)
        folded = producer
    # An ATen batch norm's users are all getitem(·, 0) (checked by the analysis).
    for user in list(bn.users) if _returns_tuple(bn) else ():
        user.replace_all_uses_with(folded)
        gm.graph.erase_node(user)
    bn.replace_all_uses_with(folded)
    gm.graph.erase_node(bn)
    if folded is not producer:
        gm.graph.erase_node(producer)


def _fold_linear(
    gm: fx.GraphModule, matmul: fx.Node, stats: _Statistics, index: int, sources: list
) -> fx.Node:
    """``addmm(b', x, W'ᵀ)`` for ``addmm(b, x, Wᵀ)`` or ``mm(x, Wᵀ)`` (which gains a bias)."""
    args = ops.args(matmul)
    assert args is not None
    if ops.info(matmul).name == "addmm":
        old_bias, x = args["input"], args["mat1"]
    else:  # mm(input, mat2)
        old_bias, x = None, args["input"]
    transposed = args["mat2"]
    old_weight = _attr(gm, ops.args(transposed)["input"])
    weight, bias = folded_weight_and_bias(old_weight, _attr(gm, old_bias), stats)
    sources += [old_weight, _attr(gm, old_bias), *_tensors(stats)]
    new_weight, new_bias = _constant_nodes(gm, matmul, index, weight, bias)
    new_transposed = ops.emit(gm.graph, "permute", new_weight, [1, 0], like=matmul)
    linear = ops.emit(gm.graph, "addmm", new_bias, x, new_transposed, like=matmul)
    for key, value in matmul.meta.items():  # same shape, dtype and source as before
        linear.meta.setdefault(key, value)
    return linear


def _constant_nodes(gm, before: fx.Node, index: int, weight, bias):
    nodes = []
    for kind, value in (("weight", weight), ("bias", bias)):
        name = attributes.free_name(gm, f"_fxopt_fold_{index}_{kind}")
        gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
        with gm.graph.inserting_before(before):
            nodes.append(gm.graph.get_attr(name))
    return nodes
