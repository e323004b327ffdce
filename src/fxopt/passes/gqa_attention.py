"""gqa-attention: attention over repeated key/value heads → SDPA's own grouped-query form.

Grouped-query attention (Llama, Qwen, Mistral, Gemma) keeps fewer key/value heads than
query heads. transformers, and most code written before ``enable_gqa`` existed, repeat
each key/value head for its group before attention (``repeat_kv``)::

    k_rep = k[:, :, None].expand(B, kv, rep, L, D).reshape(B, kv·rep, L, D)    (same for v)
    scaled_dot_product_attention(q, k_rep, v_rep, mask)
        →  scaled_dot_product_attention(q, k, v, mask, enable_gqa=True)

The reshape of an expand copies the cache ``rep`` times on every call: on a decode step
that is the whole KV cache, once per layer (at batch 8 and 1024 cached tokens one such
attention took 24 ms on this machine, 1.3 ms with ``enable_gqa``). SDPA's grouped form
reads query head ``h`` against key/value head ``h // rep``, which is the head the repeat
put there, so the output is the same value (the same kernel runs on the same numbers:
bit for bit in tests/test_gqa_attention.py, NaN and masks included); gradients of the
key and value sum the group in another order (within float32 rounding).

Left alone, with the reason: a repeat on another dim or that broadcasts other dims,
key and value repeated differently, query heads that are not ``kv·rep``, attention with
dropout (its random draws are not re-derived here) or already grouped, and what the rule
engine refuses for every rule (:mod:`fxopt.passes.rules`), such as a repeated key read
elsewhere too.

    >>> import torch
    >>> from fxopt.capture import trace
    >>> from fxopt.passes import PassManager
    >>> class Attention(torch.nn.Module):
    ...     def forward(self, q, k, v):
    ...         def repeat(x):
    ...             return x[:, :, None].expand(1, 2, 4, 16, 8).reshape(1, 8, 16, 8)
    ...         return torch.nn.functional.scaled_dot_product_attention(q, repeat(k), repeat(v))
    >>> q, kv = torch.randn(1, 8, 16, 8), torch.randn(1, 2, 16, 8)
    >>> gm = trace(Attention(), (q, kv, kv.clone()))
    >>> result = PassManager([GqaAttention()]).run(gm)
    >>> result.records[0].stats["grouped"]
    1
"""

from __future__ import annotations

import torch
from torch import fx

from fxopt.ir import facts, meta, ops
from fxopt.ir.pattern import ABSENT, Match, Op, Var
from fxopt.passes.rules import Rule, RulePass

_SAME_LAYOUT = ABSENT | torch.preserve_format | torch.contiguous_format


def _repeated(name: str) -> Op:
    """reshape(expand(x[:, :, None])): ``repeat_kv`` at either capture level (ATen spells
    the reshape of an expand ``view(clone(...))`` once decomposed)."""
    unsqueeze = Op(("unsqueeze", "getitem"), input=Var(name), bind=f"{name} unsqueeze")
    expand = Op("expand", input=unsqueeze, bind=f"{name} expand")
    clone = Op("clone", input=expand, memory_format=_SAME_LAYOUT, optional="input")
    return Op(("reshape", "view"), input=clone, bind=f"{name} reshape")


def _cast(name: str) -> Op:
    """The repeat, or autocast's cast of it to attention's dtype (what export records
    under ``torch.autocast``): casting repeats of a value is repeating its cast."""
    return Op("to", input=_repeated(name), bind=f"{name} cast", optional="input")


class RepeatedKeyValues(Rule):
    name, stat = "repeat_kv → enable_gqa", "grouped"
    pattern = Op(
        "scaled_dot_product_attention",
        query=Var("q"),
        key=_cast("k"),
        value=_cast("v"),
        dropout_p=ABSENT | 0 | 0.0,
        enable_gqa=ABSENT | False,
    )

    def check(self, match: Match) -> str | None:
        groups = []
        for side in ("k", "v"):
            reason, group = _repeat_of(match, side)
            if reason is not None:
                return reason
            groups.append(group)
        casts = [_cast_problem(match, side) for side in ("k", "v")]
        if any(casts):
            return next(c for c in casts if c)
        (kv, rep), (kv_v, rep_v) = groups
        if not (facts.equal(kv, kv_v) and facts.equal(rep, rep_v)):
            return "key and value are repeated differently"
        q = meta.sizes(match["q"])
        if q is None or len(q) != 4 or not facts.equal(q[1], kv * rep):
            return "query heads are not key/value heads × repeats"
        return None

    def build(self, graph: fx.Graph, match: Match) -> fx.Node:
        args = dict(ops.args(match.root))
        key, value = (_cast_again(graph, match, side) for side in ("k", "v"))
        args.update(key=key, value=value, enable_gqa=True)
        query, key, value = args.pop("query"), args.pop("key"), args.pop("value")
        return ops.emit(
            graph, "scaled_dot_product_attention", query, key, value, like=match.root, **args
        )


def _cast_problem(match: Match, side: str) -> str:
    """Why ``side``'s cast cannot move before the repeat (empty when there is none, or it
    changes the dtype alone)."""
    cast = match.get(f"{side} cast")
    if cast is None:
        return ""
    extra = {k: v for k, v in ops.args(cast).items() if k not in ("input", "dtype")}
    if any(v is not None and v is not False for v in extra.values()):
        return f"{cast.name} changes more than the dtype"
    return ""


def _cast_again(graph: fx.Graph, match: Match, side: str) -> fx.Node:
    """``side``'s unrepeated value, cast as its repeat was (a copy of the cast node)."""
    cast = match.get(f"{side} cast")
    if cast is None:
        return match[side]
    repeated = ops.args(cast)["input"]
    with graph.inserting_before(match.root):
        moved = graph.node_copy(cast, lambda n: match[side] if n is repeated else n)
    moved.meta.pop("val", None)
    moved.meta.pop("tensor_meta", None)
    return moved


def _repeat_of(match: Match, side: str) -> tuple[str | None, tuple]:
    """(None, (kv, rep)) when ``side``'s chain repeats each of the kv heads of a 4-D
    (B, kv, L, D) tensor rep times in place, for every allowed input; else the reason."""
    x = match[side]
    unsqueeze, expand, reshape = (match[f"{side} {s}"] for s in ("unsqueeze", "expand", "reshape"))
    sizes = meta.sizes(x)
    if sizes is None or len(sizes) != 4:
        return "a key/value is not 4-D", ()
    if not _inserts_dim_2(ops.args(unsqueeze)):
        return f"{unsqueeze.name} does not insert the group dim after the heads", ()
    expanded = meta.sizes(expand)
    if expanded is None or len(expanded) != 5:
        return f"{expand.name}: shape unknown", ()
    if not all(facts.equal(a, b) for a, b in zip(expanded[:2] + expanded[3:], sizes)):
        return f"{expand.name} broadcasts a dim other than the group", ()
    kv, rep = sizes[1], expanded[2]
    merged = meta.sizes(reshape)
    if merged is None or len(merged) != 4:
        return f"{reshape.name} does not merge the heads", ()
    wanted = (sizes[0], kv * rep, sizes[2], sizes[3])
    if not all(facts.equal(a, b) for a, b in zip(merged, wanted)):
        return f"{reshape.name} does not merge (heads, group) into one dim", ()
    return None, (kv, rep)


def _inserts_dim_2(args: dict) -> bool:
    """unsqueeze(x, 2), or x[:, :, None] / x[:, :, None, :, :] at the module level."""
    if "dim" in args:
        return args["dim"] in (2, -3)
    index = args.get("index")
    whole = slice(None)
    return (
        isinstance(index, tuple)
        and index[:3] == (whole, whole, None)
        and all(i == whole or i is Ellipsis for i in index[3:])
    )


class GqaAttention(RulePass):
    name = "gqa-attention"
    description = "attention over repeated key/value heads → SDPA with enable_gqa"
    counters, leftovers = ("grouped",), "repeated key/value heads"
    rules = (RepeatedKeyValues(),)
