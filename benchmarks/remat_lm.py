"""Training memory of a language model: the LM head's floor, and the memory/time curve.

A Llama-shaped decoder from transformers (random weights; hidden 256, 4 layers, GQA 8/2,
vocabulary 32000; batch 2 × 256 tokens; no dropout, so every variant's gradients compare
with eager's), its LM loss (``labels=input_ids``), one process, one thread:

    eager                      forward, backward
    checkpointing              transformers' own gradient checkpointing (non-reentrant)
    inductor                   torch.compile(model): Inductor, its default min-cut
    inductor min-cut B         torch.compile with activation_memory_budget=B
    fxopt B                    compile_step(memory_budget=B, lm_head_chunks="auto"): the
                               LM head in chunks when the budget needs it (issue 38)
    fxopt B, head unchunked    compile_step(memory_budget=B): the default, no chunks

Per variant: peak activation memory of a step (torch profiler allocation events; the
parameters and their gradients excluded), CPU time per step (round-robin, median) as a
ratio to eager's, and the largest gradient difference from eager. Writes
results/remat_lm.json and results/remat_lm.png (memory against time).

    python benchmarks/remat_lm.py             # 8 rounds
    python benchmarks/remat_lm.py --quick     # a smaller model, 3 rounds
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch

from common import RESULTS, command_line, machine_info, steady_allocator, write_json
from fxopt.remat import compile_step
from fxopt.remat.measure import boundary, with_boundary_marker
from remat import Variant, build_variants, console, measure_variants

FXOPT_BUDGETS = (1.0, 0.7, 0.5, 0.3, 0.2, 0.1)
MIN_CUT_BUDGETS = (0.5, 0.1)


def llama(quick: bool):
    import transformers

    size = (
        dict(hidden_size=128, num_hidden_layers=2, vocab_size=8000)
        if quick
        else dict(hidden_size=256, num_hidden_layers=4, vocab_size=32000)
    )
    config = transformers.LlamaConfig(
        intermediate_size=2 * size["hidden_size"],
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        **size,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    batch, length = 2, 256
    ids = torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator())
    description = (
        f"transformers Llama, hidden {config.hidden_size}, {config.num_hidden_layers} layers,"
        f" GQA 8/2, vocabulary {config.vocab_size}; batch {batch} × {length} tokens"
    )
    return description, model, (ids,), batch * length * config.vocab_size * 4


def lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _stepping(forward, model, inputs, name, kind, budget=None) -> Variant:
    def run():
        loss = lm_loss(forward, *inputs)
        boundary()
        loss.backward()
        return loss

    return Variant(name, kind, run, model, budget=budget)


def checkpointing_variant(model, inputs) -> Variant:
    # transformers 5 renamed gradient_checkpointing_enable (and its keyword).
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    return _stepping(model, model, inputs, "checkpointing", "checkpoint")


def inductor_variant(model, inputs, budget: float | None) -> Variant:
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def inductor_at_budget(gm, example_inputs):
        with functorch_config.patch(activation_memory_budget=1.0 if budget is None else budget):
            return compile_fx(gm, example_inputs)

    forward = torch.compile(model, dynamic=False, backend=inductor_at_budget)
    name = "inductor" if budget is None else f"inductor min-cut {budget}"
    variant = _stepping(forward, model, inputs, name, "min-cut", budget)
    start = time.perf_counter()
    variant.run()  # compiles
    variant.extra["first_step_s"] = time.perf_counter() - start
    for p in model.parameters():
        p.grad = None
    return variant


def fxopt_variant(model, inputs, budget: float, chunks: int | None) -> Variant:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = compile_step(model, lm_loss, inputs, memory_budget=budget, lm_head_chunks=chunks)
    step.graph = with_boundary_marker(step.graph)
    name = f"fxopt {budget}" + (", head unchunked" if chunks == 1 else "")
    variant = Variant(name, "fxopt", lambda: step(*inputs), model, "greedy", budget)
    report = step.report()
    variant.extra |= {
        "lm_head_chunks": report["lm_head"]["chunks"],
        "planned_peak_bytes": report["optimized"]["peak_activation_bytes"],
        "budget_met": step.plan.details.get("budget_met", True),
        "warnings": [str(w.message)[:300] for w in caught if "fxopt" in str(w.message)],
    }
    return variant


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"eager": "ks", "checkpoint": "C2^", "min-cut": "C1o", "fxopt": "C0D"}
    for kind, style in styles.items():
        mine = [r for r in rows if r["kind"] == kind and r["status"] == "ok"]
        if not mine:
            continue
        xs = [r["time_ratio"] for r in mine]
        ys = [r["peak_bytes"] / 2**20 for r in mine]
        ax.plot(xs, ys, style, label=kind, linestyle="-" if kind == "fxopt" else "none")
        for r, x, y in zip(mine, xs, ys):
            ax.annotate(
                r["variant"].removeprefix("fxopt ").removeprefix("inductor "),
                (x, y),
                fontsize=7,
                xytext=(4, 3),
                textcoords="offset points",
            )
    ax.set_xlabel("CPU time per step / eager's")
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title("Llama LM loss: training memory against time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "remat_lm.json")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("remat_lm: transformers is not installed (pip install -e '.[hf]')", file=sys.stderr)
        return 2
    steady_allocator()
    torch.set_num_threads(1)
    started = time.perf_counter()
    rounds = args.rounds or (3 if args.quick else 8)
    description, model, inputs, logit_bytes = llama(args.quick)
    console.print(f"[bold]remat_lm[/]: {description}")
    variants: list[Variant] = []

    def add(build, label: str) -> None:
        variants.extend(build_variants(build, label, model))

    add(lambda: _stepping(model, model, inputs, "eager", "eager"), "eager")
    add(lambda: checkpointing_variant(copy.deepcopy(model), inputs), "checkpointing")
    add(lambda: inductor_variant(copy.deepcopy(model), inputs, None), "inductor")
    for b in MIN_CUT_BUDGETS:
        add(lambda b=b: inductor_variant(copy.deepcopy(model), inputs, b), f"inductor {b}")
    for b in FXOPT_BUDGETS:
        add(lambda b=b: fxopt_variant(copy.deepcopy(model), inputs, b, "auto"), f"fxopt {b}")
    add(lambda: fxopt_variant(copy.deepcopy(model), inputs, 0.5, 1), "fxopt 0.5 unchunked")
    rows = measure_variants(variants, rounds)
    result = {
        "machine": machine_info(),
        "command": command_line(),
        "config": {"quick": args.quick, "rounds": rounds, "threads": 1},
        "runtime_s": round(time.perf_counter() - started, 1),
        "description": description,
        "logit_bytes": logit_bytes,
        "rows": rows,
    }
    write_json(args.out, result)
    plot(rows, args.out.with_suffix(".png"))
    for r in rows:
        console.print(
            f"  {r['variant']:<28} peak {r.get('peak_bytes', 0) / 2**20:8.1f} MiB"
            f"  time {r.get('time_ratio', float('nan')):.2f}×  grad err"
            f" {r.get('max_grad_error', float('nan')):.1e}  {r['status']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
