"""transformers' decoder-only language models (Llama, Qwen2, Mistral, Gemma 3; small
configs, random weights, nothing downloaded) through optimize (prefill with a padding
mask; a decode step on a DynamicCache), remat (the LM loss with a padding mask and
attention dropout) and convert (prefill, bfloat16). Skipped without transformers."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fxopt
from fxopt.errors import CaptureError, InputMismatchError

transformers = pytest.importorskip("transformers")

VOCAB = 128
WINDOW = 16  # (sliding window of Mistral and Gemma 3: wider than every test's sequence)


def decoder(kind: str, **overrides) -> torch.nn.Module:
    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **overrides,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=WINDOW)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(**common, head_dim=8, sliding_window=WINDOW)
        model = transformers.Gemma3ForCausalLM(config)
    return model.eval()


KINDS = ["llama", "qwen2", "mistral", "gemma3"]


def ids(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def padded(batch: int, length: int, pad: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, :pad] = 0  # left padding on the last row
    return mask


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_with_a_padding_mask_gives_eagers_logits_on_other_inputs(kind):
    torch.manual_seed(0)
    model = decoder(kind, use_cache=False)
    # (The layout race, which calls the model again and again, on one family: time.)
    example = (ids(2, 8, 0), padded(2, 8, 3))
    result = fxopt.optimize(model, example, benchmark_runs=0, autotune=kind == "llama")
    assert result.report["verified"] and result.report["mode"] == "export"
    # Other tokens, other padding, another batch (dim 0 is dynamic unless the note says).
    batch = 3 if "input_ids.shape[0]" in result.report["dynamic"] else 2
    other = (ids(batch, 8, 1), padded(batch, 8, 5))
    with torch.no_grad():
        expected = model(*other).logits
        torch.testing.assert_close(result.module(*other).logits, expected)


def _prefilled(model, length: int, seed: int):
    with torch.no_grad():
        return model(ids(1, length, seed), use_cache=True).past_key_values


@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_on_a_dynamic_cache_of_other_lengths(kind):
    torch.manual_seed(0)
    model = decoder(kind)
    cache = _prefilled(model, 6, 0)
    length = cache.get_seq_length()
    result = fxopt.optimize(
        model,
        (ids(1, 1, 1), None, None, cache),
        dynamic="all",
        benchmark_runs=0,
        autotune=kind == "llama",  # (the layout race, which once grew the cache, on one)
    )
    assert result.report["verified"]
    assert cache.get_seq_length() == length  # the example cache is not grown by optimize
    assert any(d.startswith("cache_key_cache_0.shape[2]") for d in result.report["dynamic"])
    # A cache of another length; the module grows the object it is given, as eager does.
    eager_cache, fx_cache = _prefilled(model, 11, 2), _prefilled(model, 11, 2)
    token = ids(1, 1, 3)
    with torch.no_grad():
        expected = model(token, None, None, eager_cache)
        got = result.module(token, None, None, fx_cache)
    torch.testing.assert_close(got.logits, expected.logits)
    assert got.past_key_values is fx_cache and fx_cache.get_seq_length() == 12
    for mine, theirs in zip(fx_cache.layers, eager_cache.layers, strict=True):
        assert type(mine) is type(theirs) and _state(mine) == _state(theirs)
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


@pytest.mark.skipif(not torch._C.has_mkl, reason="this PyTorch build has no MKL")
@pytest.mark.parametrize("kind", KINDS)
def test_decode_step_with_merged_projections_gives_eagers_logits(kind, monkeypatch):
    # q/k/v (Qwen2's with biases) and gate/up as one packed GEMM each (merge-linears).
    from fxopt import layout
    from fxopt.passes import gemm_timing

    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", True)
    monkeypatch.setattr(layout, "sampled_gain", lambda gm: None)  # (tiny shapes: slower)
    torch.manual_seed(0)
    model = decoder(kind)
    cache = _prefilled(model, 6, 0)
    example = (ids(1, 1, 1), None, None, cache)
    result = fxopt.optimize(
        model, example, dynamic="all", benchmark_runs=0, layout="onednn_inductor"
    )
    assert result.report["verified"]
    assert result.report["layout"]["merged_linears"] == "10 in 4 GEMMs"  # 2 layers
    assert result.report["layout"]["inductor_regions"]["whole_graph"] == "compiled"
    # The whole graph is compiled for the cache's length symbolic: a generation loop, whose
    # cache grows by a token a step, runs it at every length.
    whole = result.module.get_submodule("_fxopt_whole_graph")
    eager_calls = []
    whole.eager.register_forward_pre_hook(lambda module, args: eager_calls.append(1))
    for length, seed in ((6, 0), (11, 2)):  # the example's length, another
        eager_cache, fx_cache = _prefilled(model, length, seed), _prefilled(model, length, seed)
        token = ids(1, 1, 3 + seed)
        with torch.no_grad():
            expected = model(token, None, None, eager_cache)
            got = result.module(token, None, None, fx_cache)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fx_cache.layers[0].keys, eager_cache.layers[0].keys)
    assert not eager_calls


def _state(layer) -> dict:
    return {k: v for k, v in vars(layer).items() if not isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_the_returned_cache_holds_the_graphs_tensors_not_copies(kind):
    # transformers' own rebuild appends each tensor to an empty one: a copy of the cache.
    from torch.utils import _pytree as pytree

    from fxopt import caches

    model = decoder(kind)
    cache = _prefilled(model, 6, 0)
    caches.register(model, (cache,))  # (what optimize does first: caches become pytrees)
    leaves, spec = pytree.tree_flatten(cache)
    theirs = pytree.tree_unflatten(leaves, spec)
    mine = caches.returned_without_copies(spec)
    assert mine != spec
    rebuilt = pytree.tree_unflatten(leaves, mine)
    assert type(rebuilt) is type(theirs)
    n = len(theirs.layers)
    for index, (a, b) in enumerate(zip(rebuilt.layers, theirs.layers, strict=True)):
        assert type(a) is type(b) and _state(a) == _state(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        if type(a).__name__ == "DynamicLayer":
            assert a.keys is leaves[index] and a.values is leaves[n + index]
        else:  # (a sliding-window layer counts its tokens: transformers' own rebuild)
            assert a.keys is not leaves[index]
    # The optimized decode step returns its cache that way.
    result = fxopt.optimize(model, (ids(1, 1, 1), None, None, cache), benchmark_runs=0)
    assert "_GrownCache" in repr(result.module.graph._codegen.pytree_info.out_spec)


def test_a_sliding_window_cache_past_its_window_is_refused_not_miscomputed():
    # Past its window, a sliding layer counts tokens the tensors no longer hold: a graph
    # would rebuild the cache with the wrong count and compute another mask.
    torch.manual_seed(0)
    model = decoder("mistral")
    with pytest.raises(CaptureError, match="cumulative_length = 20"):
        fxopt.optimize(
            model, (ids(1, 1, 1), None, None, _prefilled(model, 20, 0)), benchmark_runs=0
        )
    example = (ids(1, 1, 1), None, None, _prefilled(model, 6, 0))
    result = fxopt.optimize(model, example, dynamic="all", benchmark_runs=0, autotune=False)
    with pytest.raises(InputMismatchError, match="sliding-window layer past its window"):
        result.module(ids(1, 1, 2), None, None, _prefilled(model, 20, 3))


def test_each_call_checks_a_plain_cache_without_rebuilding_it(monkeypatch):
    # Rebuilding a DynamicCache (transformers appends each tensor to an empty one) copies
    # the whole cache: at batch 8 and 1024 tokens that check cost more than attention.
    from fxopt import caches

    model = decoder("llama")
    example = (ids(1, 1, 1), None, None, _prefilled(model, 6, 0))
    result = fxopt.optimize(model, example, dynamic="all", benchmark_runs=0, autotune=False)
    cache = _prefilled(model, 9, 2)
    with torch.no_grad():
        expected = model(ids(1, 1, 4), None, None, copy.deepcopy(cache)).logits

    def no_rebuild(*args):
        raise AssertionError("the cache was rebuilt to check it")

    monkeypatch.setattr(caches.pytree, "tree_unflatten", no_rebuild)
    assert caches.unfaithful((cache,)) is None
    mistral = decoder("mistral")  # its sliding layers count tokens: checked by a rebuild
    with pytest.raises(AssertionError, match="rebuilt to check"):
        caches.unfaithful((_prefilled(mistral, 6, 0),))
    monkeypatch.undo()
    with torch.no_grad():
        got = result.module(ids(1, 1, 4), None, None, cache).logits
    torch.testing.assert_close(got, expected)


def test_the_model_itself_is_a_layout_candidate_for_a_decode_step():
    # Its graph calls the model with a cache rebuilt from the graph's inputs when it runs
    # (around graph nodes transformers' rebuild failed: "'Node' object has no attribute
    # 'device'").
    torch.manual_seed(0)
    model = decoder("llama")
    example = (ids(1, 1, 1), None, None, _prefilled(model, 6, 0))
    result = fxopt.optimize(model, example, dynamic="all", benchmark_runs=0, layout="original")
    assert result.report["layout"]["chosen"] == "original"
    cache = _prefilled(model, 9, 2)
    with torch.no_grad():
        want = model(ids(1, 1, 5), None, None, copy.deepcopy(cache))
        got = result.module(ids(1, 1, 5), None, None, cache)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert got.past_key_values is cache and cache.get_seq_length() == 10
    # A prefill returns transformers' output class holding a new cache: flattened as the
    # call returns it ("'DynamicCache' object is not subscriptable" before).
    prefill = fxopt.optimize(model, (ids(1, 5, 3),), benchmark_runs=0, layout="original")
    with torch.no_grad():
        want, got = model(ids(1, 5, 4)), prefill.module(ids(1, 5, 4))
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    assert got.past_key_values.get_seq_length() == 5


def test_verification_keys_a_cache_by_its_tensors():
    # Two input sets that differ only in their cache are two sets: keyed by the cache's
    # repr, the second reused the first's expected output (a false "outputs differ").
    from fxopt import verify

    torch.manual_seed(0)
    model = decoder("llama")
    token = ids(1, 1, 1)
    short, long = (
        (token, None, None, _prefilled(model, 1, 0)),
        (token, None, None, _prefilled(model, 6, 0)),
    )
    expected: dict = {}
    assert verify.check_outputs(model, model, long, random_sets=0, _expected_cache=expected).ok
    check = verify.check_outputs(model, model, short, random_sets=0, _expected_cache=expected)
    assert check.ok, check.message
    assert len(expected) == 2


def test_the_float64_judgement_leaves_the_callers_cache_alone():
    from fxopt import verify

    torch.manual_seed(0)
    model = decoder("llama")
    cache = _prefilled(model, 4, 0)
    inputs = (ids(1, 1, 1), None, None, cache)
    with torch.no_grad():
        expected = model(*copy.deepcopy(inputs))
    # (the float64 run takes place: the float32 output is as close to it as itself)
    assert verify.within_float32_error(model, inputs, expected, expected, seed=0)
    assert cache.get_seq_length() == 4 and cache.layers[0].keys.dtype == torch.float32


@pytest.mark.parametrize("kind", KINDS)
def test_remat_lm_loss_with_a_padding_mask_and_attention_dropout(kind):
    from fxopt.remat import compile_step

    torch.manual_seed(0)
    model = decoder(kind, attention_dropout=0.1).train()
    inputs = (ids(2, 8, 0), padded(2, 8, 3))

    def lm_loss(model, input_ids, mask):
        return model(input_ids=input_ids, attention_mask=mask, labels=input_ids).loss

    def gradients(step_or_model, budget_model, seed):
        for p in budget_model.parameters():
            p.grad = None
        torch.manual_seed(seed)
        loss = step_or_model(*inputs)
        return loss.detach(), {n: p.grad.clone() for n, p in budget_model.named_parameters()}

    eager = copy.deepcopy(model)
    full = copy.deepcopy(model)
    planned = compile_step(model, lm_loss, inputs, memory_budget=0.5)
    unplanned = compile_step(full, lm_loss, inputs, memory_budget=1.0)
    assert planned.report()["optimized"]["peak_activation_bytes"] < (
        0.75 * planned.report()["baseline"]["peak_activation_bytes"]
    )
    loss, grads = gradients(planned, model, seed=5)
    full_loss, full_grads = gradients(unplanned, full, seed=5)
    # Recomputation changes no bit of what the captured step computes (dropout included)...
    assert torch.equal(loss, full_loss)
    assert all(torch.equal(grads[n], full_grads[n]) for n in grads)

    def eager_step(*xs):
        value = lm_loss(eager, *xs)
        value.backward()
        return value

    # ... and the step computes eager's loss and gradients (AOT's decompositions round
    # a few ulps differently).
    eager_loss, eager_grads = gradients(eager_step, eager, seed=5)
    torch.testing.assert_close(loss, eager_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_convert_prefill_of_a_bfloat16_decoder(kind):
    from fxopt import circle

    torch.manual_seed(0)
    model = decoder(kind, use_cache=False).to(torch.bfloat16)
    converted = circle.convert(model, (ids(1, 8, 0),))
    assert converted.validation.validated, converted.validation.message
    assert converted.report["widened_from"] == "bfloat16"
    assert next(model.parameters()).dtype == torch.bfloat16  # the user's model as it was


def test_greedy_generation_with_the_optimized_decode_step():
    # The recipe of docs/language_models.md: prefill eagerly, then the optimized step.
    torch.manual_seed(0)
    model = decoder("llama")
    prompt = ids(1, 5, 0)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
    step = fxopt.optimize(
        model, (ids(1, 1, 1), None, None, cache), dynamic="all", benchmark_runs=0, autotune=False
    ).module

    def generate(step, model, prompt, new_tokens):
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            cache, tokens = out.past_key_values, [out.logits[:, -1:].argmax(-1)]
            for _ in range(new_tokens - 1):
                out = step(tokens[-1], None, None, cache)
                tokens.append(out.logits[:, -1:].argmax(-1))
        return torch.cat(tokens, dim=1)

    tokens = generate(step, model, prompt, 12)
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(tokens, expected[:, prompt.shape[1] :])


def test_a_decode_step_optimized_under_autocast_keeps_eagers_dtypes_and_cache():
    # Export records autocast's casts; the grouped attention, the kept SDPA and the cache
    # returned without copies must give eager's bfloat16 logits and its cache.
    torch.manual_seed(0)
    model = decoder("llama")
    token = ids(1, 1, 1)
    with torch.autocast("cpu", torch.bfloat16):
        cache = _prefilled(model, 6, 0)
        result = fxopt.optimize(model, (token, None, None, cache), benchmark_runs=0)
        grouped = [
            r["stats"]["grouped"] for r in result.report["passes"] if r["name"] == "gqa-attention"
        ]
        assert sum(grouped) >= 1
        eager_cache, fx_cache = _prefilled(model, 6, 0), _prefilled(model, 6, 0)
        with torch.no_grad():
            expected = model(token, None, None, eager_cache)
            got = result.module(token, None, None, fx_cache)
    assert got.logits.dtype == expected.logits.dtype
    torch.testing.assert_close(got.logits, expected.logits)
    for mine, theirs in zip(fx_cache.layers, eager_cache.layers, strict=True):
        assert mine.keys.dtype == theirs.keys.dtype
        torch.testing.assert_close(mine.keys, theirs.keys)
        torch.testing.assert_close(mine.values, theirs.values)


class _DecodeStep(torch.nn.Module):
    """One decode step with the DynamicCache as plain tensors, in and out (the form a
    Circle file takes)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, *cache):
        past = transformers.DynamicCache()
        for layer in range(len(cache) // 2):
            past.update(cache[2 * layer], cache[2 * layer + 1], layer)
        out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
        grown = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *grown)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_weight_only_prefill_and_decode_validate_in_onert(kind, fmt):
    pytest.importorskip("onert")
    from fxopt import circle
    from fxopt.quant.ggml import weight_only

    torch.manual_seed(0)
    model = decoder(kind, use_cache=False)
    prefill = circle.convert(model, (ids(1, 8, 0),), config=circle.CircleConfig(weight_only=fmt))
    section = prefill.report["weight_only"]
    # q, k, v, o, gate, up, down per layer, the head, and in q4_0 the embedding table
    linears = 7 * 2 + 1
    assert prefill.validation.validated
    assert section["replaced"] == linears + (fmt == "q4_0")
    assert section["vs_float"]["sqnr_db"][0] > (25 if fmt == "q8_0" else 5)

    with torch.no_grad():
        cache = model(ids(1, 7, 1), use_cache=True).past_key_values
    tensors = tuple(t.contiguous() for layer in cache.layers for t in (layer.keys, layer.values))
    step = _DecodeStep(model).eval()
    decode = circle.convert(
        step, (ids(1, 1, 2), *tensors), config=circle.CircleConfig(weight_only=fmt)
    )
    assert decode.validation.validated, decode.validation.message
    assert decode.report["weight_only"]["replaced"] == linears + (fmt == "q4_0")
    quantized, _ = weight_only(step, fmt)
    grown = decode.run(ids(1, 1, 3), *tensors)  # another token on the same cache
    with torch.no_grad():
        expected = quantized(ids(1, 1, 3), *tensors)
    for got, want in zip(grown[1:], expected[1:], strict=True):  # the cache: one new row
        assert np.abs(got - want.numpy()).max() <= 1e-3 * float(want.abs().max())
