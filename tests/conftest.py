import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core: each takes its share of the cores
    # rather than every worker starting a thread per core.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


@pytest.fixture(autouse=True)
def _deterministic():
    # Tests build random weights; a fixed seed makes failures reproducible.
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _gemm_as_before(monkeypatch):
    # The speed preset times MKL's and oneDNN's GEMM per linear shape (gemm_timing): which
    # wins depends on the CPU. Tests that check kernels by name get MKL's wherever this
    # build has it; tests/test_gemm_timing.py checks the timed choice itself.
    from fxopt.passes import gemm_timing

    monkeypatch.setattr(gemm_timing, "FORCED", "mkl")
    # Linears of one input stay apart unless a test asks (tests/test_merge_linears.py).
    monkeypatch.setattr(gemm_timing, "FORCED_STACKING", False)
    yield
