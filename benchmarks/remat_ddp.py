"""Remat under DistributedDataParallel and FSDP2: real multi-process jobs on this machine
(gloo, loopback, one thread per process).

Per world size (2 and 4 processes) and model (ResNet-50 at 64×64 and at 224×224, and
BERT-base at 64 tokens, batch 2 per rank, training mode), every rank runs,
interleaved:

    ddp                  DistributedDataParallel(model)
    ddp checkpoint       the same with torch.utils.checkpoint on every block
    ddp compiled         torch.compile(ddp, backend="aot_eager"): the compiled job without
                         remat, which separates what compiling costs from what
                         recomputing costs (``time_vs_compiled``)
    ddp fxopt B          torch.compile(ddp, backend=fxopt.remat.backend(B)): DDPOptimizer's
                         pieces (gradient buckets) planned together, B in --budgets
    ddp min-cut B        torch.compile(ddp) through AOTAutograd with torch's min-cut
                         partitioner at activation_memory_budget=B (fx code, no Inductor)
    fsdp2 ...            the same under FSDP2 (fully_shard per block, then the root);
                         fxopt through compile_blocks(blocks, root=model), min-cut and
                         aot_eager through the same compile of each block's forward and
                         of the root's code around them (its stem or embeddings, its head)
    alone                the model in the same process without a wrapper, and
    alone fxopt B        torch.compile(model, backend=fxopt.remat.backend(B)): the
                         single-process reference, as ratios to ``alone``

and reports, per rank, for each job's third step (DDP rebuilds its gradient buckets in
the second, a parameter-sized allocation that would otherwise count as memory of the
step): peak memory of the step (torch profiler allocation events,
parameters and gradients excluded; it includes what DDP and FSDP allocate during the step,
FSDP2's gathered parameters among it), the activation peak (the same without the blocks
FSDP2 allocates or frees in its own ``FSDP::`` scopes: gathered parameters, reduce-scatter
buffers, the unsharded gradients it consumes), the bytes live at the forward/backward boundary
(what the forward saved for the backward: activations; without FSDP2's own blocks, among them
the root module's parameters, which FSDP2 keeps gathered from the forward to the backward),
and median CPU time per step, as
ratios to the same job without remat on that rank, and the largest gradient difference
from it. Writes
results/remat_ddp.json.

    python benchmarks/remat_ddp.py                     # worlds 2 and 4, both wrappers and models
    python benchmarks/remat_ddp.py --world 2 --models resnet50_224 --budgets 0.5
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from common import RESULTS, command_line, machine_info, steady_allocator, write_json


def resnet50(batch: int = 2, image: int = 64):
    from fxopt import zoo
    from fxopt.zoo.resnet import Bottleneck

    entry = zoo.create("resnet50", batch=batch, image=image)
    x = entry.example_inputs[0]

    def loss_fn(model, x, y):
        return F.cross_entropy(model(x), y)

    def blocks(model):
        return [m for m in model.modules() if isinstance(m, Bottleneck)]

    return entry.description, entry.model.train(), (x, torch.arange(batch)), loss_fn, blocks


def bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(attn_implementation="eager")
    model = BertModel(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 1, 1, 64)  # additive 4-D mask: transformers' own branches on values

    def loss_fn(model, ids, mask):  # every parameter used: DDP wants a gradient for each
        out = model(input_ids=ids, attention_mask=mask)
        return out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()

    description = "HF BertModel, 12 layers, hidden 768, batch 2, seq 64, dropout 0.1"
    return description, model, (ids, mask), loss_fn, lambda m: list(m.encoder.layer)


# ResNet-50 at 64 px holds little activation memory per rank (about 13 MiB at batch 2)
# beside one parameter-sized oneDNN scratchpad in its last stage's 3x3 convolution
# backward (36 MiB on AVX2, whatever the batch or image size), a floor of about 0.77 of
# the step's peak that no plan and no checkpointing goes under; at 224 px, the size it is
# trained at, activations are most of the peak, as where remat is wanted.
MODELS = {
    "resnet50": resnet50,
    "resnet50_224": functools.partial(resnet50, image=224),
    "bert": bert,
}


def _min_cut_backend(budget: float):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, **kwargs):
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    # keep_inference_input_mutations as in benchmarks/remat.py: without it a model with
    # BatchNorm in training mode fails under min-cut (an in-place error on its statistics).
    return aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=partition,
        keep_inference_input_mutations=True,
    )


def _checkpointed(model, blocks):
    from torch.utils.checkpoint import checkpoint

    for block in blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def _sharded(model, blocks):
    """FSDP2 as it is meant to be used: each block sharded, then the root."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):
        fully_shard(block)
    return fully_shard(model)


def _builders(wrapper: str, base, blocks, budgets: list[float]) -> dict:
    """Each variant's name and how to build it: () -> (module holding the parameters, what
    a step calls). The wrapper's job without remat comes first; ``alone`` is the same model
    in this process without any wrapper, the single-process reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxopt.remat import backend, compile_blocks
    from fxopt.remat.blocks import _graph_break, _own_code, _own_frame

    def fresh():
        return copy.deepcopy(base)

    def plain(model):
        return model, model

    def per_block(compiler):
        def build():  # FSDP2's hooks stay outside the graphs: compile each block's forward
            model = _sharded(fresh(), blocks)
            for block in blocks(model):
                # Each block in a frame of its own, as compile_blocks does: blocks of one
                # class are otherwise recompiles of one code object, and past Dynamo's
                # limit of 8 the rest run eagerly, without the peer's partitioner.
                forward = _own_frame(block.forward)
                compiled = torch.compile(forward, backend=compiler, dynamic=False)
                block.forward = _graph_break(compiled)
            # And the root's code around the blocks (a stem, embeddings, a head), as
            # compile_blocks(..., root=model) compiles it for fxopt.
            forward = _own_code(model.forward)
            model.forward = torch.compile(forward, backend=compiler, dynamic=False)
            return model, model

        return build

    def fxopt_blocks(budget):
        def build():
            model = _sharded(fresh(), blocks)
            compile_blocks(blocks(model), budget, root=model)
            return model, model

        return build

    def ddp_compiled(compiler):
        def build():
            model = DDP(fresh())
            return model, torch.compile(model, backend=compiler, dynamic=False)

        return build

    first = budgets[0]
    if wrapper == "fsdp2":
        made = {
            "fsdp2": lambda: plain(_sharded(fresh(), blocks)),
            "fsdp2 checkpoint": lambda: plain(_sharded(_checkpointed(fresh(), blocks), blocks)),
            "fsdp2 compiled": per_block("aot_eager"),
            **{f"fsdp2 fxopt {b}": fxopt_blocks(b) for b in budgets},
            f"fsdp2 min-cut {first}": per_block(_min_cut_backend(first)),
        }
    else:
        made = {
            "ddp": lambda: plain(DDP(fresh())),
            "ddp checkpoint": lambda: plain(DDP(_checkpointed(fresh(), blocks))),
            "ddp compiled": ddp_compiled("aot_eager"),
            **{f"ddp fxopt {b}": ddp_compiled(backend(b)) for b in budgets},
            f"ddp min-cut {first}": ddp_compiled(_min_cut_backend(first)),
        }

    def alone_fxopt():
        model = fresh()
        return model, torch.compile(model, backend=backend(first), dynamic=False)

    made["alone"] = lambda: plain(fresh())
    made[f"alone fxopt {first}"] = alone_fxopt
    return made


def _groups(names: list[str], size: int) -> list[list[str]]:
    """The variants in groups of at most ``size`` besides the reference (``names[0]``),
    each group run in processes of its own (BERT-base on four ranks does not fit 24 GB
    with every variant at once). A variant stays with the one it is compared with, where
    the size allows: fxopt with the job compiled without remat, ``alone fxopt`` with
    ``alone``.

    >>> _groups(["ddp", "ddp checkpoint", "ddp compiled", "ddp fxopt 0.5", "alone"], 2)
    [['ddp', 'ddp checkpoint'], ['ddp', 'ddp compiled', 'ddp fxopt 0.5'], ['ddp', 'alone']]
    """
    if size <= 0:
        return [list(names)]
    units: list[list[str]] = []
    for name in names[1:]:
        home = next((u for u in units if _compared(u[0], name)), None)
        if home is None:
            units.append([name])
        else:
            home.append(name)
    chunks = [unit[i : i + size] for unit in units for i in range(0, len(unit), size)]
    groups: list[list[str]] = []
    for chunk in chunks:
        if groups and len(groups[-1]) - 1 + len(chunk) <= size:
            groups[-1].extend(chunk)
        else:
            groups.append([names[0], *chunk])
    return groups


def _compared(first: str, name: str) -> bool:
    """Whether ``name`` is compared with ``first`` (see _groups)."""
    if first.startswith("alone"):
        return name.startswith("alone")
    return first.endswith(" compiled") and " fxopt " in name and not name.startswith("alone")


def _local(grad):
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _reference_of(name: str, wrapper: str) -> str:
    return "alone" if name.startswith("alone") else wrapper


def _worker(rank, world, store, wrapper, model_name, budgets, names, rounds, out) -> None:
    from fxopt.remat.measure import boundary, measure_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        description, base, inputs, loss_fn, blocks = MODELS[model_name]()
        builders = _builders(wrapper, base, blocks, budgets)
        variants = {name: builders[name]() for name in names}
        rows = {}
        expected = {}  # each reference job's gradients; each variant's are compared at once
        for name, (module, forward) in list(variants.items()):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(1000 + rank)
            start = time.perf_counter()
            try:
                loss_fn(forward, *inputs).backward()
            except Exception as error:  # a tool failing under DDP is a result, not a crash
                text = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
                rows[name] = {"status": "failed", "error": text[:300]}
                del variants[name]
                continue
            rows[name] = {
                "status": "ok",
                "first_step_s": time.perf_counter() - start,
                "samples_s": [],
            }
            grads = [_local(p.grad) for p in module.parameters() if p.grad is not None]
            reference = expected.setdefault(
                _reference_of(name, wrapper), [g.clone() for g in grads]
            )
            pairs = zip(grads, reference, strict=True)
            # (FSDP2 on four ranks leaves some rank an empty shard of a small parameter)
            errors = [float((a - b).abs().max()) for a, b in pairs if a.numel()]
            rows[name]["max_grad_error"] = max(errors, default=0.0)
            module.zero_grad(set_to_none=True)  # (BERT-base: 5 variants' gradients per rank)
        # DDP rebuilds its gradient buckets in a model's second forward (in the order the
        # first backward made gradients): a parameter-sized allocation that a measured
        # second step would count as memory of the step, and as saved at the boundary
        # (ResNet-50: about 100 MB against 20-odd MB of activations). Measure the third.
        for module, forward in variants.values():
            loss_fn(forward, *inputs).backward()
            module.zero_grad(set_to_none=True)
        for name, (module, forward) in variants.items():

            def step(f=forward):
                loss = loss_fn(f, *inputs)
                boundary()  # what the forward leaves alive for the backward: saved bytes
                loss.backward()

            memory = measure_step(step, module)
            rows[name].update(
                peak_bytes=memory.peak_bytes,
                activation_peak_bytes=memory.activation_peak_bytes,
                saved_bytes=memory.saved_bytes,
                activation_saved_bytes=memory.activation_saved_bytes,
            )
            module.zero_grad(set_to_none=True)
        for _ in range(rounds):
            for name, (module, forward) in variants.items():
                module.zero_grad(set_to_none=True)
                start = time.process_time()
                loss_fn(forward, *inputs).backward()
                rows[name]["samples_s"].append(time.process_time() - start)
                module.zero_grad(set_to_none=True)
        _add_ratios(rows, list(variants), wrapper)
        torch.save({"description": description, "rows": rows}, out)
    finally:
        dist.destroy_process_group()


def _add_ratios(rows: dict, names: list[str], wrapper: str) -> None:
    """Each variant's figures as ratios to its reference, the wrapper's job without remat
    (``alone`` rows: the model alone), and a remat job's time to the job compiled without
    remat."""
    control = f"{wrapper} compiled"
    for name in names:
        row = rows[name]
        row["median_s"] = statistics.median(row["samples_s"])
    for name in names:
        row, base = rows[name], rows[_reference_of(name, wrapper)]
        for key in ("peak", "activation_peak", "saved", "activation_saved"):
            row[f"{key}_ratio"] = row[f"{key}_bytes"] / base[f"{key}_bytes"]
        row["time_ratio"] = row["median_s"] / base["median_s"]
        remat = name.startswith(wrapper) and any(k in name for k in (" fxopt ", " min-cut "))
        if control in names and remat:
            row["time_vs_compiled"] = row["median_s"] / rows[control]["median_s"]


def _spawned(rank, world, store, wrapper, model_name, budgets, names, rounds, outs):
    _worker(rank, world, store, wrapper, model_name, budgets, names, rounds, outs[rank])


def run(
    world: int, wrapper: str, model_name: str, budgets: list[float], rounds: int, group: int
) -> dict:
    """One job: every variant, in groups of processes of their own (see _groups); each
    group's ratios are to its own run of the reference, whose first run is kept."""
    names = list(_builders(wrapper, None, None, budgets))
    ranks: list[dict] = [{} for _ in range(world)]
    description = ""
    for names_run in _groups(names, group):
        with tempfile.TemporaryDirectory() as tmp:
            outs = [str(Path(tmp) / f"rank{r}.pt") for r in range(world)]
            store = str(Path(tmp) / "store")
            args = (world, store, wrapper, model_name, budgets, names_run, rounds, outs)
            mp.spawn(_spawned, args=args, nprocs=world)
            for rows, out in zip(ranks, outs, strict=True):
                found = torch.load(out)
                description = found["description"]
                for name, row in found["rows"].items():
                    rows.setdefault(name, row)
    return {
        "world": world,
        "wrapper": wrapper,
        "model": model_name,
        "description": description,
        "budgets": budgets,
        "ranks": ranks,
    }


def _key(result: dict) -> tuple:
    return (result["world"], result["wrapper"], result["model"])


def _ordered(runs: list[dict]) -> list[dict]:
    """Runs in the order a full invocation makes them (world, wrapper, model)."""
    wrappers, models = ["ddp", "fsdp2"], list(MODELS)
    return sorted(
        runs,
        key=lambda r: (r["world"], wrappers.index(r["wrapper"]), models.index(r["model"])),
    )


def _kept_runs(path: Path) -> tuple[list[dict], str]:
    """The runs already in ``path`` and the command that made them."""
    import json

    if not path.exists():
        return [], ""
    old = json.loads(path.read_text())
    return old.get("runs", []), old.get("command", "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--wrappers", nargs="+", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"])
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.5, 0.7],
        help="fxopt budgets; torch's min-cut and the single-process row take the first",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--group",
        type=int,
        default=0,
        help="run the variants in groups of at most this many besides the reference, each "
        "in processes of its own (0: all at once); BERT-base on 4 ranks takes 2",
    )
    parser.add_argument("--out", default=str(RESULTS / "remat_ddp.json"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the runs already in --out, replacing those of the same world, wrapper and model",
    )
    args = parser.parse_args(argv)
    allocator = steady_allocator()  # glibc malloc pinned: see docs/measuring.md
    torch.set_num_threads(1)  # as in every rank (machine_info reports this process's)
    start = time.perf_counter()
    runs = []
    kept, kept_command = _kept_runs(Path(args.out)) if args.merge else ([], "")
    data = {
        "machine": machine_info(),
        "allocator": allocator,
        "command": command_line(),
        "config": {
            "budget": args.budgets[0],
            "budgets": args.budgets,
            "rounds": args.rounds,
            "threads_per_rank": 1,
        },
        "runs": runs,
    }
    for world, wrapper, model_name in itertools.product(args.world, args.wrappers, args.models):
        group = args.group or (2 if (world >= 4 and model_name == "bert") else 0)
        result = run(world, wrapper, model_name, args.budgets, args.rounds, group)
        runs.append(result)
        for name in result["ranks"][0]:
            failed = [r[name]["error"] for r in result["ranks"] if r[name]["status"] != "ok"]
            if failed:
                print(f"world {world} {model_name:8s} {name:20s} failed: {failed[0]}")
                continue
            peaks = [r[name]["peak_ratio"] for r in result["ranks"]]
            own = [r[name]["activation_peak_ratio"] for r in result["ranks"]]
            saved = [r[name]["activation_saved_ratio"] for r in result["ranks"]]
            times = [r[name]["time_ratio"] for r in result["ranks"]]
            errors = [r[name]["max_grad_error"] for r in result["ranks"]]
            compiled = [r[name].get("time_vs_compiled") for r in result["ranks"]]
            versus = f" ({max(compiled):.2f}x compiled)" if None not in compiled else ""
            print(
                f"world {world} {model_name:8s} {name:20s} peak {max(peaks):.2f} "
                f"act. peak {max(own):.2f} saved {max(saved):.2f} "
                f"time {max(times):.2f}{versus} grad err {max(errors):.1e}",
                flush=True,
            )
        data["runtime_s"] = time.perf_counter() - start
        if kept:
            done = {_key(r) for r in runs}
            data["runs"] = _ordered([r for r in kept if _key(r) not in done] + runs)
            data["command"] = f"{kept_command}; then {command_line()} (merged)"
        write_json(Path(args.out), data)  # after each run: a later failure keeps these
    print(f"wrote {args.out} in {data['runtime_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
