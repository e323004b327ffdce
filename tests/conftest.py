import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    # Tests build random weights; a fixed seed makes failures reproducible.
    torch.manual_seed(0)
    yield
