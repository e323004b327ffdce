# %% [markdown]
# # fxopt in five minutes
#
# One cell per job, on built-in models. The longer version, with plots and explanations,
# is `tour.ipynb`. The source of this notebook is `notebooks/essentials.py` (jupytext).

# %%
import torch
import torch.nn.functional as F

import fxopt
from fxopt import circle, zoo
from fxopt.remat import compile_step
from fxopt.tiling import tile

torch.manual_seed(0)

# %% [markdown]
# **Optimize** for inference, verified, for any batch size:

# %%
entry = zoo.create("cnn_bn")
result = fxopt.optimize(entry.model.eval(), entry.example_inputs, benchmark_runs=0)
print(
    result.report["nodes_before"],
    "->",
    result.report["nodes_after"],
    "nodes,",
    "verified:",
    result.report["verified"],
)

# %% [markdown]
# **Remat**: the same training step in less activation memory, same gradients:

# %%
net = zoo.create("resnet18", image=64, batch=8).model.train()
x, y = torch.randn(8, 3, 64, 64), torch.arange(8)
step = compile_step(net, lambda m, x, y: F.cross_entropy(m(x), y), (x, y), memory_budget=0.9)
print(
    f"peak {step.plan.peak / step.plan.baseline_peak:.2f} of the baseline,",
    f"+{step.plan.estimated_overhead:.0%} compute",
)
loss = step(x, y)  # gradients in net's .grad, as after loss.backward()

# %% [markdown]
# **Tile**: which fused kernels cover a graph:

# %%
bert = zoo.create("bert", layers=2, seq=8)
tiling = tile(fxopt.trace(bert.model, bert.example_inputs), "transformer")
print(f"{tiling.covered}/{tiling.nodes} nodes in {tiling.tile_count} tiles")

# %% [markdown]
# **Convert** to Circle, run in onert before it is returned:

# %%
model = circle.convert(entry.model.eval(), entry.example_inputs)
print(model.op_counts, "-", model.validation.message)
