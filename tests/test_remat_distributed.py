"""fxopt.remat under DistributedDataParallel (the torch.compile backend) and FSDP2
(compile_blocks): real two-process jobs (gloo, loopback, a file store), gradients compared
on every rank with the same job without remat."""

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORLD = 2


class ConvNet(nn.Module):
    """Conv → BatchNorm (training mode) → ReLU blocks, wide enough for DDP to cut several
    1 MB gradient buckets (DDPOptimizer compiles one graph per bucket)."""

    def __init__(self, blocks=5, channels=96):
        super().__init__()
        layers, c = [], 3
        for _ in range(blocks):
            layers += [nn.Conv2d(c, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
            c = channels
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class Encoder(nn.Module):
    """Two pre-norm transformer layers with dropout (replayed, not redrawn, when recomputed)."""

    def __init__(self, width=128, layers=2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


MODELS = {
    "convnet": (ConvNet, lambda g: torch.randn(4, 3, 16, 16, generator=g)),
    "encoder": (Encoder, lambda g: torch.randn(4, 16, 128, generator=g)),
}
# The blocks FSDP2 shards one by one (and compile_blocks plans one by one).
BLOCKS = {"convnet": lambda m: [m.body], "encoder": lambda m: list(m.layers)}
# compile_blocks also compiles the convnet's root (its head becomes a graph of the chain);
# the encoder's forward loops over its layers, a frame Dynamo would run eagerly.
ROOTED = {"convnet": 1, "encoder": 0}  # graphs the root adds


@contextlib.contextmanager
def _process_group(rank: int, store: str, model_name: str):
    """This rank in a gloo group; yields the model (seeded alike on every rank) and the
    data maker."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        make, data = MODELS[model_name]
        torch.manual_seed(0)
        yield make().train(), data
    finally:
        dist.destroy_process_group()


def _ddp_worker(rank: int, store: str, model_name: str, budget: float, out: str) -> None:
    from fxopt.remat import PLANNERS, backend

    with _process_group(rank, store, model_name) as (base, data):
        plain = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        ours = {
            planner: nn.parallel.DistributedDataParallel(copy.deepcopy(base))
            for planner in PLANNERS
        }
        plans: dict = {planner: [] for planner in PLANNERS}
        compiled = {
            planner: torch.compile(
                model, backend=backend(budget, planner, plans=plans[planner]), dynamic=False
            )
            for planner, model in ours.items()
        }
        x = data(torch.Generator().manual_seed(rank))  # each rank its own batch
        y = torch.arange(x.shape[0]) % 10
        for step in range(2):  # the second step runs the compiled graphs, no compile
            for run, model in [(plain, plain), *((compiled[p], ours[p]) for p in PLANNERS)]:
                model.zero_grad(set_to_none=True)
                torch.manual_seed(100 * step + rank)
                F.cross_entropy(run(x), y).backward()
        result = _result(plain, ours, plans, lambda grad: grad)
        result["memory"] = _memory(
            x, y, plain=(plain, plain), greedy=(compiled["greedy"], ours["greedy"])
        )
        torch.save(result, out)


def _fsdp2_worker(rank: int, store: str, model_name: str, budget: float, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from fxopt.remat import PLANNERS, compile_blocks

    with _process_group(rank, store, model_name) as (base, data):
        plain = copy.deepcopy(base)
        ours = {planner: copy.deepcopy(base) for planner in PLANNERS}
        for model in (plain, *ours.values()):
            for block in BLOCKS[model_name](model):
                fully_shard(block)
            fully_shard(model)
        plans = {
            planner: compile_blocks(
                BLOCKS[model_name](model),
                budget,
                planner,
                root=model if ROOTED[model_name] else None,
            ).plans
            for planner, model in ours.items()
        }
        x = data(torch.Generator().manual_seed(rank))
        y = torch.arange(x.shape[0]) % 10
        for step in range(2):
            for model in (plain, *ours.values()):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(100 * step + rank)
                F.cross_entropy(model(x), y).backward()
        # Each rank holds its shard of every gradient (FSDP2 reduce-scattered them).
        result = _result(plain, ours, plans, lambda grad: grad.to_local())
        alone = copy.deepcopy(base)  # the same model in this process, no wrapper
        result["memory"] = _memory(
            x, y, plain=(plain, plain), greedy=(ours["greedy"],) * 2, alone=(alone, alone)
        )
        torch.save(result, out)


def _memory(x, y, **jobs) -> dict:
    """One measured step of each job: (peak, activation peak, activation saved) bytes."""
    from fxopt.remat.measure import boundary, measure_step

    found = {}
    for name, (run, model) in jobs.items():

        def step(run=run):
            loss = F.cross_entropy(run(x), y)
            boundary()
            loss.backward()

        m = measure_step(step, model)
        found[name] = (m.peak_bytes, m.activation_peak_bytes, m.activation_saved_bytes)
        model.zero_grad(set_to_none=True)
    return found


def _result(plain: nn.Module, ours: dict, plans: dict, local) -> dict:
    return {
        "plain": [local(p.grad) for p in plain.parameters()],
        "ours": {name: [local(p.grad) for p in model.parameters()] for name, model in ours.items()},
        "plans": {
            name: [
                (
                    p.peak,
                    p.baseline_peak,
                    len(p.recompute),
                    p.details.get("chain_graphs"),
                    p.saved,
                    p.baseline_saved,
                )
                for p in found
            ]
            for name, found in plans.items()
        },
    }


WORKERS = {"ddp": _ddp_worker, "fsdp2": _fsdp2_worker}


def _run(tmp_path, model_name: str, budget: float, wrapper: str = "ddp") -> list[dict]:
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(WORLD)]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = (wrapper, str(store), model_name, budget, [str(o) for o in outs])
    mp.spawn(_runner, args=args, nprocs=WORLD)
    return [torch.load(o) for o in outs]


def _runner(rank, wrapper, store, model_name, budget, outs):
    WORKERS[wrapper](rank, store, model_name, budget, outs[rank])


@pytest.mark.parametrize("wrapper", list(WORKERS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_gradients_equal_the_same_job_without_remat_on_every_rank_for_each_planner(
    tmp_path, model_name, wrapper
):
    """DDP: DDPOptimizer cuts the compiled model at bucket boundaries, each piece gets its
    own plan. FSDP2: compile_blocks gives each sharded block (and the root's code around
    them) its own plan."""
    results = _run(tmp_path, model_name, budget=0.8, wrapper=wrapper)
    blocks = len(BLOCKS[model_name](MODELS[model_name][0]()))
    for rank, result in enumerate(results):
        for planner, plans in result["plans"].items():
            assert plans, f"rank {rank}, {planner}: the backend compiled nothing"
            if wrapper == "fsdp2":
                assert len(plans) == blocks + ROOTED[model_name], (planner, plans)
            assert any(recomputed for _, _, recomputed, *_ in plans), (planner, plans)
            # The pieces are planned together: one may peak above its own baseline to save
            # less for the later ones (which plan wins among those that fit depends on the
            # profiled times, and so on the machine's load); the process never peaks
            # above what it does without remat.
            chosen = _process_peak([(peak, saved) for peak, _, _, _, saved, _ in plans])
            plain = _process_peak([(base, saved) for _, base, _, _, _, saved in plans])
            assert chosen <= plain, (planner, plans)
            # Once every piece (block) was compiled, they were planned together.
            assert all(graphs == len(plans) for _, _, _, graphs, *_ in plans), (planner, plans)
            for ours, plain in zip(result["ours"][planner], result["plain"], strict=True):
                assert torch.equal(ours, plain), f"rank {rank}, {planner}: gradients differ"
        memory = result["memory"]
        (peak, own_peak, saved), (_, _, saved_ours) = memory["plain"], memory["greedy"]
        assert saved_ours < saved, f"rank {rank}: remat saved nothing at the boundary"
        if wrapper == "fsdp2":
            # Without FSDP2's own buffers (gathered parameters, the root's kept from the
            # forward to the backward), its step holds what the model alone holds.
            assert own_peak < peak, f"rank {rank}: FSDP2's own buffers were not set apart"
            assert memory["alone"] == (own_peak, own_peak, saved), (rank, memory)
        else:  # DDP allocates nothing of its own in a step (its buckets exist before)
            assert own_peak == peak
    if wrapper == "ddp":  # DDP averaged the gradients: both ranks hold the same ones
        for ours, other in zip(results[0]["ours"]["greedy"], results[1]["ours"]["greedy"]):
            assert torch.equal(ours, other)


def _process_peak(pieces: list[tuple[int, int]]) -> int:
    """The peak of pieces run in order, each (own peak, bytes it saves for its backward):
    while one runs, what the pieces before it saved is alive (fxopt.remat.chain)."""
    peak, saved_before = 0, 0
    for own_peak, saved in pieces:
        peak = max(peak, saved_before + own_peak)
        saved_before += saved
    return peak


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_compile_step_names_a_data_parallel_wrapper_it_cannot_capture(one_process_group):
    from torch.distributed.fsdp import fully_shard

    from fxopt.errors import CaptureError
    from fxopt.remat import compile_step

    x = torch.randn(2, 3, 8, 8)
    ddp = nn.parallel.DistributedDataParallel(ConvNet(2, 8))
    with pytest.raises(CaptureError, match=r"DistributedDataParallel model.*torch\.compile"):
        compile_step(ddp, None, (x,))
    sharded = ConvNet(2, 8)
    fully_shard(sharded)
    with pytest.raises(CaptureError, match=r"FSDP2 \(fully_shard\).*torch 2.*compile_blocks"):
        compile_step(sharded, None, (x,))
