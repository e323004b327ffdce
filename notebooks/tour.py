# %% [markdown]
# # A tour of fxopt
#
# fxopt captures a PyTorch model as a `torch.fx` graph, rewrites it with passes, checks
# that the rewritten model computes the same thing, and measures what changed. This
# notebook runs its four jobs on built-in models, on the CPU, in a minute or two:
#
# 1. **optimize** a model for inference, with what each pass did and skipped;
# 2. **remat**: trade recomputation for training memory, along a budget curve;
# 3. **tile**: cover a graph with fused-kernel patterns, and draw the cover;
# 4. **convert** to Circle, float and quantized, each file run in onert before it is
#    returned.
#
# The source of this notebook is `notebooks/tour.py` (jupytext); the test suite runs it.

# %%
import copy
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import Image

import fxopt
from fxopt import zoo
from fxopt.report import explain

torch.manual_seed(0)
torch.set_num_threads(1)

# %% [markdown]
# ## 1. Optimize
#
# `zoo:cnn_bn` is a small CNN with BatchNorm. `fxopt.optimize` captures it, folds the
# BatchNorms into the convolutions, removes what is redundant, picks fused CPU kernels
# where they measure faster, and verifies the result on the example, on random inputs and
# on another batch size.

# %%
entry = zoo.create("cnn_bn")
result = fxopt.optimize(entry.model.eval(), entry.example_inputs, benchmark_runs=0)
report = result.report
print(f"nodes {report['nodes_before']} -> {report['nodes_after']}, verified: {report['verified']}")
for record in report["passes"]:
    if record["changed"]:
        print(f"  {record['name']} (round {record['round']}): {record['stats']}")
layout = report["layout"] or {}
print("layout step:", layout.get("chosen"), layout.get("kernels"))

# %% [markdown]
# What a pass left alone, and why (the CLI's `--explain`):

# %%
skipped = explain(report)
print(f"{len(skipped)} sites skipped")
for line in skipped[:8]:
    print(" ", line)

# %% [markdown]
# The graph before and after, op by op:

# %%
print("before:", report["ops_before"])
print("after: ", report["ops_after"])

# %% [markdown]
# The optimized module accepts every input its contract allows (here any batch size) and
# refuses the rest with a clear error instead of computing them wrongly:

# %%
x = torch.randn(5, *entry.example_inputs[0].shape[1:])
print(result.contract.describe())
print("batch 5 equal to eager:", torch.allclose(result.module(x), entry.model.eval()(x), atol=1e-5))
try:
    result.module(x.double())
except fxopt.InputMismatchError as error:
    print("refused:", str(error).splitlines()[0])

# %% [markdown]
# ## 2. Remat: memory against time
#
# `compile_step` captures forward, loss and backward as one graph, profiles it, and plans
# which activations to recompute in the backward so the peak fits a budget. `replan`
# reuses the profile for other budgets: the curve below is the planner's estimate of peak
# activation memory against extra compute. Gradients are eager's, bit for bit.

# %%
from fxopt.remat import compile_step  # noqa: E402

layers = [(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256), torch.nn.GELU()) for _ in range(6)]
net = torch.nn.Sequential(*[m for layer in layers for m in layer], torch.nn.Linear(256, 10))
net = net.train()
images, labels = torch.randn(128, 256), torch.randint(0, 10, (128,))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


step = compile_step(copy.deepcopy(net), loss_fn, (images, labels), memory_budget=1.0)
points = []
for budget in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
    try:
        plan = step.replan(budget).plan
    except fxopt.remat.BudgetError:
        break
    points.append((plan.estimated_overhead, plan.peak / plan.baseline_peak))
    print(
        f"budget {budget}: peak {points[-1][1]:.2f} of the baseline, +{points[-1][0]:.1%} compute"
    )

plt.figure(figsize=(4, 3))
plt.plot([100 * o for o, _ in points], [p for _, p in points], "o-")
plt.xlabel("extra compute per step (%)")
plt.ylabel("peak activations (× baseline)")
plt.title("6 × (Linear, BatchNorm, GELU), greedy")
plt.tight_layout()
plt.show()

# %%
tight = compile_step(copy.deepcopy(net), loss_fn, (images, labels), memory_budget=0.6)
reference = copy.deepcopy(net)
tight(images, labels)
loss_fn(reference, images, labels).backward()
same = all(
    torch.equal(a.grad, b.grad)
    for a, b in zip(tight.model.parameters(), reference.parameters(), strict=True)
)
print(f"recomputes {len(tight.plan.recompute)} nodes; gradients equal to eager: {same}")

# %% [markdown]
# ## 3. Tile: which fused kernels cover a graph
#
# The tiler covers a graph with non-overlapping placements of library patterns, the most
# nodes first, then the fewest tiles. Here a two-layer BERT against the built-in
# `transformer` library, drawn with one colour per kernel.

# %%
from fxopt.tiling import tile  # noqa: E402
from fxopt.tiling.draw import draw_png  # noqa: E402

bert = zoo.create("bert", layers=2, seq=8)
tiling = tile(fxopt.trace(bert.model, bert.example_inputs), "transformer")
print(f"{tiling.covered}/{tiling.nodes} nodes covered by {tiling.tile_count} tiles")
picture = draw_png(tiling, Path(tempfile.mkdtemp()) / "bert.png", title="2-layer BERT")
Image(filename=str(picture), width=700)

# %% [markdown]
# ## 4. Convert to Circle
#
# `circle.convert` lowers the model through fxopt's passes (BatchNorm folded, activations
# fused, NHWC kept between convolutions) and runs the file in onert, the ONE runtime, on
# the example and on a second input, before returning it.

# %%
from fxopt import circle  # noqa: E402
from fxopt.circle.config import CircleConfig  # noqa: E402

resnet = zoo.create("resnet18", image=32)
model = circle.convert(resnet.model.eval(), resnet.example_inputs)
print(model.summary())
print(model.validation.message)

# %% [markdown]
# Quantized: `quantize="uint8"` calibrates fxopt's post-training quantizer on random
# batches like the example, writes a uint8 file, runs it in onert and reports its accuracy
# against the float model.

# %%
small = zoo.create("cnn_bn")
quantized = circle.convert(
    small.model.eval(), small.example_inputs, config=CircleConfig(quantize="uint8")
)
quantization = quantized.report["quantization"]
print(quantized.validation.message)
print("integer ops:", quantization["quantized_ops"], "float ops:", quantization["float_ops"])
print("against the float model:", quantization["vs_float"])
