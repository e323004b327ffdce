"""The model zoo: every model builds, runs, traces (fx and export) and is deterministic."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import torch.fx
from torch import nn

from fxopt import zoo
from fxopt.errors import UserInputError

EXPECTED = [
    "bert",
    "cnn_bn",
    "gpt",
    "llama",
    "mlp",
    "mobilenet_v2",
    "redundant",
    "resnet152",
    "resnet18",
    "resnet50",
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The models are tiny; on a shared CPU, intra-op threads mostly spin and wait, which made
    # this file 2× slower under load.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def default(name: str) -> zoo.ZooModel:
    """One build per model at default options, shared by the tests that only read it."""
    return zoo.create(name)


def eager(m: zoo.ZooModel):
    with torch.no_grad():
        return m.model(*m.example_inputs)


def as_tuple(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def export(model: nn.Module, args: tuple[torch.Tensor, ...]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export warns about training-mode BN and the like
        return torch.export.export(model, args).module()


def test_names_are_sorted_and_complete():
    assert zoo.names() == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_default_builds_in_eval_mode_and_output_is_finite(name):
    m = default(name)
    assert m.name == name
    assert not m.model.training
    assert all(not mod.training for mod in m.model.modules())
    assert m.example_inputs and all(isinstance(x, torch.Tensor) for x in m.example_inputs)
    assert m.description.startswith(zoo.describe(name))
    for out in as_tuple(eager(m)):
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", EXPECTED)
def test_symbolic_trace_matches_eager(name):
    m = default(name)
    gm = torch.fx.symbolic_trace(m.model)
    with torch.no_grad():
        torch.testing.assert_close(gm(*m.example_inputs), eager(m))


@pytest.mark.parametrize("name", EXPECTED)
def test_export_matches_eager(name):
    m = default(name)
    exported = export(m.model, m.example_inputs)
    with torch.no_grad():
        torch.testing.assert_close(exported(*m.example_inputs), eager(m))


# The bottleneck ResNets are left out only to keep the file fast: they use no construct
# (conv, BatchNorm, ReLU, residual add) that resnet18 does not, and cost seconds each.
@pytest.mark.parametrize("name", [n for n in EXPECTED if n not in ("resnet50", "resnet152")])
def test_training_mode_traces_and_matches_eager(name):
    m = zoo.create(name)  # a fresh model: training mode updates BatchNorm statistics
    m.model.train()
    runs = [m.model, torch.fx.symbolic_trace(m.model), export(m.model, m.example_inputs)]
    outs = []
    for run in runs:
        torch.manual_seed(1)  # the same dropout masks in all three
        outs.append(run(*m.example_inputs))
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[2], outs[0])


def test_options_are_coerced_from_strings():
    m = zoo.create("resnet18", image="32", batch="2", seed="3")
    assert m.example_inputs[0].shape == (2, 3, 32, 32)
    assert m.options == {"batch": 2, "image": 32, "classes": 1000, "seed": 3}
    m = zoo.create("mobilenet_v2", width="0.5", image="32", classes="7")
    assert m.options["width"] == 0.5
    assert m.model(*m.example_inputs).shape == (1, 7)
    assert zoo.create("mobilenet_v2", width=1, image=32).options["width"] == 1.0


def test_spec_round_trip():
    name, opts = zoo.parse_spec("bert?config=tiny&seq=8&batch=3&layers=1")
    assert (name, opts) == ("bert", {"config": "tiny", "seq": "8", "batch": "3", "layers": "1"})
    m = zoo.create(name, **opts)
    input_ids, attention_mask = m.example_inputs
    assert input_ids.shape == attention_mask.shape == (3, 8)
    assert input_ids.dtype == torch.int64
    assert len(m.model.layers) == 1


def test_parse_spec_forms():
    assert zoo.parse_spec("mlp") == ("mlp", {})
    assert zoo.parse_spec("zoo:gpt?seq=4&") == ("gpt", {"seq": "4"})
    assert zoo.parse_spec(" resnet50?image=64&&batch=2 ") == (
        "resnet50",
        {"image": "64", "batch": "2"},
    )


@pytest.mark.parametrize("spec", ["", "?batch=1", "mlp?batch", "mlp?=1", "mlp?batch=1&batch=2"])
def test_parse_spec_rejects_malformed(spec):
    with pytest.raises(UserInputError):
        zoo.parse_spec(spec)


def test_unknown_model_lists_valid_names():
    with pytest.raises(UserInputError, match="resnet51") as info:
        zoo.create("resnet51")
    assert all(name in str(info.value) for name in EXPECTED)
    with pytest.raises(UserInputError):
        zoo.describe("resnet51")


def test_unknown_option_names_it_and_the_valid_ones():
    with pytest.raises(UserInputError, match="'imgae'") as info:
        zoo.create("resnet50", imgae=32)
    message = str(info.value)
    assert all(option in message for option in ("batch", "image", "classes", "seed"))


@pytest.mark.parametrize(
    ("name", "options", "mentions"),
    [
        ("resnet18", {"image": "big"}, "image"),
        ("resnet18", {"image": 2.5}, "image"),
        ("resnet18", {"image": True}, "image"),
        ("resnet18", {"batch": "0"}, "batch"),
        ("mobilenet_v2", {"width": "wide"}, "width"),
        ("mobilenet_v2", {"width": "nan"}, "width"),
        ("bert", {"config": 3}, "config"),
        ("bert", {"config": "huge"}, "base, tiny"),
        ("bert", {"seq": "4096"}, "seq"),
        ("gpt", {"layers": "-1"}, "layers"),
        ("mlp", {"seed": "-1"}, "seed"),
    ],
)
def test_bad_option_values_raise(name, options, mentions):
    with pytest.raises(UserInputError, match=mentions):
        zoo.create(name, **options)


def test_options_and_describe():
    for name in EXPECTED:
        declared = zoo.options(name)
        assert declared["seed"] == 0
        assert all(isinstance(v, int | float | str) for v in declared.values())
        line = zoo.describe(name)
        assert line and "\n" not in line
    assert zoo.options("bert")["config"] == "tiny"
    assert zoo.options("gpt")["config"] == "tiny"


def test_same_seed_same_weights_and_inputs():
    a, b = zoo.create("cnn_bn", seed=5), zoo.create("cnn_bn", seed=5)
    c = zoo.create("cnn_bn", seed=6)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=0, atol=0)
    torch.testing.assert_close(a.example_inputs, b.example_inputs, rtol=0, atol=0)
    assert not torch.equal(sa["features.0.weight"], sc["features.0.weight"])


def test_create_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    zoo.create("mlp", seed=9)
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["cnn_bn", "resnet18", "mobilenet_v2"])
def test_batchnorm_statistics_are_not_the_identity(name):
    bns = [m for m in default(name).model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns
    for bn in bns:
        assert (bn.running_var > 0).all()
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))


def test_redundant_model_has_the_duplicates():
    graph = torch.fx.symbolic_trace(default("redundant").model).graph
    calls = [n.target for n in graph.nodes if n.op in ("call_module", "call_function")]
    assert calls.count("conv") == 2
    assert calls.count("encoder.0") == 2
    assert calls.count(torch.nn.functional.relu) == 2


def test_gpt_is_causal_and_tied():
    m = default("gpt")
    assert m.model.lm_head.weight is m.model.wte.weight
    (ids,) = m.example_inputs
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % m.model.config.vocab_size
    with torch.no_grad():
        before, after = m.model(ids), m.model(changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_bert_ignores_padded_tokens():
    m = default("bert")
    ids, mask = m.example_inputs
    assert (mask[-1] == 0).any() and (mask[0] == 1).all()
    changed = ids.clone()
    changed[mask == 0] = (changed[mask == 0] + 1) % m.model.config.vocab_size
    with torch.no_grad():
        before, after = m.model(ids, mask)[0], m.model(changed, mask)[0]
    keep = mask.bool()
    torch.testing.assert_close(before[keep], after[keep])


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_llama_decode_steps_on_the_static_cache_give_the_prefill_logits(family):
    # Token by token from an empty cache, the decode step computes what the prefill does
    # at each position: the cache write, the mask of later slots and the rotary positions.
    step = zoo.create("llama", family=family, step="decode", batch=2, seq=1, cache=8, seed=3)
    decoder = step.model.decoder
    tokens = torch.randint(0, decoder.config.vocab_size, (2, 6))
    _, _, keys, values = step.example_inputs
    keys, values = torch.zeros_like(keys), torch.zeros_like(values)
    with torch.no_grad():
        expected = decoder(tokens)
        for position in range(tokens.shape[1]):
            at = torch.full((2,), position)
            logits, keys, values = step.model(tokens[:, position : position + 1], at, keys, values)
            torch.testing.assert_close(logits[:, 0], expected[:, position])
