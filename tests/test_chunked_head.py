"""An LM head's cross-entropy traced in chunks of rows (fxopt.remat.chunked_head): the
same loss to the bit, the same gradients within rounding, and the memory floor of a
decoder's training step gone."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from fxopt.errors import UserInputError
from fxopt.remat import BudgetError, compile_step
from fxopt.remat.chunked_head import ChunkedHead
from fxopt.remat.measure import boundary, measure_step


def head_and_rows(rows=96, hidden=16, vocab=300, seed=0):
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator))
    x = torch.randn(2, rows // 2, hidden, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    labels[::7] = -100  # ignored rows
    return head, x, labels


def loss_and_grads(loss_of, head, x):
    loss = loss_of()
    grads = torch.autograd.grad(loss, (x, head.weight, head.bias))
    return loss.detach(), grads


def chunked(loss_of, chunks=5):
    with ChunkedHead(chunks) as mode:
        loss = loss_of()
    return loss, mode


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_chunked_loss_is_eagers_to_the_bit_and_its_gradients_within_rounding(reduction):
    head, x, labels = head_and_rows()
    vocab = head.out_features

    def loss_of():
        return F.cross_entropy(head(x).view(-1, vocab), labels, reduction=reduction)

    expected, expected_grads = loss_and_grads(loss_of, head, x)
    with ChunkedHead(5) as mode:
        got, grads = loss_and_grads(loss_of, head, x)
    assert mode.chunked == 1
    assert torch.equal(got, expected)
    for grad, eager in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, eager, rtol=1e-6, atol=1e-6)

    # Another input: other rows, other labels, more of them ignored.
    _, other, other_labels = head_and_rows(rows=62, seed=3)
    other_labels[:20] = -100
    with ChunkedHead(5):
        got = F.cross_entropy(head(other).view(-1, vocab), other_labels, reduction=reduction)
    assert torch.equal(
        got, F.cross_entropy(head(other).view(-1, vocab), other_labels, reduction=reduction)
    )


def test_nan_and_inf_rows_give_eagers_loss_and_gradient():
    head, x, labels = head_and_rows()
    vocab = head.out_features
    with torch.no_grad():
        x[0, 3, 0] = float("nan")
        x[1, 5, :] = float("inf")
        x[1, 6, 2] = -0.0

    def loss_of():
        return F.cross_entropy(head(x).reshape(-1, vocab), labels, reduction="sum")

    expected, expected_grads = loss_and_grads(loss_of, head, x)
    with ChunkedHead(4):
        got, grads = loss_and_grads(loss_of, head, x)
    assert torch.equal(
        got,
        expected,
    ) or (got.isnan() and expected.isnan())
    torch.testing.assert_close(grads[0], expected_grads[0], equal_nan=True)


def test_casts_and_softcapping_between_the_head_and_the_loss_are_chunked_too():
    head, x, labels = head_and_rows()
    head = head.to(torch.bfloat16)
    vocab = head.out_features

    def loss_of():  # Gemma's softcap, then transformers' upcast of the logits
        logits = torch.tanh(head(x.to(torch.bfloat16)) / 30.0) * 30.0
        return F.cross_entropy(logits.float().view(-1, vocab), labels)

    got, mode = chunked(loss_of, chunks=3)
    assert mode.chunked == 1
    assert torch.equal(got, loss_of())


@pytest.mark.parametrize(
    "options",
    [dict(label_smoothing=0.1), dict(reduction="none"), dict(weight=torch.rand(300))],
)
def test_a_loss_the_chunks_do_not_express_is_traced_as_written(options):
    head, x, labels = head_and_rows()
    got, mode = chunked(lambda: F.cross_entropy(head(x).view(-1, 300), labels, **options))
    assert mode.chunked == 0
    assert torch.equal(got, F.cross_entropy(head(x).view(-1, 300), labels, **options))


def test_logits_that_are_not_a_linears_rows_are_not_chunked():
    head, x, labels = head_and_rows()
    # A transpose keeps the last dim but not the rows' order.
    logits = lambda: head(x).transpose(0, 1).reshape(-1, 300)  # noqa: E731
    got, mode = chunked(lambda: F.cross_entropy(logits(), labels))
    assert mode.sites == 0 and mode.chunked == 0
    assert torch.equal(got, F.cross_entropy(logits(), labels))


class TinyLM(torch.nn.Module):
    """Embedding, two ReLU layers and a head over a vocabulary much wider than the
    hidden size: the logits are the step's floor, as in a decoder."""

    def __init__(self, vocab=2048, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden)
        )
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def lm_loss(model, ids, labels):
    logits = model(ids)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def example(seed, batch=2, length=128, vocab=2048):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    labels = torch.randint(0, vocab, (batch, length), generator=generator)
    labels[:, :seed] = -100
    return ids, labels


def test_compile_step_chunks_the_head_when_the_budget_needs_it():
    torch.manual_seed(0)
    model = TinyLM().train()
    inputs = example(0)
    with pytest.raises(BudgetError):  # unchunked, the logits are the floor
        compile_step(model, lm_loss, inputs, memory_budget=0.3, lm_head_chunks=1, strict=True)

    step = compile_step(
        model, lm_loss, inputs, memory_budget=0.3, strict=True, lm_head_chunks="auto"
    )
    report = step.report()
    assert report["lm_head"]["chunks"] == 8
    assert report["lm_head"]["logit_bytes"] == 2 * 128 * 2048 * 4
    unchunked = report["lm_head"]["unchunked_peak_activation_bytes"]
    assert report["optimized"]["peak_activation_bytes"] <= 0.3 * unchunked
    assert "a sum over chunks" in report["lm_head"]["note"]

    # A budget met as written is not chunked.
    met = compile_step(model, lm_loss, inputs, memory_budget=1.0, lm_head_chunks="auto")
    assert met.report()["lm_head"]["chunks"] == 1

    # The step on other inputs: eager's loss, gradients within rounding.
    eager = copy.deepcopy(model)
    for seed in (0, 9):
        other = example(seed)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        loss = step(*other)
        expected = lm_loss(eager, *other)
        expected.backward()
        assert torch.equal(loss, expected)
        for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_planned_chunked_step_measures_under_the_unchunked_floor():
    torch.manual_seed(0)
    model = TinyLM().train()
    inputs = example(1)
    step = compile_step(model, lm_loss, inputs, memory_budget=0.3, lm_head_chunks="auto")
    floor = compile_step(model, lm_loss, inputs, memory_budget=1.0)
    eager = copy.deepcopy(model)

    def eager_step():
        loss = lm_loss(eager, *inputs)
        boundary()
        loss.backward()

    measured = measure_step(lambda: step(*inputs), model).peak_bytes
    eager_peak = measure_step(eager_step, eager).peak_bytes
    logits = 2 * 128 * 2048 * 4
    # Eager holds the logits, their log-softmax and that one's gradient at once; the
    # chunked step, an eighth of each.
    assert eager_peak >= 2 * logits
    assert measured < eager_peak / 2
    assert floor.report()["lm_head"]["chunks"] == 1


def test_the_head_weight_gradient_is_summed_in_place():
    from fxopt.remat.capture import capture_joint

    joint = capture_joint(TinyLM().train(), lm_loss, example(0), lm_head_chunks=8)
    (record,) = [r for r in joint.prepared.records if r.name == "accumulate-in-place"]
    assert record.stats["in_place"] >= 7  # the 8 chunks' weight gradients, at least
    # Each chunk's product is computed into the sum (addmm_): no weight-sized term.
    assert record.stats["into_the_sum"] >= 7
    graph = joint.prepared.module.graph
    into = [n for n in graph.nodes if n.target is torch.ops.aten.addmm_.default]
    assert len(into) == record.stats["into_the_sum"]
    plain = capture_joint(TinyLM().train(), lm_loss, example(0))
    assert not [r for r in plain.prepared.records if r.name == "accumulate-in-place"]


def test_recomputation_changes_no_bit_of_the_chunked_step():
    torch.manual_seed(0)
    model = TinyLM().train()
    twin = copy.deepcopy(model)
    inputs = example(2)
    planned = compile_step(model, lm_loss, inputs, memory_budget=0.5, lm_head_chunks=8)
    unplanned = compile_step(twin, lm_loss, inputs, memory_budget=1.0, lm_head_chunks=8)
    assert planned.report()["recomputed"]
    assert torch.equal(planned(*inputs), unplanned(*inputs))
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("chunks", [0, True, 2.5, "8", None])
def test_a_bad_chunk_count_is_a_clear_error(chunks):
    with pytest.raises(UserInputError, match="lm_head_chunks"):
        compile_step(TinyLM(), lm_loss, example(0), lm_head_chunks=chunks)


def test_an_unreachable_budget_with_chunks_still_warns_and_trains():
    model = TinyLM().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = compile_step(model, lm_loss, example(0), memory_budget=0.01, lm_head_chunks="auto")
    assert any("best plan found" in str(w.message) for w in caught)
    assert step.report()["lm_head"]["chunks"] == 8
    assert torch.isfinite(step(*example(0)))


def test_auto_chunks_where_the_hidden_size_exceeds_the_tokens():
    # Twice as many hidden units as tokens: while each chunk's product of the head
    # weight's gradient was summed beside the sum (two weight-sized tensors), that floor
    # was above what chunks would remove, and "auto" did not chunk. Computed into the sum
    # (addmm_), the floor is one weight, and the chunked plan goes lower.
    torch.manual_seed(0)
    model = TinyLM(vocab=2048, hidden=512).train()
    inputs = example(0, batch=2, length=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = compile_step(model, lm_loss, inputs, memory_budget=0.3, lm_head_chunks="auto")
        plain = compile_step(model, lm_loss, inputs, memory_budget=0.3)
    assert step.joint.lm_head_weight_bytes == 2048 * 512 * 4
    report = step.report()
    assert report["lm_head"]["chunks"] == 8
    chunked_peak = report["optimized"]["peak_activation_bytes"]
    assert chunked_peak < 0.6 * plain.report()["optimized"]["peak_activation_bytes"]


def test_by_default_the_head_is_not_chunked_and_the_warning_says_it_could_be():
    # Chunks round the head weight's gradient differently: opt-in (exact by default).
    torch.manual_seed(0)
    model = TinyLM().train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = compile_step(model, lm_loss, example(0), memory_budget=0.3)
    assert step.report()["lm_head"]["chunks"] == 1
    (warning,) = [w for w in caught if "fxopt remat" in str(w.message)]
    assert "lm_head_chunks=8" in str(warning.message)
    with pytest.raises(BudgetError, match="LM head's logits are part of that floor"):
        compile_step(model, lm_loss, example(0), memory_budget=0.3, strict=True)


def test_under_autocast_the_chunked_loss_is_eagers_too():
    head, x, labels = head_and_rows()

    def loss_of():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(head(x).view(-1, head.out_features), labels)

    expected = loss_of()
    got, mode = chunked(loss_of, chunks=4)
    assert mode.chunked == 1 and got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected)
