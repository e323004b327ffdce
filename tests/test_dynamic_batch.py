"""dynamic="batch" end to end on the zoo's CNNs and transformers: one optimize (the speed
preset with its layout step: pre-packed kernels are packed for the example's batch), then
batch 1, 3, 8 and 17 give eager's answers (17: torch picks another convolution backend from
16 on, and its fake kernel's guard on that must not cap the batch)."""

from __future__ import annotations

import pytest
import torch

import fxopt
from fxopt import zoo
from fxopt.errors import InputMismatchError

MODELS = [
    ("cnn_bn", {}, "auto"),
    ("resnet18", {"image": 32, "batch": 2}, "auto"),
    ("mobilenet_v2", {"image": 32, "batch": 2}, "export"),
    ("bert", {"seq": 8}, "auto"),
    ("gpt", {"seq": 8}, "export"),
]


def resized(example: tuple, batch: int, seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for x in example:
        shape = (batch, *x.shape[1:])
        if x.is_floating_point():
            out.append(torch.randn(shape, generator=generator))
        else:  # token ids / masks: within the example's range
            out.append(torch.randint(int(x.min()), int(x.max()) + 1, shape, generator=generator))
    return tuple(out)


@pytest.mark.parametrize("name, options, mode", MODELS, ids=[m[0] for m in MODELS])
def test_one_optimize_serves_batch_1_3_8_and_17(name, options, mode):
    entry = zoo.create(name, **options)
    result = fxopt.optimize(entry.model, entry.example_inputs, mode=mode, benchmark_runs=0)
    assert result.report["verified"]
    assert all(source.endswith(".shape[0]") for source in result.report["dynamic"])
    assert result.report["dynamic"], "the batch dim must be dynamic"
    assert "<=" not in result.contract.describe()  # no upper bound on the batch
    for batch in (1, 3, 8, 17):
        inputs = resized(entry.example_inputs, batch, seed=batch)
        with torch.no_grad():
            expected = entry.model(*inputs)
            actual = result.module(*inputs)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_dynamic_all_serves_other_sequence_lengths(family, mode):
    # dynamic="all": every dim the model lets vary (the prompt's length too), on the zoo's
    # decoder; a length the graph cannot take is refused, never miscomputed.
    entry = zoo.create("llama", family=family, batch=2, seq=8)
    result = fxopt.optimize(
        entry.model, entry.example_inputs, mode=mode, dynamic="all", benchmark_runs=0
    )
    assert result.report["verified"]
    assert "input_ids.shape[1]" in result.report["dynamic"]
    served = []
    for batch, length in ((3, 5), (2, 13), (1, 13)):
        ids = resized(entry.example_inputs, batch, seed=length)[0][:, :1].expand(batch, length)
        ids = (ids + torch.arange(length)) % entry.model.config.vocab_size
        with torch.no_grad():
            expected = entry.model(ids)
            try:
                actual = result.module(ids)
            except InputMismatchError as refusal:  # export's graph may hold for batch != 1
                assert batch == 1 and "input_ids.shape[0]" in str(refusal)
                continue
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        served.append((batch, length))
    assert served[:2] == [(3, 5), (2, 13)]


@pytest.mark.parametrize("mode", ["export"])
def test_containers_of_inputs_keep_their_dynamic_batch(mode):
    # The export spec follows each container's own structure: a namedtuple, a dict, a list.
    import collections

    Pair = collections.namedtuple("Pair", "x y")

    class Model(torch.nn.Module):
        def forward(self, pair, named, listed):
            return pair.x * 2 + pair.y + named["a"] - listed[0]

    def inputs(batch, seed):
        g = torch.Generator().manual_seed(seed)
        x = [torch.randn(batch, 3, generator=g) for _ in range(4)]
        return (Pair(x[0], x[1]), {"a": x[2]}, [x[3]])

    model = Model().eval()
    result = fxopt.optimize(model, inputs(2, 0), mode=mode, benchmark_runs=0)
    assert result.report["verified"] and result.report["dynamic"]
    other = inputs(5, 1)
    torch.testing.assert_close(result.module(*other), model(*other))
