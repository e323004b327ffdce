"""IEEE-strict comparison for tests: NaN, ±inf and the sign of zero in the same places."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def ieee_mismatch(actual: object, expected: object, rtol: float = 1e-4) -> str | None:
    """Why ``actual`` is not ``expected`` as IEEE sees it, or None: same structure, dtype
    and shape; NaN, +inf and -inf in the same places; where both are zero, the same sign;
    the finite rest equal up to ``rtol`` of the tensor's scale (rounding may differ)."""
    got, got_spec = pytree.tree_flatten(actual)
    want, want_spec = pytree.tree_flatten(expected)
    if got_spec != want_spec:
        return f"structure {got_spec} != {want_spec}"
    for index, (a, e) in enumerate(zip(got, want)):
        if not isinstance(e, torch.Tensor):
            if a != e:
                return f"output {index}: {a!r} != {e!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.dtype != e.dtype or a.shape != e.shape:
            return f"output {index}: {getattr(a, 'dtype', type(a))} != {e.dtype}"
        a, e = a.detach().double(), e.detach().double()
        for name, test in (
            ("NaN", torch.isnan),
            ("+inf", torch.isposinf),
            ("-inf", torch.isneginf),
        ):
            if not torch.equal(test(a), test(e)):
                return f"output {index}: {name} in other places"
        zeros = (a == 0) & (e == 0)
        if not torch.equal(torch.signbit(a[zeros]), torch.signbit(e[zeros])):
            return f"output {index}: a zero has the other sign"
        finite = torch.isfinite(e)
        if finite.any():
            scale = float(e[finite].abs().max()) or 1.0
            worst = float((a[finite] - e[finite]).abs().max())
            if worst > rtol * scale + 1e-6:
                return f"output {index}: differs by {worst:.3g} (scale {scale:.3g})"
    return None


def assert_same_ieee(actual: object, expected: object, rtol: float = 1e-4) -> None:
    problem = ieee_mismatch(actual, expected, rtol)
    assert problem is None, problem
