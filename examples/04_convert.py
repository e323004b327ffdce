"""Convert a model to Circle (the ONE NPU format), checked in onert, the ONE runtime."""

import tempfile
from pathlib import Path

import torch

from fxopt import circle, zoo
from fxopt.circle.converter import example_outputs
from fxopt.circle.runtime import onert_available

if __name__ == "__main__":
    # 1. A CNN: BatchNorm folded, ReLU fused, NHWC kept from the first conv to the classifier.
    #    convert() runs the file in onert on the example and on a second input before
    #    returning it; a file that differs from PyTorch is a CircleValidationError.
    entry = zoo.create("resnet18", image=32)
    model = circle.convert(entry.model, entry.example_inputs)
    print(model.summary())
    path = model.save(Path(tempfile.mkdtemp()) / "resnet18.circle")
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")

    # 2. Parity on an input of your own, in the real runtime (when onert is installed).
    if onert_available():
        x = (torch.randn_like(entry.example_inputs[0]),)
        result = circle.validate(model, x, example_outputs(entry.model, x))
        print(f"{result.message} (max abs error {result.max_abs_error:.2g})")

    # 3. Errors list every unsupported op at once, with counts and source lines.
    class Odd(torch.nn.Module):
        def forward(self, x):
            return torch.atan2(x, x + 1) + torch.sort(x).values

    try:
        circle.convert(Odd().eval(), (torch.randn(4),))
    except circle.UnsupportedOpsError as error:
        print(error)
