"""One copy of the weights: fxopt works beside the user's model, never on copies of it.

Structural facts, not memory figures (those are measured in benchmarks/memory.py): the
optimized module reads the model's own storage where no pass changed a weight, no weight
is deep-copied on the way, a rejected layout candidate is freed, the model is left as it
was (buffers, versions, RNG, training flags, hooks), and a weight derived from the model's
is never used once its source changed in place.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import fxopt
from fxopt import layout
from fxopt.capture import trace
from fxopt.errors import StaleWeightsError, WritesWeightsError
from fxopt.ir.copying import isolated, shared_copy, written_buffers
from tests.models.stateful import CountsCalls


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _conv_bn() -> ConvBN:
    model = ConvBN()
    with torch.no_grad():  # statistics that are not the identity, so folding changes weights
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model.eval()


def _storages(module: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_unchanged_weights_are_the_models_own_storage(mode):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    result = fxopt.optimize(model, x, mode=mode, preset="cleanup", benchmark_runs=0)
    module_ptrs = {p.data_ptr() for p in result.module.parameters()} | {
        b.data_ptr() for b in result.module.buffers()
    }
    model_ptrs = {p.data_ptr() for p in model.parameters()}
    assert model_ptrs <= module_ptrs | _view_ptrs(result.module, model_ptrs)
    # Its tensor objects are its own: converting it leaves the model as it was.
    assert not {id(p) for p in result.module.parameters()} & {id(p) for p in model.parameters()}
    other = torch.randn(7, 16)  # another batch: dim 0 is dynamic
    with torch.no_grad():
        torch.testing.assert_close(result.module(other), model(other))


def _view_ptrs(module: nn.Module, model_ptrs: set[int]) -> set[int]:
    """Model storages that ``module`` reads through a view (a folded ``W.t()``)."""
    found = set()
    for tensor in [*module.parameters(), *module.buffers()]:
        storage = tensor.untyped_storage().data_ptr()
        if storage in model_ptrs:
            found.add(storage)
    return found


class SharedConvBN(nn.Module):
    """One conv called twice, once into a BatchNorm: fold-bn gives the folded call a conv of
    its own (its weights are replaced; the other call keeps the model's)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.conv(x * 2)


def _shared_conv_bn() -> SharedConvBN:
    model = SharedConvBN()
    with torch.no_grad():
        model.bn.running_var.uniform_(0.5, 2)
    return model.eval()


@pytest.mark.parametrize("mode", ["fx", "export"])
@pytest.mark.parametrize("make", [_conv_bn, _shared_conv_bn], ids=["conv-bn", "shared-conv"])
def test_optimize_deep_copies_no_weight(mode, make, monkeypatch):
    # Every way a weight could be copied whole: deepcopy of a tensor or parameter.
    model, x = make(), torch.randn(2, 3, 16, 16)
    watched = _storages(model)
    copied: list[tuple[int, ...]] = []
    originals = {cls: cls.__deepcopy__ for cls in (torch.Tensor, nn.Parameter)}

    def counting(cls):
        def deepcopy(self, memo):
            if self.layout == torch.strided and self.untyped_storage().data_ptr() in watched:
                copied.append(tuple(self.shape))
            return originals[cls](self, memo)

        return deepcopy

    for cls in originals:
        monkeypatch.setattr(cls, "__deepcopy__", counting(cls))
    result = fxopt.optimize(model, x, mode=mode, benchmark_runs=0)
    assert result.report["verified"]
    assert copied == []


def test_the_folded_module_keeps_the_unfolded_weights_shared():
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    result = fxopt.optimize(model, x, passes=["fold-bn"], benchmark_runs=0)
    shared = {p.data_ptr() for p in result.module.parameters()} & _storages(model)
    assert model.head.weight.data_ptr() in shared  # untouched: the model's own
    assert model.conv.weight.data_ptr() not in shared  # folded: a new weight


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_a_changed_source_of_a_folded_weight_refuses_the_call(mode):
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    result = fxopt.optimize(model, x, mode=mode, passes=["fold-bn"], benchmark_runs=0)
    assert result.report["verified"]
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        model.bn.running_mean.add_(0.5)  # as load_state_dict or fine-tuning would
    with pytest.raises(StaleWeightsError, match=r"bn\.running_mean.*fold-bn"):
        result.module(x)
    model.load_state_dict(state)  # copy_ in place: still not what was folded
    with pytest.raises(StaleWeightsError):
        result.module(x)


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_an_unchanged_weight_is_read_live(mode):
    # A weight no pass derived anything from is the model's: fine-tuning reaches the module.
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    result = fxopt.optimize(model, x, mode=mode, passes=["fold-bn"], benchmark_runs=0)
    with torch.no_grad():
        model.head.weight.mul_(2.0)
        torch.testing.assert_close(result.module(x), model(x))
        other = torch.randn(5, 3, 16, 16)
        torch.testing.assert_close(result.module(other), model(other))


def test_the_users_model_is_never_mutated():
    # Buffers (values and version counters), RNG state, training flags, hooks and Python
    # attributes of a training-mode model with BatchNorm, dropout and a counting buffer.
    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.drop = nn.Dropout(0.3)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return self.drop(self.bn(self.conv(x)))

    model = Stateful().train()
    seen = []
    model.conv.register_forward_hook(lambda *args: seen.append(1))
    tensors = {k: (v, v._version, v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    hooks = dict(model.conv._forward_hooks)
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    attributes = {name: dict(m.__dict__) for name, m in model.named_modules()}
    fxopt.optimize(model, x, mode="export", benchmark_runs=0)
    after = model.state_dict(keep_vars=True)
    for key, (tensor, version, value) in tensors.items():
        assert after[key] is tensor and tensor._version == version and torch.equal(tensor, value)
    assert all(m.training for m in model.modules())
    assert dict(model.conv._forward_hooks) == hooks
    assert torch.equal(torch.get_rng_state(), rng)
    for name, m in model.named_modules():
        assert set(m.__dict__) == set(attributes[name])


def test_a_rejected_layout_candidate_is_freed(monkeypatch):
    model, x = _conv_bn(), torch.randn(1, 3, 16, 16)
    gm = trace(model, x)
    built = []

    def wrong(gm):
        out = shared_copy(gm)
        out.head.bias = nn.Parameter(out.head.bias + 1.0)  # computes something else
        built.append(weakref.ref(out))
        return out

    monkeypatch.setitem(layout._BUILDERS, "channels_last", wrong)
    choice = layout.autotune(gm, model, (x,), candidates=("channels_last",), budget_s=0.05)
    assert "outputs differ" in choice.rejected["channels_last"]
    gc.collect()
    assert built and built[0]() is None


def test_the_layout_steps_losers_are_freed_and_given_back_before_optimize_returns(
    monkeypatch,
):
    # A packed candidate holds a copy of the weights: once it lost, its pages go back to
    # the system (glibc keeps freed blocks resident otherwise: +0.8x the weights of a
    # 0.7 GiB Llama stayed resident after the layout step chose the model itself).
    from fxopt import memory

    built, released = [], []
    real = layout._BUILDERS["onednn"]

    def recorded(gm, **options):
        out = real(gm, **options)
        built.append(weakref.ref(out))
        return out

    def release():
        gc.collect()  # (what the collector frees by then: the losers, not the winner)
        released.append([ref() is None for ref in built])

    monkeypatch.setitem(layout._BUILDERS, "onednn", recorded)
    monkeypatch.setattr(memory, "release_free_memory", release)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    result = fxopt.optimize(model, (torch.randn(4, 64),), benchmark_runs=0)
    chosen = result.report["layout"]["chosen"]
    assert len(built) == 1 and released == [[chosen != "onednn"]]


def test_a_candidate_dropped_from_the_race_is_freed_at_once():
    first = nn.Linear(2, 2)
    second = CountsCalls().eval()
    racers = layout._Racers({"plain": first, "original": second})
    ref = weakref.ref(second)
    del second
    del racers["original"]
    gc.collect()
    assert ref() is None and "original" not in racers.built
    racers.__exit__(None, None, None)


def test_isolated_restores_buffers_attributes_and_flags():
    class Python(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            self.extra = True
            self.eval()
            return self.bn(x)

    model = Python().train()
    mean = model.bn.running_mean
    with isolated(model) as running:
        running(torch.randn(4, 3))
        running.train()
        running(torch.randn(4, 3))
        assert running.calls == 2 and model.bn.running_mean is not mean  # a scratch copy
    assert model.calls == 0 and not hasattr(model, "extra") and model.training
    assert model.bn.running_mean is mean and float(mean.abs().sum()) == 0.0


def test_a_forward_that_writes_its_parameters_is_refused_before_the_write():
    class WritesWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 3)

        def forward(self, x):
            with torch.no_grad():
                self.linear.weight.mul_(0.5)
            return self.linear(x)

    model = WritesWeight().eval()
    before = model.linear.weight.clone()
    with pytest.raises(WritesWeightsError, match=r"linear\.weight"):
        fxopt.optimize(model, torch.randn(2, 3), benchmark_runs=0)
    assert torch.equal(model.linear.weight, before)


def test_written_buffers_of_a_graph_are_only_those_it_writes():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
    x = torch.randn(2, 3, 4, 4)
    eval_graph = trace(model.eval(), x, "export")
    assert written_buffers(eval_graph) == []
    train_graph = trace(model.train(), x, "export")
    names = {name for _, name in written_buffers(train_graph)}
    assert {n.rpartition("_")[2] for n in names} >= {"mean", "var"}
    fx_train = trace(model.train(), x, "fx")
    assert {name for _, name in written_buffers(fx_train)} == {
        "running_mean",
        "running_var",
        "num_batches_tracked",
    }


def test_shared_copy_keeps_ties_and_shares_storage():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight
            self.scale = torch.ones(4)  # a plain tensor attribute

    model = Tied()
    other = shared_copy(model)
    assert other.a.weight is other.b.weight and other.a.weight is not model.a.weight
    assert other.a.weight.data_ptr() == model.a.weight.data_ptr()
    assert other.scale is not model.scale and other.scale.data_ptr() == model.scale.data_ptr()
    other.a.weight = nn.Parameter(torch.zeros(4, 4))
    assert model.a.weight.abs().sum() > 0


def test_a_saved_or_deep_copied_module_holds_its_own_weights_and_watches_nothing(tmp_path):
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    result = fxopt.optimize(model, x, passes=["fold-bn"], benchmark_runs=0)
    expected = result.module(x)
    torch.save(result.module, tmp_path / "module.pt")
    loaded = torch.load(tmp_path / "module.pt", weights_only=False)
    copied = copy.deepcopy(result.module)
    with torch.no_grad():
        model.bn.running_mean.add_(0.5)
    for independent in (loaded, copied):
        torch.testing.assert_close(independent(x), expected)  # a snapshot: nothing stale
    with pytest.raises(StaleWeightsError):
        result.module(x)


def test_a_layout_candidate_that_does_not_fit_is_not_built(monkeypatch):
    from fxopt import memory

    model, x = _conv_bn(), torch.randn(1, 3, 16, 16)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1024)  # almost nothing free
    choice = layout.autotune(trace(model, x), model, (x,), budget_s=0.05)
    assert "not built: it copies" in choice.rejected["onednn"]
    assert choice.name in ("plain", "original")


def test_a_job_the_machine_cannot_hold_is_refused_before_it_starts(monkeypatch):
    from fxopt import circle, memory
    from fxopt.errors import NotEnoughMemoryError

    model, x = _conv_bn(), torch.randn(1, 3, 16, 16)
    monkeypatch.setattr(memory, "available_bytes", lambda: 16)  # bytes
    with pytest.raises(NotEnoughMemoryError, match=r"optimize needs about .*--no-memory-check"):
        fxopt.optimize(model, x)
    with pytest.raises(NotEnoughMemoryError, match=r"convert needs .*external_buffer_threshold"):
        circle.convert(model, (x,))
    result = fxopt.optimize(model, x, memory_check=False, autotune=False, benchmark_runs=0)
    assert result.report["verified"]


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_training_the_model_after_folding_refuses_the_stale_module(mode):
    # BatchNorm's kernel updates its running statistics without bumping their version
    # counters: the module watches the batch counter beside them.
    model, x = _conv_bn(), torch.randn(2, 3, 16, 16)
    result = fxopt.optimize(model, x, mode=mode, passes=["fold-bn"], benchmark_runs=0)
    model.train()
    model(torch.randn(4, 3, 16, 16))  # one training step's forward moves the statistics
    model.eval()
    with pytest.raises(StaleWeightsError, match=r"num_batches_tracked|running"):
        result.module(x)


def test_a_later_session_protects_what_the_first_saw_written():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(3):  # the first session learns, the next ones use what it learned
        with isolated(model) as running:
            running(torch.randn(5, 3))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
