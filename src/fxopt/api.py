"""The optimize job: capture → passes → verify → measure.

>>> import torch
>>> import fxopt
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
>>> result = fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=0)
>>> result.report["verified"]
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxopt import bench, verify
from fxopt.capture import Mode, as_input_tuple, trace
from fxopt.errors import FxoptError, UserInputError, VerificationError
from fxopt.ir.copying import clone_module
from fxopt.passes import PassManager, PipelineResult, resolve
from fxopt.passes import pipelines as presets
from fxopt.passes.registry import PassLike


@dataclass
class OptimizeResult:
    """The optimized GraphModule and the report (the same dict ``fxopt optimize --json``
    prints)."""

    module: fx.GraphModule
    report: dict
    pipeline: PipelineResult


class GraphOptimizer:
    """The seed API: capture ``model`` once, then optimize, verify and benchmark it.

    The user's model is never changed: capture works on a deep copy, and verification runs
    on further copies, so neither the model nor the returned module has its parameters or
    buffers (BatchNorm running statistics) touched.

    >>> import torch
    >>> from fxopt import GraphOptimizer
    >>> x = torch.randn(2, 8)
    >>> opt = GraphOptimizer(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x)
    >>> gm = opt.optimize(passes=["cse", "dce"])
    >>> opt.verify_correctness(x)
    True
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: object,
        device: str | torch.device = "cpu",
        mode: Mode = "fx",
    ):
        if not isinstance(model, nn.Module):
            raise UserInputError(f"expected an nn.Module, got {type(model).__name__}")
        self.device = torch.device(device)
        self.mode = mode
        self.model = model
        self.example_inputs = tuple(_to(x, self.device) for x in as_input_tuple(example_inputs))
        # The reference the optimized module is compared with: a copy on the target device.
        self.reference = clone_module(model).to(self.device)
        self.original: fx.GraphModule = trace(self.reference, self.example_inputs, mode)
        self.optimized: fx.GraphModule | None = None
        self.pipeline: PipelineResult | None = None
        self.last_check: verify.CheckResult | None = None
        self.layout = None

    def optimize(
        self,
        passes: Sequence[PassLike] = (),
        *,
        max_rounds: int = 1,
        verify_result: bool = True,
        gradients: bool = False,
    ) -> fx.GraphModule:
        """Apply ``passes`` (names or Pass instances) and verify the result.

        Raises VerificationError (max error, input, first diverging pass) when outputs
        differ, PassError when a pass fails; the original stays untouched either way.
        """
        pass_list = [resolve(p) for p in passes]
        self.pipeline = PassManager(pass_list, max_rounds=max_rounds).run(self.original)
        candidate = self.pipeline.module
        if verify_result:
            self.last_check = self._check(candidate, gradients)
            if not self.last_check.ok:
                raise VerificationError(
                    f"optimized model differs from the original: {self.last_check.message}",
                    max_abs_error=self.last_check.max_abs_error,
                    input_description=self.last_check.describe_input(),
                    first_bad_pass=self._first_bad_pass(gradients),
                )
        self.optimized = candidate
        return candidate

    def _check(self, candidate: nn.Module, gradients: bool) -> verify.CheckResult:
        result = verify.check_outputs(self.reference, candidate, self.example_inputs)
        if result.ok:
            repeat = verify.check_repeatable(candidate, self.example_inputs)
            result = repeat if not repeat.ok else result
        if result.ok and gradients:
            grad = verify.check_gradients(self.reference, candidate, self.example_inputs)
            result = grad if not grad.ok else result
        return result

    def _first_bad_pass(self, gradients: bool) -> str | None:
        """Replay growing prefixes of the applied passes to find where outputs diverge."""
        assert self.pipeline is not None
        applied = [record.pass_ for record in self.pipeline.records]
        for length in range(1, len(applied) + 1):
            try:
                prefix = PassManager(applied[:length]).run(self.original).module
            except FxoptError:
                return applied[length - 1].name
            if not self._check(prefix, gradients).ok:
                return applied[length - 1].name
        return None

    def verify_correctness(
        self, test_inputs: object, rtol: float = 1e-5, atol: float = 1e-8
    ) -> bool:
        """True when the optimized module matches the original on ``test_inputs``."""
        module = self._require_optimized()
        inputs = tuple(_to(x, self.device) for x in as_input_tuple(test_inputs))
        result = verify.check_outputs(
            self.reference, module, inputs, random_sets=0, rtol=rtol, atol=atol
        )
        self.last_check = result
        return result.ok

    def benchmark(self, test_inputs: object, num_runs: int = 100) -> dict:
        """Latency (interleaved), peak memory and graph statistics, original vs optimized."""
        # Copies: running a training-mode model updates its state (BatchNorm statistics).
        reference, module = clone_module(self.reference), clone_module(self._require_optimized())
        inputs = tuple(_to(x, self.device) for x in as_input_tuple(test_inputs))
        latency = bench.measure_latency(
            {"original": reference, "optimized": module}, inputs, runs=num_runs
        )
        original_ms = latency["original"]["median_ms"]
        optimized_ms = latency["optimized"]["median_ms"]
        return {
            "latency_ms": {"original": original_ms, "optimized": optimized_ms},
            "latency": latency,
            "speedup": original_ms / optimized_ms if optimized_ms > 0 else None,
            "memory": {
                "original": bench.peak_memory(reference, inputs),
                "optimized": bench.peak_memory(module, inputs),
            },
            "graph": {
                "original": bench.graph_stats(self.original),
                "optimized": bench.graph_stats(self._require_optimized()),
            },
        }

    def optimize_for_speed(self, autotune: bool = True) -> nn.Module:
        """The ``speed`` preset to a fixed point, then the fastest verified layout."""
        self.optimize(presets.get("speed"), max_rounds=4)
        if autotune:
            self.choose_layout()
        return self._require_optimized()

    def choose_layout(self, budget_s: float = 3.0):
        """Replace the optimized module by its fastest verified layout (fxopt.layout)."""
        from fxopt import layout

        choice = layout.autotune(
            self._require_optimized(), self.reference, self.example_inputs, budget_s=budget_s
        )
        self.optimized = choice.module
        self.layout = choice
        return choice

    def optimize_for_memory(
        self,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        memory_budget: float | int = 0.5,
        planner: str = "greedy",
        optimizer: torch.optim.Optimizer | None = None,
    ):
        """A training step of the model that recomputes activations to fit ``memory_budget``.

        Delegates to :func:`fxopt.remat.compile_step`: ``loss_fn(model, *inputs)`` returns
        the scalar loss (default: the sum of the model's floating-point outputs, which has
        the backward graph of any loss on them); ``memory_budget`` is a fraction of the
        baseline's peak activation memory or an int number of bytes. The returned step
        trains the model itself: ``step(*inputs)`` leaves gradients in ``param.grad``.
        """
        from fxopt import remat

        return remat.compile_step(
            self.model,
            loss_fn or _sum_of_outputs,
            self.example_inputs,
            memory_budget=memory_budget,
            planner=planner,
            optimizer=optimizer,
        )

    def _require_optimized(self) -> fx.GraphModule:
        if self.optimized is None:
            raise FxoptError("call optimize() before verify_correctness() or benchmark()")
        return self.optimized


def _sum_of_outputs(model: nn.Module, *inputs: object) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_leaves(model(*inputs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise UserInputError("the model returns no floating-point tensor to differentiate")
    return sum(t.sum() for t in tensors)


def _to(x: object, device: torch.device) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def optimize(
    model: nn.Module,
    example_inputs: object,
    *,
    preset: str = "speed",
    passes: Sequence[PassLike] | None = None,
    mode: Mode = "fx",
    verify: bool = True,
    max_rounds: int = 4,
    benchmark_runs: int = 20,
    device: str | torch.device = "cpu",
    name: str | None = None,
    autotune: bool | None = None,
) -> OptimizeResult:
    """Optimize ``model`` with a preset (or explicit ``passes``) and report what changed.

    ``benchmark_runs=0`` skips timing (``latency_ms`` values are then None). ``autotune``
    (default: on for the ``speed`` preset) measures the layout candidates of
    :mod:`fxopt.layout` and keeps the fastest verified one (``report["layout"]``).
    """
    optimizer = GraphOptimizer(model, example_inputs, device=device, mode=mode)
    chosen = list(passes) if passes is not None else list(presets.get(preset))
    module = optimizer.optimize(chosen, max_rounds=max_rounds, verify_result=verify)
    assert optimizer.pipeline is not None
    if autotune is None:
        autotune = passes is None and preset == "speed"
    choice = None
    if autotune:
        choice = optimizer.choose_layout()
        module = optimizer.optimized
    report = build_report(optimizer, name or type(model).__name__, benchmark_runs, verify)
    report["layout"] = choice.to_dict() if choice is not None else None
    return OptimizeResult(module, report, optimizer.pipeline)


def build_report(optimizer: GraphOptimizer, name: str, benchmark_runs: int, verified: bool) -> dict:
    """The CLI's JSON object for one optimized model (keys in docs/architecture.md)."""
    pipeline = optimizer.pipeline
    assert pipeline is not None and optimizer.optimized is not None
    before = bench.graph_stats(optimizer.original)
    # What the passes did; the layout step's rewrite (conversions, packed-weight reads) is
    # reported on its own, under "layout".
    after = bench.graph_stats(pipeline.module)
    latency = {"original": None, "optimized": None}
    speedup = None
    if benchmark_runs > 0:
        timings = bench.measure_latency(
            {
                "original": clone_module(optimizer.reference),
                "optimized": clone_module(optimizer.optimized),
            },
            optimizer.example_inputs,
            runs=benchmark_runs,
            warmup=min(5, benchmark_runs),
        )
        latency = {k: round(v["median_ms"], 4) for k, v in timings.items()}
        speedup = (
            round(latency["original"] / latency["optimized"], 3) if latency["optimized"] else None
        )
    check = optimizer.last_check
    return {
        "model": name,
        "mode": optimizer.mode,
        "passes": [record.to_dict() for record in pipeline.records],
        "nodes_before": before["nodes"],
        "nodes_after": after["nodes"],
        "ops_before": before["ops"],
        "ops_after": after["ops"],
        "verified": bool(verified and check is not None and check.ok),
        "max_abs_error": check.max_abs_error if check is not None else None,
        "latency_ms": latency,
        "speedup": speedup,
    }
