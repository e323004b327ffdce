"""fxopt.remat's torch.compile backend under DistributedDataParallel: real two-process jobs
(gloo, loopback, a file store), gradients compared on every rank with the same DDP job
without remat."""

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


def _worker(rank: int, store: str, model_name: str, budget: float, out: str) -> None:
    from fxopt.remat import backend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        make, data = MODELS[model_name]
        torch.manual_seed(0)
        base = make().train()
        plain = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        ours = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        plans: list = []
        compiled = torch.compile(ours, backend=backend(budget, plans=plans), dynamic=False)
        x = data(torch.Generator().manual_seed(rank))  # each rank its own batch
        y = torch.arange(x.shape[0]) % 10
        for step in range(2):  # the second step runs the compiled graphs, no compile
            for model in (plain, ours):
                model.zero_grad(set_to_none=True)
            torch.manual_seed(100 * step + rank)
            F.cross_entropy(plain(x), y).backward()
            torch.manual_seed(100 * step + rank)
            F.cross_entropy(compiled(x), y).backward()
        torch.save(
            {
                "plain": [p.grad for p in plain.parameters()],
                "ours": [p.grad for p in ours.parameters()],
                "plans": [(p.peak, p.baseline_peak, len(p.recompute)) for p in plans],
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def _run(tmp_path, model_name: str, budget: float) -> list[dict]:
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(WORLD)]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_runner, args=(str(store), model_name, budget, [str(o) for o in outs]), nprocs=WORLD)
    return [torch.load(o) for o in outs]


def _runner(rank, store, model_name, budget, outs):
    _worker(rank, store, model_name, budget, outs[rank])


@pytest.mark.parametrize("model_name", list(MODELS))
def test_ddp_gradients_equal_the_same_job_without_remat_on_every_rank(tmp_path, model_name):
    results = _run(tmp_path, model_name, budget=0.8)
    for rank, result in enumerate(results):
        # DDPOptimizer cut the model at bucket boundaries; each piece has its own plan.
        assert result["plans"], f"rank {rank}: the backend compiled nothing"
        assert any(recomputed for _, _, recomputed in result["plans"]), result["plans"]
        assert all(peak <= base for peak, base, _ in result["plans"])
        for ours, plain in zip(result["ours"], result["plain"]):
            assert torch.equal(ours, plain), f"rank {rank}: gradients differ"
    # DDP averaged the gradients: both ranks hold the same ones.
    for ours, other in zip(results[0]["ours"], results[1]["ours"]):
        assert torch.equal(ours, other)


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
    with pytest.raises(CaptureError, match=r"FSDP2 \(fully_shard\).*torch 2"):
        compile_step(sharded, None, (x,))
