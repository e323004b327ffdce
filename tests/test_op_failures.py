"""fxopt.op_failures: one line naming the op, its operands and the model's line when a
model fails on its example inputs, eagerly or while traced on fake tensors."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fxopt.op_failures import ExampleInputError, quiet_fake_tensor_failures, run_eagerly


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.first(x)
        return self.second(h)  # the line the errors must name


def _line(marker: str) -> int:
    with open(__file__) as file:
        return next(i for i, line in enumerate(file, 1) if marker in line)


def test_a_wrong_shape_names_the_op_the_operands_the_module_and_the_line():
    with pytest.raises(ExampleInputError) as caught:
        run_eagerly(TwoLayers(), (torch.randn(2, 8)[:, :5],))
    text = str(caught.value)
    assert "float32[2, 5]" in text  # the example input
    assert "aten.addmm on float32[16], float32[2, 5], float32[8, 16]" in text
    assert "module 'first' (Linear)" in text
    assert f"test_op_failures.py:{_line('h = self.first(x)')}" in text
    assert "\n" not in text


def test_a_wrong_dtype_names_both_dtypes():
    with pytest.raises(ExampleInputError, match=r"int64\[2, 8\].*same dtype"):
        run_eagerly(TwoLayers(), (torch.ones(2, 8, dtype=torch.int64),))


def test_an_error_from_python_code_names_its_line():
    class Checked(TwoLayers):
        def forward(self, x):
            if x.shape[-1] != 8:
                raise ValueError(f"expected 8 features, got {x.shape[-1]}")
            return super().forward(x)

    with pytest.raises(ExampleInputError, match=r"ValueError at the model \(Checked\)"):
        run_eagerly(Checked(), (torch.randn(2, 3),))


def test_fake_tensor_failures_are_recorded_and_not_logged(caplog):
    model, x = TwoLayers(), torch.randn(2, 5)
    with (
        caplog.at_level(logging.DEBUG),
        quiet_fake_tensor_failures(model) as failed,
        pytest.raises(RuntimeError),
    ):
        torch.export.export(model, (x,))
    assert not [r for r in caplog.records if "run meta" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].op == "aten.mm" and failed[0].operands == "float32[2, 5], float32[8, 16]"
    assert failed[0].where.startswith("module 'first' (Linear), ")
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    assert not logger.filters  # removed on the way out
