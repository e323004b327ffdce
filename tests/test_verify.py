import math
import os

import torch
from torch import nn

from fxopt.harness import verify_pass
from fxopt.ir.sampling import random_inputs_like
from fxopt.verify import (
    check_gradients,
    check_outputs,
    check_parameters,
    check_repeatable,
    compare,
    tolerance,
)
from tests.models.seed import SimpleMLP


class Scaled(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


def test_compare_reports_max_error_and_structure():
    assert compare(torch.ones(3), torch.ones(3)).ok
    result = compare(torch.ones(3), torch.tensor([1.0, 1.5, 1.0]))
    assert not result.ok and math.isclose(result.max_abs_error, 0.5)
    assert not compare((torch.ones(1),), [torch.ones(1)]).ok
    assert not compare(torch.ones(2), torch.ones(2, dtype=torch.float64)).ok
    nan = torch.tensor([float("nan")])
    assert compare(nan, nan.clone()).ok
    assert not compare(torch.zeros(1), nan).ok


def test_tolerances_depend_on_dtype():
    assert tolerance(torch.float16)[0] > tolerance(torch.float32)[0] > tolerance(torch.float64)[0]
    assert tolerance(torch.int64) == (0.0, 0.0)


def test_random_inputs_keep_integer_range_and_dtype():
    ids = torch.tensor([[3, 7, 5]])
    ((new_ids, new_x),) = random_inputs_like((ids, torch.randn(2, 2)), 1)
    assert new_ids.dtype == torch.int64 and new_ids.min() >= 3 and new_ids.max() <= 7
    assert new_x.shape == (2, 2)


def test_check_outputs_detects_a_difference_on_a_random_input():
    torch.manual_seed(0)
    a, b = Scaled(1.0), Scaled(1.0)
    b.load_state_dict(a.state_dict())
    assert check_outputs(a, b, (torch.randn(2, 4),)).ok
    b.scale = 1.01
    result = check_outputs(a, b, (torch.randn(2, 4),))
    assert not result.ok and result.failing_input == 0 and result.max_abs_error > 0


def test_check_gradients_compares_parameters_by_name():
    a = SimpleMLP()
    b = SimpleMLP()
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 32)
    ok = check_gradients(a, b, (x,))
    assert ok.ok and ok.details["compared"] == 7  # 6 parameters + the input
    with torch.no_grad():
        b.fc1.weight.mul_(1.1)
    assert not check_gradients(a, b, (x,)).ok


def test_repeatable_catches_nondeterminism_but_not_state_updates():
    assert check_repeatable(nn.Linear(2, 2), (torch.randn(1, 2),)).ok

    class Unseeded(nn.Module):
        def forward(self, x):
            # Randomness from the OS: torch's seed does not make it repeatable.
            return x + int.from_bytes(os.urandom(4), "little")

    assert not check_repeatable(Unseeded(), (torch.randn(2),)).ok

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1  # state that changes per call is fine: each run starts fresh
            return x * self.calls

    assert check_repeatable(Counter(), (torch.randn(2),)).ok


def test_parameter_check():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.extra = nn.Parameter(torch.zeros(1))
    assert not check_parameters(a, b).ok
    assert check_parameters(a, b, allow_new=True).ok


def test_verify_pass_harness_reports_all_four_checks():
    report = verify_pass(SimpleMLP(), "cse", torch.randn(2, 32))
    assert (report["numerical"], report["gradient"], report["lint"], report["params"]) == (
        True,
        True,
        True,
        True,
    )


def test_nan_and_infinities_in_the_same_places_compare_equal():
    inf, nan = math.inf, math.nan
    assert compare(torch.tensor([1.0, inf, -inf, nan]), torch.tensor([1.0, inf, -inf, nan])).ok
    for wrong in ([1.0, -inf, -inf, nan], [1.0, inf, -inf, 0.0], [1.0, 5.0, -inf, nan]):
        result = compare(torch.tensor([1.0, inf, -inf, nan]), torch.tensor(wrong))
        assert not result.ok and result.max_abs_error == math.inf


def test_repeatable_accepts_the_same_nan_in_every_run():
    class LogOf(nn.Module):
        def forward(self, x):
            return torch.log(x)

    assert check_repeatable(LogOf(), (torch.tensor([-1.0, 0.0, 2.0]),)).ok


class Cancel(nn.Module):
    """(x + 1e4) - 1e4: float32 keeps ~6e-4 of x's precision; the order is the rounding."""

    def __init__(self, first: float, factor: float = 1.0):
        super().__init__()
        self.first, self.factor = first, factor

    def forward(self, x):
        return ((x + self.first) - self.first) * self.factor


def test_deep_rounding_is_judged_against_a_float64_run():
    x = (torch.randn(256),)
    # Other rounding: up to 7e-4 apart on outputs of scale 1 (the fixed 1e-4 says no), and
    # closer to the float64 answer than the original (6e3 rounds on a finer grid than 1e4).
    rounded = check_outputs(Cancel(1e4), Cancel(6e3), x, random_sets=0)
    assert compare(Cancel(1e4)(*x), Cancel(6e3)(*x)).ok is False
    assert rounded.ok and rounded.details["judged_in_float64"] == 1
    # A real miscomputation of the same size is still caught.
    assert not check_outputs(Cancel(1e4), Cancel(1e4, factor=1.001), x, random_sets=0).ok


def test_nonsense_tolerances_are_errors():
    import pytest

    from fxopt.errors import UserInputError

    model = nn.Linear(2, 2)
    for bad in (math.nan, -1.0, math.inf, "1e-3"):
        with pytest.raises(UserInputError, match="rtol"):
            check_outputs(model, model, (torch.randn(1, 2),), rtol=bad, atol=0.0)


class _CountedRuns(torch.nn.Module):
    """Counts its calls in a class attribute, which copies share."""

    runs = 0

    def __init__(self, stateful: bool = False):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.stateful = stateful
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        type(self).runs += 1
        if self.stateful:
            self.seen.add_(1)
        return self.linear(x) + self.seen


def test_expected_cache_runs_the_reference_once_per_input_set():
    from fxopt.verify import check_outputs

    model, x = _CountedRuns().eval(), torch.randn(2, 4)
    cache: dict = {}
    other = (torch.randn(5, 4),)
    _CountedRuns.runs = 0
    assert check_outputs(
        model, model, (x,), random_sets=1, extra_sets=[other], _expected_cache=cache
    ).ok
    first = _CountedRuns.runs
    assert first == 6  # 3 sets, reference and candidate each
    # Same sets again (random values are drawn from the same seed): only the candidate runs.
    assert check_outputs(
        model, model, (x,), random_sets=1, extra_sets=[other], _expected_cache=cache
    ).ok
    assert _CountedRuns.runs - first == 3
    # A different input is not mistaken for a cached one.
    assert check_outputs(model, model, (x + 1,), random_sets=0, _expected_cache=cache).ok
    assert _CountedRuns.runs - first == 5


def test_a_reference_that_changes_its_state_is_not_cached():
    from fxopt.verify import check_outputs

    model, x = _CountedRuns(stateful=True).eval(), torch.randn(2, 4)
    cache: dict = {}
    check_outputs(model, model, (x,), random_sets=0, _expected_cache=cache)
    assert cache == {}


def test_the_capture_run_on_the_example_is_the_first_reference_output():
    import fxopt

    model, x = _CountedRuns().eval(), torch.randn(2, 4)
    optimizer = fxopt.GraphOptimizer(model, x, mode="fx")
    assert len(optimizer.expected_outputs) == 1
    (cached,) = optimizer.expected_outputs.values()
    assert torch.equal(cached, model(x))
    _CountedRuns.runs = 0
    optimizer.optimize(["cse"])
    # Only the reference's forward counts (the candidate is a graph): on one random set
    # and one at another batch size; on the example it ran once already, in the capture.
    assert _CountedRuns.runs == 2


def test_the_float64_run_reads_the_weights_as_they_are_and_matches_a_float64_copy():
    # The float64 judge of a low-precision output raises each operand as its op reads it,
    # instead of copying the model to float64 (twice its weights).
    import copy

    from fxopt.ir.copying import isolated
    from fxopt.verify import InFloat64

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.GELU(), torch.nn.Flatten()
    ).train()
    x = torch.randn(2, 3, 6, 6)
    reference = copy.deepcopy(model).double()
    with torch.no_grad():
        expected = reference(x.double())
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad(), isolated(model) as running, InFloat64():
        got = running(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # The training BatchNorm's statistics were written (in float64, back into float32
    # scratch copies), and the model's own are as they were.
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())
