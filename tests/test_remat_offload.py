"""Offload, remat's second lever: the cost model (simulate, greedy), the rewrite (copies to
the host and back, the backward reading them) and compile_step with it, gradients equal
to eager's and another input refused."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxopt.errors import UserInputError
from fxopt.remat import Offload, compile_step, plan
from fxopt.remat.planners import greedy_sequence, offloadable
from fxopt.remat.rewrite import OFFLOADED_FROM, RECOMPUTED_FROM
from fxopt.remat.simulate import simulate
from fxopt.remat.table import Table


def chain(times=None) -> Table:
    """x → a → b → c, gradients back: every forward value saved for the backward."""
    return Table.build(
        names=["x", "a", "b", "c", "gc", "gb", "ga", "out"],
        phases=["input"] + ["forward"] * 3 + ["backward"] * 3 + ["output"],
        args=[(), (0,), (1,), (2,), (3,), (2, 4), (1, 5), (6,)],
        storages=[None, 10, 10, 10, 1, 1, 1, None],
        times=times,
    )


def test_an_offloaded_value_leaves_the_device_as_a_recomputed_one_does():
    table = chain()
    recomputed, offloaded = simulate(table, {1}), simulate(table, (), {1})
    assert offloaded.peak == recomputed.peak == 21 < simulate(table).peak
    assert offloaded.offloaded == (1,) and offloaded.recomputed == ()
    assert offloaded.recompute_s == 0.0 and recomputed.recompute_s == 1.0
    # The restore reads nothing on the device: b need not stay alive for it, as it must
    # for a's recompute... b is saved for the backward anyway, so the peaks agree here.
    assert offloaded.saved == recomputed.saved == 20


def test_the_restore_holds_no_temporaries_and_reads_nothing():
    """A recompute holds its op's workspace and its inputs; a restore only its output."""
    from dataclasses import replace

    table = chain()
    rows = list(table.rows)
    rows[1] = replace(rows[1], temp_bytes=100)  # a's op needs a large workspace
    table = Table(tuple(rows), table.storage_bytes)
    assert simulate(table, {1}).peak > simulate(table, (), {1}).peak


def test_greedy_offloads_what_is_dear_to_recompute_and_recomputes_what_is_cheap():
    slow = chain(times=[0, 1e-3, 1e-3, 1e-3, 0, 0, 0, 0])  # each op costs a millisecond
    fast_link = Offload(bandwidth_bytes_s=1e6)  # 10 bytes out and back: 20 µs
    chosen = plan(slow, 0.7, offload=fast_link)
    assert chosen.offload and not chosen.recompute and chosen.peak <= chosen.budget_bytes
    assert chosen.transfer_s == pytest.approx(fast_link.cost_s(chosen.offloaded_bytes))
    slow_link = Offload(bandwidth_bytes_s=1.0)  # 20 s for the same bytes
    cheap = chain(times=[0, 1e-6, 1e-6, 1e-6, 0, 0, 0, 0])
    chosen = plan(cheap, 0.7, offload=slow_link)
    assert chosen.recompute and not chosen.offload and chosen.transfer_s == 0.0
    assert chosen.estimated_overhead == pytest.approx(chosen.recompute_s / chosen.forward_s)


def test_greedy_with_offload_never_peaks_higher_than_without():
    table = chain(times=[0, 1, 1, 1, 0, 0, 0, 0])
    for bandwidth in (1.0, 1e3, 1e9):
        peaks = [sim.peak for _, sim in greedy_sequence(table, Offload(bandwidth))]
        assert peaks == sorted(peaks, reverse=True)
        assert peaks[-1] <= min(sim.peak for _, sim in greedy_sequence(table))


def test_a_value_is_offloaded_with_its_views_made_again_from_the_copy_back():
    """One copy moves a storage only if nothing else holds it but views of the value,
    which the backward then makes again from the restored copy."""
    from dataclasses import replace

    from fxopt.remat.planners import offload_views

    table = Table.build(
        names=["x", "a", "v", "ga", "out"],
        phases=["input", "forward", "forward", "backward", "output"],
        args=[(), (0,), (1,), (1, 2), (3,)],
        storages=[None, 10, None, 1, None],
    )
    rows = list(table.rows)
    rows[2] = replace(rows[2], refs=(0,))  # v is a view of a (a detach, say)
    viewed = Table(tuple(rows), table.storage_bytes)
    assert offload_views(viewed, 1) == {2} and not offloadable(viewed, 2)
    sim = simulate(viewed, {2}, {1})
    assert sim.offloaded == (1,) and sim.recomputed == (2,)
    rows[2] = replace(rows[2], recomputable=False, reason="blocked")
    assert not offloadable(Table(tuple(rows), table.storage_bytes), 1)
    assert offload_views(chain(), 1) == set()


def test_bad_offload_options_are_user_errors():
    with pytest.raises(UserInputError, match="bandwidth"):
        Offload(bandwidth_bytes_s=0)
    with pytest.raises(UserInputError, match="greedy"):
        plan(chain(), 0.7, "optimal", offload=Offload())
    model = nn.Linear(4, 4)
    with pytest.raises(UserInputError, match="greedy"):
        compile_step(model, None, torch.randn(2, 4), planner="every_n", offload=Offload())


class Net(nn.Module):
    """Wide matmuls (dear to recompute) around cheap tanh and a dropout."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        for layer in self.layers:
            x = self.drop(torch.tanh(layer(x)))
        return x


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("bandwidth", [1e12, 1e3])
def test_compile_step_with_offload_trains_as_eager_does(bandwidth):
    torch.manual_seed(0)
    model = Net().train()
    eager = copy.deepcopy(model)
    x, y = torch.randn(64, 256), torch.randint(0, 256, (64,))
    step = compile_step(
        model, _loss, (x, y), memory_budget=0.6, offload=Offload(bandwidth), profile_runs=1
    )
    plan_ = step.plan
    assert plan_.peak <= plan_.budget_bytes
    copies = [n for n in step.graph.graph.nodes if OFFLOADED_FROM in n.meta]
    assert len(copies) == 2 * len(plan_.offload)
    if bandwidth > 1e9:  # nearly free transfers: offloading is cheaper than recomputing
        assert plan_.offload
        alone = plan(step.table, 0.6)  # recompute only
        assert plan_.recompute_s + plan_.transfer_s < alone.recompute_s
        recomputed = {
            n.meta[RECOMPUTED_FROM] for n in step.graph.graph.nodes if RECOMPUTED_FROM in n.meta
        }
        assert recomputed.isdisjoint(plan_.offload)
        report = step.report()["offload"]
        assert report["simulated"] is True  # a CPU: host and device are one memory
        assert report["bytes"] == plan_.offloaded_bytes > 0
        assert report["bandwidth_bytes_s"] == bandwidth
    else:  # a kilobyte per second: nothing is worth moving
        assert not plan_.offload and plan_.recompute
        assert step.report()["offload"] is None
    for seed, inputs in [(1, (x, y)), (2, (torch.randn(64, 256), torch.randint(0, 256, (64,))))]:
        for net in (model, eager):
            net.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = step(*inputs)
        torch.manual_seed(seed)
        expected = _loss(eager, *inputs)
        expected.backward()
        assert torch.equal(loss, expected)
        for ours, theirs in zip(model.parameters(), eager.parameters()):
            assert torch.equal(ours.grad, theirs.grad)
    with pytest.raises(UserInputError, match="do not match"):
        step(torch.randn(8, 256), torch.randint(0, 256, (8,)))  # another batch size


def test_cli_offload_reports_what_it_moved_as_simulated(capsys):
    import json

    from fxopt.cli import main

    argv = ["remat", "zoo:mlp?batch=64", "--budget", "0.8", "--json", "--runs", "1"]
    assert main([*argv, "--offload", "--bandwidth", "1000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["grads_match"]
    offload = data["offload"]
    assert offload["simulated"] is True and offload["bandwidth_bytes_s"] == 1e12
    assert offload["bytes"] == sum(n["bytes"] for n in offload["nodes"]) > 0
    text = [a for a in argv if a != "--json"]
    assert main([*text, "--offload", "--bandwidth", "1000"]) == 0  # says it is simulated
    assert "simulated" in capsys.readouterr().out

    assert main(["remat", "zoo:mlp", "--offload", "--planner", "optimal"]) == 2
    assert "greedy" in capsys.readouterr().err
    assert main(["remat", "zoo:mlp", "--offload", "--bandwidth", "0"]) == 2
    assert "--bandwidth" in capsys.readouterr().err
