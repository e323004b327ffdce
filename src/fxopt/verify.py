"""Prove a rewritten model computes what the original computes.

Checks, each returning a small result object rather than a bare bool, so reports can say
*how far off* and *on which input*:

* :func:`check_outputs`: outputs on the example inputs and on random inputs of the same
  shapes and dtypes, both models run under the same RNG seed (so dropout masks agree),
  with per-dtype tolerances. Both run :func:`~fxopt.ir.copying.isolated`: module state such
  as BatchNorm running statistics is never changed by verifying, and no weight is copied.
* :func:`check_gradients`: gradients w.r.t. float inputs and parameters (matched by name).
* :func:`check_repeatable`: repeated runs under one seed agree and contain no new NaN.
* :func:`fxopt.harness.verify_pass`, built on these: the four-part check of a pass.

    >>> import torch
    >>> from fxopt.verify import check_outputs
    >>> m = torch.nn.Linear(3, 2)
    >>> check_outputs(m, torch.fx.symbolic_trace(m), (torch.randn(4, 3),)).ok
    True
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxopt import caches
from fxopt.errors import UserInputError
from fxopt.ir.copying import isolated
from fxopt.ir.sampling import random_inputs_like

# Per-dtype (rtol, atol). float32 is looser than torch.testing's 1.3e-6 because rewrites
# such as folding change the rounding order; 1e-4 still catches any real miscomputation.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Default (rtol, atol) for comparing tensors of ``dtype`` (exact for integers)."""
    return TOLERANCES.get(dtype, (0.0, 0.0))


@dataclass
class Comparison:
    ok: bool
    max_abs_error: float = 0.0
    where: str = ""
    message: str = ""


@dataclass
class CheckResult:
    """Outcome of one check over several inputs."""

    ok: bool
    max_abs_error: float = 0.0
    failing_input: int | None = None
    message: str = ""
    details: dict = field(default_factory=dict)
    #: The candidate's output on the example inputs (check_outputs), for a caller that
    #: checks more on it (check_repeatable's first run) instead of running it again.
    example_output: object = field(default=None, repr=False, compare=False)

    def describe_input(self) -> str | None:
        if self.failing_input is None:
            return None
        return (
            "the example inputs"
            if self.failing_input == 0
            else (f"random input set #{self.failing_input}")
        )


def compare(
    expected: object, actual: object, rtol: float | None = None, atol: float | None = None
) -> Comparison:
    """Compare two (nested) outputs leaf by leaf; NaN equals NaN, inf equals inf.

    A float element passes when ``|a - e| <= atol + rtol * max(|e|, rms(e))``.
    """
    # A torch.Size is a tuple of ints to compare (export returns a model's x.size() as one).
    exp_leaves, exp_spec = pytree.tree_flatten(_sizes_as_tuples(expected))
    act_leaves, act_spec = pytree.tree_flatten(_sizes_as_tuples(actual))
    if exp_spec != act_spec:
        return Comparison(False, math.inf, "", f"output structure differs: {act_spec}")
    worst = 0.0
    for index, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        where = f"output[{index}]"
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return Comparison(False, math.inf, where, "a tensor was replaced by a non-tensor")
        if not isinstance(e, torch.Tensor):
            if e != a:
                return Comparison(False, math.inf, where, f"{a!r} != expected {e!r}")
            continue
        if e.shape != a.shape or e.dtype != a.dtype:
            return Comparison(
                False,
                math.inf,
                where,
                f"got {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}",
            )
        if e.numel() == 0:
            continue
        r, t = tolerance(e.dtype) if rtol is None or atol is None else (rtol, atol)
        e64, a64 = e.detach().to(torch.float64), a.detach().to(torch.float64)
        # Equal values (the same infinity included) and NaN in the same places agree; a NaN
        # or an infinity on one side only is an infinite error.
        same = (e64 == a64) | (torch.isnan(e64) & torch.isnan(a64))
        diff = torch.where(same, torch.zeros_like(e64), (e64 - a64).abs())
        diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
        error = float(diff.max())
        worst = max(worst, error)
        # Relative to each element *and* to the tensor's scale (RMS): a value near zero in
        # a deep network carries rounding error proportional to the activations around it.
        # A non-finite expected value has no tolerance: it is matched exactly or not at all.
        finite_mask = torch.isfinite(e64)
        finite = e64[finite_mask]
        scale = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
        allowed = t + r * torch.clamp(e64.abs(), min=scale)
        allowed = torch.where(finite_mask, allowed, torch.zeros_like(allowed))
        if bool((diff > allowed).any()):
            return Comparison(False, worst, where, f"{where} differs by up to {error:.3g}")
    return Comparison(True, worst)


def _sizes_as_tuples(value: object) -> object:
    return pytree.tree_map_only(torch.Size, tuple, value)


def run_seeded(module: Callable, inputs: Sequence, seed: int = 0):
    """Call ``module(*inputs)`` with the RNG seeded, leaving the caller's RNG untouched.

    When the call raises, the exception is the report: torch.fx's own print of the failing
    generated code (to stderr, before it re-raises) is dropped. Output of a call that
    succeeds is passed on.
    """
    captured = io.StringIO()
    with torch.random.fork_rng(devices=_rng_devices(inputs)):
        torch.manual_seed(seed)
        with contextlib.redirect_stderr(captured):
            result = module(*inputs)
    if captured.getvalue():
        sys.stderr.write(captured.getvalue())
    return result


def _rng_devices(inputs: Sequence) -> list:
    devices = {x.device for x in inputs if isinstance(x, torch.Tensor)}
    return [d.index or 0 for d in devices if d.type == "cuda"]


def check_outputs(
    reference: nn.Module,
    candidate: nn.Module,
    example_inputs: Sequence,
    *,
    random_sets: int = 2,
    extra_sets: Sequence[Sequence] = (),
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    _expected_cache: dict | None = None,
    _copy_candidate: bool = True,
) -> CheckResult:
    """Outputs agree on the example inputs, ``random_sets`` random inputs of the same shapes
    and every input tuple in ``extra_sets`` (e.g. other sizes of dynamic dims). Both models
    run each set under the same seed (random ops draw alike), derived from ``seed``.

    ``_expected_cache`` (fxopt's own callers: a dict kept for one reference) holds the
    reference's outputs by input content and seed, so checking several candidates, or one
    candidate in several steps, runs the reference once per input set. A reference that
    changes its own buffers or parameters when it runs is not cached.

    A float32/16 output that misses the fixed tolerance is judged again against a float64
    run of the reference: it passes when it is no further from that run than twice the
    reference's own float32 error (deep networks round differently after any rewrite).

    Both models run :func:`~fxopt.ir.copying.isolated` (each in one session for the whole
    check: a model that updates its own state, a counter buffer, runs on call after call
    as it would for its user), so the module checked is the one handed back, unchanged;
    ``_copy_candidate=False`` runs the candidate as it is (a caller's throwaway).
    """
    _check_tolerances(rtol, atol)
    # A KV cache among the inputs is keyed and copied as a container of tensors (as
    # optimize registers it): a call of this function on its own did neither.
    caches.register(reference, example_inputs)
    input_sets = [
        tuple(example_inputs),
        *random_inputs_like(example_inputs, random_sets, seed),
        *(tuple(x) for x in extra_sets),
    ]
    # Each set runs under its own seed (a model that reseeds itself inside forward differs
    # from its fx capture only under a seed other than its own): the example under
    # ``seed``, random set i under seed + 1 + i, extra set j under seed + 1000 + j, so
    # a set's seed does not depend on how many random sets precede it (_expected_cache).
    run_seeds = [
        seed,
        *(seed + 1 + i for i in range(random_sets)),
        *(seed + _EXTRA_SEEDS + j for j in range(len(extra_sets))),
    ]
    sessions = contextlib.ExitStack()
    if _copy_candidate:
        candidate = sessions.enter_context(isolated(candidate))
    entered: list[nn.Module] = []  # the reference's session starts when it first runs

    def reference_copy() -> nn.Module:
        if not entered:
            entered.append(sessions.enter_context(isolated(reference)))
        return entered[0]

    def expected_for(inputs: tuple, run_seed: int):
        key = _fingerprint(inputs, run_seed) if _expected_cache is not None else None
        if key is not None and key in _expected_cache:
            return _expected_cache[key]
        module = reference_copy()
        versions = state_versions(module)
        expected = run_seeded(module, _fresh(inputs), run_seed)
        if key is not None and state_versions(module) == versions:
            _expected_cache[key] = expected
        return expected

    worst = 0.0
    judged_in_float64 = 0
    example_output, example_s = None, 0.0
    with sessions, torch.no_grad():
        for index, (inputs, run_seed) in enumerate(zip(input_sets, run_seeds)):
            expected = expected_for(inputs, run_seed)
            began = time.perf_counter()
            actual = run_seeded(candidate, _fresh(inputs), run_seed)
            if index == 0:
                example_output = actual
                example_s = time.perf_counter() - began
            result = compare(expected, actual, rtol, atol)
            default_tolerance = rtol is None and atol is None
            if (
                not result.ok
                and default_tolerance
                and within_float32_error(reference_copy(), inputs, expected, actual, run_seed)
            ):
                judged_in_float64 += 1
                result = Comparison(True, result.max_abs_error)
            worst = max(worst, result.max_abs_error)
            if not result.ok:
                return CheckResult(False, worst, index, result.message)
    details = {
        "input_sets": len(input_sets),
        "judged_in_float64": judged_in_float64,
        # The candidate's first call on the example, wall seconds (one-time costs included).
        "example_s": round(example_s, 6),
    }
    return CheckResult(True, worst, details=details, example_output=example_output)


_EXTRA_SEEDS = 1000


_PLAIN_VALUES = (bool, int, float, complex, str, torch.dtype, torch.device, torch.memory_format)


def _fingerprint(inputs: Sequence, seed: int) -> tuple | None:
    """A key for an input tuple's content (its structure; each tensor's shape, dtype,
    strides, device and a digest of its bytes; plain values), or None when some input
    cannot be keyed (its output is then not cached). Containers and pytree nodes are keyed
    by what they hold: two transformers caches of other lengths print the same."""
    leaves, spec = pytree.tree_flatten(list(inputs))
    parts: list = [seed, repr(spec)]
    for x in leaves:
        if not isinstance(x, torch.Tensor):
            if x is not None and not isinstance(x, _PLAIN_VALUES):
                return None  # an object whose repr may not tell its content
            parts.append(("value", repr(x)))
            continue
        if x.layout != torch.strided or x.is_nested:
            return None
        try:
            raw = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):
            return None
        digest = hashlib.blake2b(raw, digest_size=16).hexdigest()
        parts.append((tuple(x.shape), str(x.dtype), x.stride(), str(x.device), digest))
    return tuple(parts)


def remember_expected(cache: dict, inputs: Sequence, output: object, seed: int = 0) -> None:
    """Put the reference's ``output`` on the example ``inputs`` into ``cache`` (the
    ``_expected_cache`` of :func:`check_outputs` with this ``seed``), as a run made by
    :func:`run_seeded` with ``seed`` on a fresh copy of the reference."""
    key = _fingerprint(inputs, seed)
    if key is not None:
        cache[key] = pytree.tree_map(
            lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output
        )


def state_versions(module: nn.Module) -> tuple[int, ...]:
    """The version counters of a module's parameters and buffers (bumped by every in-place
    write), to tell whether running it changed its state."""
    return tuple(t._version for t in [*module.parameters(), *module.buffers()])


def _check_tolerances(rtol: float | None, atol: float | None) -> None:
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserInputError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise UserInputError(f"{name} must be a finite number >= 0, got {value!r}")


def within_float32_error(
    reference: nn.Module, inputs: Sequence, expected: object, actual: object, seed: int
) -> bool:
    """True when ``actual`` is as close to a float64 run of ``reference`` as ``expected``
    (the reference's own low-precision output) is, within a factor of 2.

    The float64 run reads the reference's own weights, each raised to float64 by the op
    that reads it (:class:`InFloat64`): a float64 copy of the model would cost twice its
    weights."""
    exp_leaves = pytree.tree_leaves(expected)
    act_leaves = pytree.tree_leaves(actual)
    low = _LOW_PRECISION
    if not any(isinstance(e, torch.Tensor) and e.dtype in low for e in exp_leaves):
        return False
    try:
        # Through containers and pytree nodes (a transformers cache: the model appends to
        # the object it is given, which must not be the caller's).
        inputs64 = pytree.tree_map(
            lambda x: (
                x.detach().to(torch.float64)
                if isinstance(x, torch.Tensor) and x.dtype in low
                else x
            ),
            list(inputs),
        )
        with isolated(reference) as precise, InFloat64():
            truth = pytree.tree_leaves(run_seeded(precise, inputs64, seed))
    except Exception:
        return False  # no float64 run (dtype-specific code): the fixed tolerance stands
    if len(truth) != len(exp_leaves) or len(act_leaves) != len(exp_leaves):
        return False
    for e, a, t in zip(exp_leaves, act_leaves, truth):
        if not isinstance(e, torch.Tensor):
            continue
        # Only values are judged again: a float32 output where the model gives bfloat16
        # (a kernel autocast does not reach) is closer to float64 and still wrong.
        if not isinstance(a, torch.Tensor) or (a.dtype, a.shape) != (e.dtype, e.shape):
            return False
        if e.dtype not in low:
            if not compare(e, a).ok:
                return False
            continue
        t64 = t.detach().to(torch.float64)
        own = (e.detach().to(torch.float64) - t64).abs().nan_to_num(nan=math.inf)
        ours = (a.detach().to(torch.float64) - t64).abs().nan_to_num(nan=math.inf)
        if not (torch.isnan(a) == torch.isnan(e)).all():
            return False
        _, atol = tolerance(e.dtype)
        if float(ours.max()) > 2 * float(own.max()) + atol:
            return False
    return True


_LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


class InFloat64(TorchDispatchMode):
    """Run every op in float64: floating operands of lower precision are raised as each op
    reads them, and a float32/16 ``dtype`` argument becomes float64. An op that writes a
    raised operand writes the result back into the original (rounded to its dtype).

        >>> import torch
        >>> with InFloat64():
        ...     y = torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2))
        >>> y.dtype
        torch.float64
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raised: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        args, kwargs = pytree.tree_map(
            functools.partial(_raise_precision, raised), (args, kwargs or {})
        )
        out = func(*args, **kwargs)
        if func._schema.is_mutable and raised:
            for original, wide in raised.values():
                if wide._version:  # written by the op
                    original.copy_(wide)
        return out


def _raise_precision(raised: dict, value: object) -> object:
    if isinstance(value, torch.dtype) and value in _LOW_PRECISION:
        return torch.float64
    if (
        isinstance(value, torch.Tensor)
        and value.dtype in _LOW_PRECISION
        and value.layout == torch.strided
    ):
        wide = value.to(torch.float64)
        raised[id(wide)] = (value, wide)
        return wide
    return value


def fresh(inputs: Sequence) -> tuple:
    """A copy of each tensor input: an in-place op on an input must not leak across runs."""
    return _fresh(inputs)


def _fresh(inputs: Sequence) -> tuple:
    # Each model gets its own copy: an in-place op on an input must not leak across runs,
    # nor may a call grow a KV cache another run reads (fxopt.caches).
    return tuple(caches.copy(x) for x in inputs)


def check_gradients(
    reference: nn.Module,
    candidate: nn.Module,
    example_inputs: Sequence,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
    parameters: bool = True,
) -> CheckResult:
    """Gradients of a fixed random projection of the outputs agree, for float inputs and
    for parameters present under the same name in both models."""
    _check_tolerances(rtol, atol)
    grads = []
    for module in (reference, candidate):
        # Gradients by torch.autograd.grad, never into ``.grad``: the reference's
        # parameters are the user's own.
        with isolated(module) as running:
            inputs = [
                x.detach().clone().requires_grad_(True)
                if isinstance(x, torch.Tensor) and x.is_floating_point()
                else x
                for x in example_inputs
            ]
            # The model gets a copy of each leaf: a forward that writes its input in place
            # (a.add_(1)) may, as eager training with such inputs may; the leaf gets the grad.
            given = [
                x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in inputs
            ]
            output = run_seeded(running, given, seed)
            leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            leaves = [t for t in leaves if t.requires_grad and t.is_floating_point()]
            if not leaves:
                return CheckResult(True, 0.0, message="no output requires grad")
            generator = torch.Generator().manual_seed(seed)
            loss = sum((t * torch.randn(t.shape, generator=generator).to(t)).sum() for t in leaves)
            wrt = {
                f"input[{i}]": x
                for i, x in enumerate(inputs)
                if isinstance(x, torch.Tensor) and x.requires_grad
            }
            if parameters:
                wrt.update(
                    {f"param {n}": p for n, p in running.named_parameters() if p.requires_grad}
                )
            try:
                values = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
            except RuntimeError as error:
                which = "original" if not grads else "optimized"
                return CheckResult(
                    False, math.inf, 0, f"backward of the {which} model failed: {error}"
                )
        grads.append(dict(zip(wrt, values)))
    expected, actual = grads
    worst = 0.0
    compared = 0
    for name in expected:
        if name not in actual or expected[name] is None or actual[name] is None:
            continue
        result = compare(expected[name], actual[name], rtol, atol)
        compared += 1
        worst = max(worst, result.max_abs_error)
        if not result.ok:
            return CheckResult(False, worst, 0, f"gradient of {name}: {result.message}")
    return CheckResult(True, worst, details={"compared": compared})


def check_repeatable(
    candidate: nn.Module,
    example_inputs: Sequence,
    runs: int = 3,
    seed: int = 0,
    *,
    first: object = None,
) -> CheckResult:
    """Under one seed, repeated runs give identical outputs (NaN in the same places counts
    as identical: whether a NaN is right is for the comparison with the original to say).

    Each run starts from the module's state (:func:`~fxopt.ir.copying.isolated`), so a model
    that legitimately updates its own state (a counter buffer, BatchNorm statistics) is not
    mistaken for a nondeterministic one.
    ``first``, when given, is the output of such a run already made (the example output
    of :func:`check_outputs` with the same ``seed``) and counts as one of the ``runs``.
    """
    with torch.no_grad():
        if first is None:
            with isolated(candidate) as running:
                first = run_seeded(running, _fresh(example_inputs), seed)
        for _ in range(runs - 1):
            with isolated(candidate) as running:
                again = run_seeded(running, _fresh(example_inputs), seed)
            result = compare(first, again, 0.0, 0.0)
            if not result.ok:
                return CheckResult(
                    False, result.max_abs_error, 0, f"not repeatable: {result.message}"
                )
    return CheckResult(True)


def check_lint(gm: fx.GraphModule) -> CheckResult:
    try:
        gm.graph.lint()
    except Exception as error:
        return CheckResult(False, message=str(error).splitlines()[0])
    return CheckResult(True)


def check_parameters(before: nn.Module, after: nn.Module, allow_new: bool = False) -> CheckResult:
    """No parameter appears that was not there before (unless the pass declares it)."""
    old = {n for n, _ in before.named_parameters()}
    new = sorted(n for n, _ in after.named_parameters() if n not in old)
    if new and not allow_new:
        return CheckResult(False, message=f"new parameters appeared: {', '.join(new[:5])}")
    return CheckResult(True, details={"new": new})
