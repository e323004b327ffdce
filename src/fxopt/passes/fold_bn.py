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
* a producer whose output has other users: they would see the folded values, and keeping
  an unfolded copy for them costs a second convolution, more than the BatchNorm saved;
* ``BatchNorm1d`` after a ``Linear`` whose output is not 2-D (then it normalizes dim 1,
  which is not the Linear's feature axis);
* a producer module with forward (pre-)hooks or parametrized weights (fx level; export
  traces both into the graph).

A conv module called at several sites (or reachable under several names, or whose weight
is also read directly by a ``get_attr`` node, as tied weights are) is not changed: the
folded call site gets a new folded copy, the other sites keep the original. The folded
module's ``state_dict``: a module-form fold rewrites the conv's weight/bias in place (the
BatchNorm module stays attached, unused); functional and ATen folds add ``_fxopt_fold_*``
attributes. Folding is for inference: parameters are treated as constants.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.nn.modules.module import _global_parameter_registration_hooks

from fxopt.ir import ops, shared
from fxopt.ir.alias import AliasAnalysis
from fxopt.passes.base import Pass, PassResult, Plan, Skip

_ATEN_BN = torch.ops.aten._native_batch_norm_legit_no_training.default
# Export spells a training-mode BatchNorm (or one without running stats) with these; their
# `training` flag is at position 5 (no_stats has no running statistics at all).
_ATEN_BN_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats
_ATEN_BN_TRAINING = (
    torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit_functional.default,
    torch.ops.aten.native_batch_norm.default,
    torch.ops.aten.batch_norm.default,
)
_ATEN_CONV = torch.ops.aten.convolution.default
_ATEN_ADDMM = torch.ops.aten.addmm.default
_ATEN_MM = torch.ops.aten.mm.default
_ATEN_PERMUTE = torch.ops.aten.permute.default
_ATEN_T = torch.ops.aten.t.default
# Modules carry their own description: every conv and conv-transpose module derives from
# _ConvNd and says `transposed`; no list of spellings needed.
_ConvNd = nn.modules.conv._ConvNd


_FORMS = ("module", "function", "aten", "aten_linear")


@dataclass(slots=True)  # not frozen: one per BatchNorm, and frozen __init__ is slow
class Site:
    form: str  # one of _FORMS
    producer: fx.Node
    batch_norm: fx.Node
    shared: bool = False  # module form: the producer module is used elsewhere
    # Module form: the producer and batch-norm modules, looked up once by the analysis.
    modules: tuple[nn.Module, nn.Module] | None = None
    # Module form, non-transposed: sites with equal keys fold in one stacked batch (see
    # _fold_module_weights). Read by the analysis while it has the tensors at hand: on a
    # model-sized graph, touching 30k modules a second time costs more than the math.
    batch: tuple | None = None


@dataclass(frozen=True)
class FoldPlan(Plan):
    sites: tuple[Site, ...] = ()


@dataclass(slots=True)  # not frozen: one per site, read once
class _Statistics:
    mean: torch.Tensor
    var: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    eps: float


class FoldBatchNorm(Pass[FoldPlan]):
    name = "fold-bn"
    description = "fold inference BatchNorm into the preceding conv / conv-transpose / linear"
    idempotent = True  # verify() re-runs the analysis and asserts it finds nothing
    adds_parameters = True  # functional and ATen folds add _fxopt_fold_* attributes
    freezes_parameters = True  # the folded weights are new tensors: no gradient reaches BN

    def analyze(self, gm: fx.GraphModule) -> FoldPlan:
        sites: list[Site] = []
        skipped: list[Skip] = []
        call_counts: dict[int, int] = {}  # filled on the first module site (a graph walk)
        table = AliasAnalysis.of(gm).info  # the op table's answers, shared with other passes
        for node in gm.graph.nodes:
            if table[node].name != "batch_norm":
                continue
            site_or_reason = self._site(gm, node, call_counts)
            if isinstance(site_or_reason, Site):
                sites.append(site_or_reason)
            else:
                skipped.append(Skip(node.name, site_or_reason))
        return FoldPlan(skipped=tuple(skipped), sites=tuple(sites))

    def _site(self, gm, bn: fx.Node, call_counts) -> Site | str:
        if bn.op == "call_module":
            return self._module_site(gm, bn, call_counts)
        if bn.op == "call_function" and bn.target is _ATEN_BN:
            return self._aten_site(gm, bn)
        if bn.op == "call_function" and bn.target is torch.nn.functional.batch_norm:
            return self._function_site(gm, bn)
        if bn.op == "call_function" and bn.target is _ATEN_BN_NO_STATS:
            return "track_running_stats=False: it normalizes with batch statistics"
        if (
            bn.op == "call_function"
            and bn.target in _ATEN_BN_TRAINING
            and (len(bn.args) > 5 and bn.args[5] is not False)
        ):
            return "batch_norm is in training mode; call model.eval() first"
        return f"{_describe(bn)} is not an inference-mode batch norm fxopt can fold"

    def _module_site(self, gm, bn: fx.Node, call_counts) -> Site | str:
        module = ops.submodule(gm, str(bn.target))
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            return f"{type(module).__name__} is not a BatchNorm module"
        if module.training:
            return "batch_norm is in training mode; call model.eval() first"
        # (Registries read directly: nn.Module.__getattr__ is slow and this runs per site.)
        if (
            module._buffers.get("running_mean") is None
            or module._buffers.get("running_var") is None
        ):
            return "track_running_stats=False: it normalizes with batch statistics"
        producer = bn.args[0] if bn.args else None
        if not isinstance(producer, fx.Node) or producer.op != "call_module":
            return "input is not a conv / conv-transpose / linear module call"
        conv = ops.submodule(gm, str(producer.target))
        if not isinstance(conv, (_ConvNd, nn.Linear)):
            return f"input is a {type(conv).__name__}, not a conv / conv-transpose / linear"
        if conv._forward_hooks or conv._forward_pre_hooks:
            # A hook may change the output the batch norm sees (or, like torch's pruning,
            # recompute the weight at every call, undoing the fold).
            return f"{producer.name} has forward hooks, which could see or undo the folding"
        # parametrize.is_parametrized(conv), without its getattr miss (an AttributeError
        # raised and caught per site): parametrizations live in a registered ModuleDict.
        if isinstance(conv._modules.get("parametrizations"), nn.ModuleDict):
            # weight is computed from other tensors at every call: it cannot be assigned.
            return f"{producer.name}'s weight is parametrized (torch.nn.utils.parametrize)"
        if isinstance(conv, nn.Linear) and _rank(producer) != 2:
            return "BatchNorm1d after a Linear with a non-2-D output normalizes another axis"
        parameters, weight = conv._parameters, conv._parameters["weight"]
        # Output channels: weight dim 0, or dim 1 times groups for a transposed conv.
        transposed = _is_transposed(conv)
        shape = weight.shape
        channels = shape[1] * conv.groups if transposed else shape[0]
        if channels != module.num_features:
            return "channel counts of the producer and the batch norm differ"
        reason = _producer_users_reason(producer, bn)
        if reason:
            return reason
        if not call_counts:
            call_counts.update(_module_call_counts(gm))
        shared = call_counts.get(id(conv), 0) > 1
        batch = None
        if not transposed:
            bn_parameters = module._parameters
            batch = (
                shape,
                weight.dtype,
                weight.device,
                parameters["bias"] is None,
                bn_parameters.get("weight") is None,
                bn_parameters.get("bias") is None,
                module._buffers["running_mean"].dtype,
            )
        return Site("module", producer, bn, shared, (conv, module), batch)

    def _function_site(self, gm, bn: fx.Node) -> Site | str:
        kwargs = _normalized(bn)
        if kwargs is None:
            return "cannot normalize the batch_norm arguments"
        if kwargs.get("training") is not False:
            return "batch_norm is in training mode (training=True); call model.eval() first"
        for key in ("running_mean", "running_var", "weight", "bias"):
            value = kwargs.get(key)
            if value is None and key in ("running_mean", "running_var"):
                return "no running statistics: it normalizes with batch statistics"
            if value is not None and not _is_constant(value):
                return f"{key} is not a constant attribute"
        producer = kwargs["input"]
        is_conv = (
            isinstance(producer, fx.Node)
            and producer.op == "call_function"
            and (ops.is_call(producer, "conv", gm) or ops.is_call(producer, "conv_transpose", gm))
        )
        if not is_conv:
            return "input is not a functional convolution"
        conv_kwargs = _normalized(producer)
        if conv_kwargs is None or not _is_constant(conv_kwargs.get("weight")):
            return "convolution weight is not a constant attribute"
        if conv_kwargs.get("bias") is not None and not _is_constant(conv_kwargs["bias"]):
            return "convolution bias is not a constant attribute"
        reason = _producer_users_reason(producer, bn)
        return reason or Site("function", producer, bn)

    def _aten_site(self, gm, bn: fx.Node) -> Site | str:
        conv, weight, bias, mean, var = bn.args[:5]
        for name, value in (
            ("running_mean", mean),
            ("running_var", var),
            ("weight", weight),
            ("bias", bias),
        ):
            if value is not None and not _is_constant(value):
                return f"{name} is not a constant attribute"
        if isinstance(conv, fx.Node) and conv.target in (_ATEN_ADDMM, _ATEN_MM):
            return self._aten_linear_site(conv, bn)
        if _is_view_of_matmul(conv):
            # A Linear on a 3-D input is view → (add)mm → view at ATen level.
            return "BatchNorm1d after a Linear with a non-2-D output normalizes another axis"
        if not (isinstance(conv, fx.Node) and conv.target is _ATEN_CONV):
            return "input is not aten.convolution or a linear (aten.addmm / aten.mm)"
        if not _is_constant(conv.args[1]) or (
            conv.args[2] is not None and not _is_constant(conv.args[2])
        ):
            return "convolution weight or bias is not a constant attribute"
        if any(not _is_getitem(user, 0) for user in bn.users):
            return "the batch norm's saved statistics are used"
        reason = _producer_users_reason(conv, bn)
        return reason or Site("aten", conv, bn)

    def _aten_linear_site(self, addmm: fx.Node, bn: fx.Node) -> Site | str:
        # Linear at ATen level, 2-D by construction: addmm(bias, x, permute(W, [1, 0])), or
        # mm(x, permute(W, [1, 0])) without bias (the fold then adds one: addmm).
        if addmm.target is _ATEN_MM:
            bias, (_, transposed_weight) = None, addmm.args[:2]
        else:
            bias, _, transposed_weight = addmm.args[:3]
        if addmm.kwargs.get("beta", 1) != 1 or addmm.kwargs.get("alpha", 1) != 1:
            return "addmm with alpha/beta is not a plain linear"
        if (bias is not None and not _is_constant(bias)) or not _is_transposed_constant(
            transposed_weight
        ):
            return "matmul operands are not a constant bias and a transposed constant weight"
        if any(not _is_getitem(user, 0) for user in bn.users):
            return "the batch norm's saved statistics are used"
        reason = _producer_users_reason(addmm, bn)
        return reason or Site("aten_linear", addmm, bn)

    def transform(self, gm: fx.GraphModule, plan: FoldPlan) -> PassResult:
        module_sites = [s for s in plan.sites if s.form == "module"]
        folded = iter(_fold_module_weights(module_sites))  # in module_sites' order
        # A module fold only moves the BatchNorm's users to the conv: the shared alias
        # analysis follows it. The other forms add nodes, so the next pass rebuilds it.
        alias = shared.peek(gm, "alias") if len(module_sites) == len(plan.sites) else None
        for index, site in enumerate(plan.sites):
            if site.form == "module":
                _fold_module(gm, site, next(folded))
                if alias is not None:
                    alias.replace(site.batch_norm, site.producer)
            elif site.form == "function":
                _fold_function(gm, site, index)
            elif site.form == "aten_linear":
                _fold_aten_linear(gm, site, index)
            else:
                _fold_aten(gm, site, index)
        counts = Counter(s.form for s in plan.sites)
        stats = {"folded": len(plan.sites)}
        stats.update((form, counts[form]) for form in _FORMS if counts[form])
        copied = sum(s.shared for s in plan.sites)
        if copied:
            stats["copied_shared"] = copied
        return PassResult(
            bool(plan.sites), stats, plan.skipped, keeps=("alias",) if alias is not None else ()
        )

    def verify(self, gm: fx.GraphModule) -> None:
        left = self.analyze(gm).sites
        assert not left, f"foldable batch norms left: {[s.batch_norm.name for s in left]}"


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


def _producer_users_reason(producer: fx.Node, bn: fx.Node) -> str | None:
    users = producer.users
    if len(users) != 1 or bn not in users:
        others = ", ".join(u.name for u in producer.users if u is not bn)
        return (
            f"{producer.name}'s output is also used by {others}: they would see folded "
            "values, and an unfolded copy would cost a second convolution"
        )
    return None


def _rank(node: fx.Node) -> int | None:
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return len(meta.shape)
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def _is_transposed(module: nn.Module) -> bool:
    return isinstance(module, _ConvNd) and module.transposed


def _is_constant(value: object) -> bool:
    return isinstance(value, fx.Node) and value.op == "get_attr"


def _is_transposed_constant(node: object) -> bool:
    if not isinstance(node, fx.Node) or not _is_constant(node.args[0] if node.args else None):
        return False
    if node.target is _ATEN_T:
        return True
    return node.target is _ATEN_PERMUTE and list(node.args[1]) == [1, 0]


def _is_view_of_matmul(node: object) -> bool:
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    return (
        isinstance(node, fx.Node)
        and node.target in views
        and isinstance(node.args[0], fx.Node)
        and node.args[0].target in (_ATEN_ADDMM, _ATEN_MM)
    )


def _is_getitem(node: fx.Node, index: int) -> bool:
    import operator

    return (
        node.op == "call_function" and node.target is operator.getitem and (node.args[1] == index)
    )


# Positional parameter names of the functional forms (torch.nn.functional's signatures;
# F.conv2d and friends are builtins that inspect.signature cannot read).
_CONV_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_T_PARAMS = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "output_padding",
    "groups",
    "dilation",
)
_BN_PARAMS = (
    "input",
    "running_mean",
    "running_var",
    "weight",
    "bias",
    "training",
    "momentum",
    "eps",
)


def _normalized(node: fx.Node) -> dict | None:
    """The call's arguments as one keyword dict, or None for an unknown signature."""
    if node.target is torch.nn.functional.batch_norm:
        names = _BN_PARAMS
    elif ops.is_call(node, "conv_transpose"):
        names = _CONV_T_PARAMS
    elif ops.is_call(node, "conv"):
        names = _CONV_PARAMS
    else:
        return None
    if len(node.args) > len(names):
        return None
    kwargs = dict(zip(names, node.args))
    kwargs.update(node.kwargs)
    return kwargs


def _attr(gm: fx.GraphModule, node: fx.Node | None) -> torch.Tensor | None:
    if node is None:
        return None
    value: object = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    assert isinstance(value, torch.Tensor)
    return value


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


def _module_statistics(bn_module: nn.Module) -> _Statistics:
    buffers, parameters = bn_module._buffers, bn_module._parameters
    return _Statistics(
        buffers["running_mean"],
        buffers["running_var"],
        parameters.get("weight"),
        parameters.get("bias"),
        bn_module.eps,
    )


def _fold_module_weights(sites: list[Site]) -> list[tuple]:
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


def _fold_module(gm: fx.GraphModule, site: Site, folded: tuple) -> None:
    weight, bias = folded
    conv = site.modules[0]  # type: ignore[index]
    if site.shared:
        conv = copy.deepcopy(conv)
        name = _free_name(gm, f"{str(site.producer.target).replace('.', '_')}_folded")
        gm.add_submodule(name, conv)
        site.producer.target = name
    requires_grad = conv._parameters["weight"].requires_grad
    _replace_parameter(conv, "weight", nn.Parameter(weight, requires_grad=requires_grad))
    _replace_parameter(conv, "bias", nn.Parameter(bias, requires_grad=requires_grad))
    site.batch_norm.replace_all_uses_with(site.producer)
    gm.graph.erase_node(site.batch_norm)


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


def _fold_function(gm: fx.GraphModule, site: Site, index: int) -> None:
    bn_kwargs = _normalized(site.batch_norm)
    conv_kwargs = _normalized(site.producer)
    assert bn_kwargs is not None and conv_kwargs is not None  # checked by analyze
    stats = _Statistics(
        _attr(gm, bn_kwargs["running_mean"]),
        _attr(gm, bn_kwargs["running_var"]),
        _attr(gm, bn_kwargs.get("weight")),
        _attr(gm, bn_kwargs.get("bias")),
        float(bn_kwargs.get("eps", 1e-5)),
    )
    transposed = ops.is_call(site.producer, "conv_transpose")
    weight, bias = folded_weight_and_bias(
        _attr(gm, conv_kwargs["weight"]),
        _attr(gm, conv_kwargs.get("bias")),
        stats,
        transposed=transposed,
        groups=int(conv_kwargs.get("groups", 1)),
    )
    weight_node, bias_node = _constant_nodes(gm, site.producer, index, weight, bias)
    conv_kwargs["weight"], conv_kwargs["bias"] = weight_node, bias_node
    site.producer.args, site.producer.kwargs = (), conv_kwargs
    site.batch_norm.replace_all_uses_with(site.producer)
    gm.graph.erase_node(site.batch_norm)


def _fold_aten(gm: fx.GraphModule, site: Site, index: int) -> None:
    conv, bn = site.producer, site.batch_norm
    _, weight_node, bias_node, mean, var, _momentum, eps = bn.args[:7]
    stats = _Statistics(
        _attr(gm, mean), _attr(gm, var), _attr(gm, weight_node), _attr(gm, bias_node), float(eps)
    )
    transposed, groups = bool(conv.args[6]), int(conv.args[8])
    weight, bias = folded_weight_and_bias(
        _attr(gm, conv.args[1]),
        _attr(gm, conv.args[2]),
        stats,
        transposed=transposed,
        groups=groups,
    )
    new_weight, new_bias = _constant_nodes(gm, conv, index, weight, bias)
    args = list(conv.args)
    args[1], args[2] = new_weight, new_bias
    conv.args = tuple(args)
    for user in list(bn.users):
        user.replace_all_uses_with(conv)
        gm.graph.erase_node(user)
    gm.graph.erase_node(bn)


def _fold_aten_linear(gm: fx.GraphModule, site: Site, index: int) -> None:
    addmm, bn = site.producer, site.batch_norm
    _, weight_node, bias_node, mean, var, _momentum, eps = bn.args[:7]
    stats = _Statistics(
        _attr(gm, mean), _attr(gm, var), _attr(gm, weight_node), _attr(gm, bias_node), float(eps)
    )
    if addmm.target is _ATEN_MM:
        (x, transposed), old_bias, rest = addmm.args[:2], None, ()
    else:
        (old_bias, x, transposed), rest = addmm.args[:3], addmm.args[3:]
    weight, bias = folded_weight_and_bias(_attr(gm, transposed.args[0]), _attr(gm, old_bias), stats)
    new_weight, new_bias = _constant_nodes(gm, addmm, index, weight, bias)
    with gm.graph.inserting_before(addmm):
        new_transposed = gm.graph.call_function(_ATEN_PERMUTE, (new_weight, [1, 0]))
        linear = gm.graph.call_function(
            _ATEN_ADDMM, (new_bias, x, new_transposed, *rest), dict(addmm.kwargs)
        )
    linear.meta.update(addmm.meta)
    for user in list(bn.users):
        user.replace_all_uses_with(linear)
        gm.graph.erase_node(user)
    gm.graph.erase_node(bn)
    gm.graph.erase_node(addmm)


def _constant_nodes(gm, before: fx.Node, index: int, weight, bias):
    nodes = []
    for kind, value in (("weight", weight), ("bias", bias)):
        name = _free_name(gm, f"_fxopt_fold_{index}_{kind}")
        gm.register_parameter(name, nn.Parameter(value, requires_grad=False))
        with gm.graph.inserting_before(before):
            nodes.append(gm.graph.get_attr(name))
    return nodes


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, suffix = base, 0
    while hasattr(gm, name):
        suffix += 1
        name = f"{base}_{suffix}"
    return name
