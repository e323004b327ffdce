"""Optimize a model with duplicated work, at both capture levels, and print what changed."""

import torch
import torch.nn.functional as F
from torch import nn

import fxopt


class Redundant(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 16)

    def forward(self, x):
        a = F.relu(x)
        b = F.relu(x)  # the same work again
        return self.encoder(a) + self.encoder(b)  # and again, through a module


if __name__ == "__main__":
    x = torch.randn(4, 16)
    model = Redundant().eval()  # eval: optimizing for inference
    for mode in ("fx", "export"):
        result = fxopt.optimize(model, x, mode=mode, benchmark_runs=0)
        report = result.report
        print(
            f"{mode:6}: {report['nodes_before']} → {report['nodes_after']} nodes, "
            f"verified={report['verified']}, ops after: {report['ops_after']}"
        )
    # What the optimized module accepts: dim 0 varies (dynamic="batch", the default).
    print(result.contract.describe())
    y = torch.randn(9, 16)
    assert torch.allclose(result.module(y), model(y), atol=1e-6)
    try:
        result.module(y.double())  # optimized and verified for float32 only
    except fxopt.InputMismatchError as error:
        print(f"refused: {error}")
