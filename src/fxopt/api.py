"""The optimize job: capture → passes → guard → verify → measure.

>>> import torch
>>> import fxopt
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
>>> result = fxopt.optimize(model, torch.randn(2, 4), benchmark_runs=0)
>>> result.report["verified"], result.report["dynamic"]
(True, ['input.shape[0]'])
>>> result.module(torch.randn(5, 4)).shape   # dim 0 is dynamic by default
torch.Size([5, 4])

"Verified" means: the optimized module computed what the model computes on the example,
on random inputs of the example's shapes and on inputs with another value of every
dynamic dim (and the gradients, for a model in training mode). Every call is checked
against the module's input contract (:mod:`fxopt.ir.contract`): an input it was not
optimized for raises :class:`~fxopt.errors.InputMismatchError` instead of computing.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxopt import bench, caches, memory, verify
from fxopt.capture import (
    EXPORT_GUARDS_KEY,
    Mode,
    as_input_tuple,
    capture_hint,
    capture_info,
    check_inputs,
    trace,
)
from fxopt.errors import FxoptError, UserInputError, VerificationError
from fxopt.ir import contract as contracts
from fxopt.ir import copying, facts, ops, shapes
from fxopt.ir.alias import writes_an_input
from fxopt.ir.copying import graph_copy, isolated, shared_copy
from fxopt.ir.weights import WeightWatch
from fxopt.layout import INFERENCE_ONLY_KEY
from fxopt.passes import Pass, PassManager, PipelineResult, resolve
from fxopt.passes import pipelines as presets
from fxopt.passes.registry import PassLike
from fxopt.phases import Phases


@dataclass
class OptimizeResult:
    """The optimized GraphModule, its input contract and the report (the same dict
    ``fxopt optimize --json`` prints)."""

    module: fx.GraphModule
    report: dict
    pipeline: PipelineResult
    contract: contracts.InputContract | None = None


class GraphOptimizer:
    """The seed API: capture ``model`` once, then optimize, verify and benchmark it.

    The user's model is never changed, and its weights are never copied: capture traces a
    :func:`~fxopt.ir.copying.shared_copy` (the model's own weight storage under new module
    objects), and verification runs the model and the candidates
    :func:`~fxopt.ir.copying.isolated` (buffers they write are scratch copies; attributes
    and training flags are put back), so neither the model nor the returned module has its
    parameters or buffers (BatchNorm running statistics) touched. The returned module
    reads the model's weights where no pass changed them, as ``torch.compile``'s does.
    ``mode="auto"`` captures with fx when that is faithful, else with torch.export;
    ``dynamic="batch"`` (the default) lets dim 0 of every input vary, ``dynamic_shapes``
    takes torch.export's spec, ``dynamic=None`` fixes every dim to the example's.

    >>> import torch
    >>> from fxopt import GraphOptimizer
    >>> x = torch.randn(2, 8)
    >>> opt = GraphOptimizer(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), x)
    >>> gm = opt.optimize(passes=["cse", "dce"])
    >>> opt.verify_correctness(torch.randn(7, 8))
    True
    """

    def __init__(
        self,
        model: nn.Module,
        example_inputs: object,
        device: str | torch.device = "cpu",
        mode: Mode = "auto",
        *,
        dynamic: str | None = "batch",
        dynamic_shapes: object = None,
        phases: Phases | None = None,
        fast_math: bool = False,
    ):
        #: Allow rewrites exact for finite inputs only (Pass.inexact_rewrites; the fused
        #: kernels of fxopt.passes.cpu_kernels.INEXACT): passes named by string and presets
        #: are built with it, and the layout step's fused candidates use it.
        self.fast_math = bool(fast_math)
        #: Wall time of each step: capture, passes, verify, layout, benchmark.
        self.phases = phases if phases is not None else Phases()
        if not isinstance(model, nn.Module):
            raise UserInputError(f"expected an nn.Module, got {type(model).__name__}")
        self.device = _device(device)
        self.model = model
        given = as_input_tuple(example_inputs)
        check_inputs(model, given)  # a meta tensor is refused here, before it is moved
        caches.register(model, given)  # a KV cache is then a container of tensors
        caches.check_example(given)
        moved = tuple(_to(x, self.device) for x in given)
        #: The example, an input in an unusual layout (a strided view) made contiguous: the
        #: graph is captured for, and its contract pins, a layout callers can produce.
        self.example_inputs, restrided = _in_standard_layouts(moved, _parameter_names(model))
        #: A model in training mode keeps its parameters trainable: no pass that freezes
        #: them, no layout step, and verification compares gradients too.
        self.training = any(m.training for m in model.modules())
        #: The reference's outputs by input content, shared by every check of this model
        #: (the capture's run on the example is the first).
        self.expected_outputs: dict = {}
        with self.phases("capture"):
            #: The reference the optimized module is compared with: the model itself (a
            #: copy when it had to move to the device), always run isolated.
            self.reference = self._capture(model, mode, dynamic, dynamic_shapes)
        self.capture = capture_info(self.original)
        if restrided:
            self.capture["notes"] = [
                *self.capture.get("notes", ()),
                f"example input {', '.join(restrided)} is a strided view (in no standard "
                "memory format): optimized for a contiguous copy of it",
            ]
        self.requested_mode = mode
        self.mode = self.capture.get("mode", mode)
        self.optimized: fx.GraphModule | None = None
        self.pipeline: PipelineResult | None = None
        self.contract: contracts.InputContract | None = None
        self._layout_pinned: bool | frozenset[str] = False  # (set with the contract)
        self.last_check: verify.CheckResult | None = None
        self.checked: list[str] = []
        self.skipped_passes: list[dict] = []
        self.layout = None

    def _capture(self, model: nn.Module, mode: Mode, dynamic, dynamic_shapes) -> nn.Module:
        """Set ``self.original`` (the captured graph); return the reference: the model
        itself, or its copy on the device when it is elsewhere."""
        on_device = all(t.device == self.device for t in [*model.parameters(), *model.buffers()])
        traced = model if on_device else shared_copy(model).to(self.device)
        self.original: fx.GraphModule = trace(
            traced,
            self.example_inputs,
            mode,
            dynamic=None if dynamic_shapes is not None else dynamic,
            dynamic_shapes=dynamic_shapes,
            _expected_cache=self.expected_outputs,
        )
        return traced

    def optimize(
        self,
        passes: Sequence[PassLike] = (),
        *,
        max_rounds: int = 1,
        verify_result: bool = True,
        gradients: bool = False,
        skip_freezing: bool = False,
        dump_after: Sequence[str] = (),
    ) -> fx.GraphModule:
        """Apply ``passes`` (names or Pass instances), guard and verify the result.

        Raises VerificationError (max error, input, first diverging pass, or the capture
        itself) when outputs differ, PassError when a pass fails; the original stays
        untouched either way. A pass that treats parameters as constants on a model in
        training mode is an error, or skipped (and reported) with ``skip_freezing=True``.
        ``dump_after`` names passes whose output graph ``pipeline.dumps`` keeps as text.
        """
        pass_list = self._usable(passes, skip_freezing)
        manager = PassManager(pass_list, max_rounds=max_rounds, dump_after=dump_after)
        unknown = [name for name in dump_after if name not in manager.pass_names()]
        if unknown:
            raise UserInputError(
                f"cannot dump the graph after '{unknown[0]}': not a pass of this pipeline; "
                f"its passes: {', '.join(manager.pass_names()) or '(none)'}"
            )
        with self.phases("passes"):
            self.pipeline = manager.run(self.original)
            # Its weights are the model's where no pass changed them; what its calls
            # write (training BatchNorm statistics) must not be.
            copying.own_written_buffers(self.pipeline.module)
            candidate = self._guard(self.pipeline.module)
        if verify_result:
            gradients = gradients or self.training
            with self.phases("verify"):
                self.last_check = self._check(candidate, gradients)
            if not self.last_check.ok:
                culprit = self._first_bad_stage(gradients)
                if culprit == _CAPTURE:
                    raise VerificationError(
                        f"the captured graph already differs from the model, before any pass "
                        f"ran: {self.last_check.message}. {capture_hint(self.mode)}",
                        max_abs_error=self.last_check.max_abs_error,
                        input_description=self.last_check.describe_input(),
                    )
                raise VerificationError(
                    f"optimized model differs from the original: {self.last_check.message}",
                    max_abs_error=self.last_check.max_abs_error,
                    input_description=self.last_check.describe_input(),
                    first_bad_pass=culprit,
                )
        self.optimized = candidate
        return candidate

    def _usable(self, passes: Sequence[PassLike], skip_freezing: bool) -> list[Pass]:
        if isinstance(passes, (str, Pass)):
            raise UserInputError(
                f"passes must be a list of pass names or Pass instances, got {passes!r}; "
                f"did you mean [{passes!r}]?"
            )
        resolved = [resolve(p, fast_math=self.fast_math) for p in passes]
        if not self.training:
            return resolved
        kept = []
        self.skipped_passes = []
        for pass_ in resolved:
            if pass_.freezes_parameters and not skip_freezing:
                raise UserInputError(
                    f"pass '{pass_.name}' treats parameters as constants (inference only), but "
                    "the model is in training mode; call model.eval() first"
                )
            if pass_.freezes_parameters:
                self.skipped_passes.append(
                    {
                        "name": pass_.name,
                        "reason": "the model is in training mode and this pass treats "
                        "parameters as constants; call model.eval() to optimize for inference",
                    }
                )
            else:
                kept.append(pass_)
        return kept

    def _guard(self, gm: fx.GraphModule) -> fx.GraphModule:
        """Install the input guard for ``gm``'s contract, and the watch on the model tensors
        its derived weights came from, on ``gm`` (in place)."""
        values = shapes.placeholder_values(gm, self.example_inputs)
        notes = list(self.capture.get("notes", ()))
        self._layout_pinned = facts.pinned_inputs(gm)
        self.contract = contracts.build(gm, values, layout_pinned=self._layout_pinned, notes=notes)
        self.contract.state = self._state(gm)
        return self._install(gm)

    def _state(self, gm: fx.GraphModule) -> contracts.ModuleState:
        """The module state ``gm`` is verified in: the model's training flag, autocast now
        (verification runs in the caller's autocast state), whether ``gm`` writes an input."""
        devices = {"cpu", self.device.type}
        for value in pytree.tree_leaves(self.example_inputs):
            if isinstance(value, torch.Tensor):
                devices.add(value.device.type)
        return contracts.ModuleState(
            training=self.training,
            autocast=contracts.autocast_state(sorted(devices)),
            writes_inputs=writes_an_input(gm),
        )

    def _install(self, gm: fx.GraphModule, weights: WeightWatch | None = None) -> fx.GraphModule:
        """Put the guard of :attr:`contract` on ``gm``, with ``gm``'s own gradient support
        (a candidate of kernels without autograd has none); that contract becomes
        :attr:`contract`."""
        assert self.contract is not None
        state = self.contract.state
        if state is not None:
            gradients = not gm.meta.get(INFERENCE_ONLY_KEY)
            self.contract = dataclasses.replace(
                self.contract, state=dataclasses.replace(state, gradients=gradients)
            )
        gm = contracts.install(
            gm,
            self.contract,
            self.original.meta.get(EXPORT_GUARDS_KEY),
            weights if weights is not None else WeightWatch.of(self.reference, gm),
        )
        if contracts.pins_a_memory_format(self.contract):
            contracts.guard_of(gm).conformable = contracts.conformable_inputs(gm)
            gm.register_forward_pre_hook(contracts.conform_layouts_hook, with_kwargs=True)
        if caches.among(self.example_inputs):
            # The graph returns the grown cache as a new object; the model grows the one
            # it is given. Callers may rely on either: the hooks give them both.
            caches.install_hooks(gm)
            caches.return_without_copies(gm)
        return gm

    def _other_sizes(self) -> tuple[list[tuple], str | None]:
        """Inputs with another value of every dynamic dim (and what they are)."""
        if self.contract is None:
            return [], None
        values = shapes.placeholder_values(self.original, self.example_inputs)
        sizes = self.contract.other_sizes(values)
        if sizes is None:
            return [], None
        resized = self.contract.resize(values, sizes)
        inputs = _inputs_from_values(self.original, self.example_inputs, resized)
        sources = self.contract.sources
        shown = ", ".join(f"{sources[s]} = {v}" for s, v in sizes.items() if s in sources)
        return [inputs], shown

    def _check(self, candidate: nn.Module, gradients: bool) -> verify.CheckResult:
        extra, shown = self._other_sizes()
        # Random values at other sizes already differ from the example: one random set of
        # the example's shapes beside them (a call of each model fewer, which on a model
        # whose call takes seconds is setup time the user waits for), two without them.
        random_sets = 1 if extra else 2
        self.checked = ["the example inputs", f"{_count(random_sets)} of the example's shapes"]
        if shown:
            self.checked.append(f"random inputs with {shown}")
        try:
            result = verify.check_outputs(
                self.reference,
                candidate,
                self.example_inputs,
                random_sets=random_sets,
                extra_sets=extra,
                _expected_cache=self.expected_outputs,
            )
        except FxoptError:
            raise
        except Exception as error:
            if not extra:
                raise
            # The model itself fails on the other sizes: the contract is too loose. Fix
            # every dim to the example's (stricter, never wrong) and check again.
            state = self.contract.state if self.contract else None
            self.contract = contracts.build_static(
                self.original,
                shapes.placeholder_values(self.original, self.example_inputs),
                layout_pinned=self._layout_pinned,
                notes=[
                    *self.capture.get("notes", ()),
                    f"dynamic dims dropped: the model fails with {shown} ({type(error).__name__})",
                ],
            )
            self.contract.state = state
            self._install(candidate)
            self.checked = ["the example inputs", "2 random inputs of the example's shapes"]
            result = verify.check_outputs(
                self.reference,
                candidate,
                self.example_inputs,
                _expected_cache=self.expected_outputs,
            )
        if result.ok and ops.any_call(candidate, lambda op: op.random or not op.known):
            # A graph of known, non-random ops computes the same on every run; another one
            # runs again from a fresh copy, beside the run check_outputs made.
            repeat = verify.check_repeatable(
                candidate, self.example_inputs, runs=2, first=result.example_output
            )
            result = repeat if not repeat.ok else result
        if result.ok and gradients:
            self.checked.append("gradients of inputs and parameters")
            grad = verify.check_gradients(self.reference, candidate, self.example_inputs)
            result = grad if not grad.ok else result
        return result

    def _first_bad_stage(self, gradients: bool) -> str | None:
        """The capture, or the first applied pass after which outputs diverge."""
        assert self.pipeline is not None
        captured = self._guard(graph_copy(self.original))
        if not self._check(captured, gradients).ok:
            return _CAPTURE
        applied = [record.pass_ for record in self.pipeline.records]
        for length in range(1, len(applied) + 1):
            try:
                prefix = PassManager(applied[:length]).run(self.original).module
            except FxoptError:
                return applied[length - 1].name
            if not self._check(self._guard(prefix), gradients).ok:
                return applied[length - 1].name
        return None

    def verify_correctness(
        self, test_inputs: object, rtol: float = 1e-5, atol: float = 1e-8
    ) -> bool:
        """True when the optimized module matches the original on ``test_inputs``.

        Inputs outside the module's contract raise InputMismatchError (the module refuses
        them); other inputs are compared with the original's outputs.
        """
        module = self._require_optimized()
        inputs = tuple(_to(x, self.device) for x in as_input_tuple(test_inputs))
        guard = contracts.guard_of(module)
        if guard is not None:  # refused inputs are refused here, before anything runs
            guard.contract.check(shapes.placeholder_values(module, inputs))
        result = verify.check_outputs(
            self.reference, module, inputs, random_sets=0, rtol=rtol, atol=atol
        )
        self.last_check = result
        return result.ok

    def benchmark(self, test_inputs: object, num_runs: int = 100) -> dict:
        """Latency (interleaved), peak memory and graph statistics, original vs optimized."""
        if isinstance(num_runs, bool) or not isinstance(num_runs, int) or num_runs < 1:
            raise UserInputError(f"num_runs must be a positive integer, got {num_runs!r}")
        inputs = tuple(_to(x, self.device) for x in as_input_tuple(test_inputs))
        # Isolated: running a training-mode model updates its state (BatchNorm statistics).
        with isolated(self.reference) as reference, isolated(self._require_optimized()) as module:
            latency = bench.measure_latency(
                {"original": reference, "optimized": module}, inputs, runs=num_runs
            )
            memory = {
                "original": bench.peak_memory(reference, inputs),
                "optimized": bench.peak_memory(module, inputs),
            }
        original_ms = latency["original"]["median_ms"]
        optimized_ms = latency["optimized"]["median_ms"]
        return {
            "latency_ms": {"original": original_ms, "optimized": optimized_ms},
            "latency": latency,
            "speedup": original_ms / optimized_ms if optimized_ms > 0 else None,
            "memory": memory,
            "graph": {
                "original": bench.graph_stats(self.original),
                "optimized": bench.graph_stats(self._require_optimized()),
            },
        }

    def optimize_for_speed(self, autotune: bool = True) -> nn.Module:
        """The ``speed`` preset to a fixed point, then the fastest verified layout."""
        self.optimize(presets.get("speed").passes, max_rounds=4, skip_freezing=True)
        if autotune:
            self.choose_layout()
        return self._require_optimized()

    def choose_layout(self, budget_s: float = 1.5, layout_name: str | None = None):
        """Replace the optimized module by its fastest verified layout (fxopt.layout), or
        by the candidate ``layout_name`` (built and verified, not timed; UserInputError
        when it cannot be built or does not verify).

        Skipped for a model in training mode (the candidates pack parameters as
        constants); returns None then, and the report says why.
        """
        from fxopt import layout

        module = self._require_optimized()
        if self.training:
            self.layout = None
            return None
        # The optimized graph without its guard is the plain candidate (every candidate
        # built from it copies what it changes; timing never writes weights); the guard goes
        # back on what is chosen. (A copy of the graph would cost 13 s on 100k nodes.)
        guard = contracts.guard_of(module)
        with self.phases("layout"):
            plain = contracts.remove(module)
            try:
                extra, _ = self._other_sizes()
                choice = layout.autotune(
                    plain,
                    self.reference,
                    self.example_inputs,
                    budget_s=budget_s,
                    extra_inputs=extra,
                    _expected_cache=self.expected_outputs,
                    _call_s=(self.last_check.details.get("example_s") if self.last_check else None),
                    fast_math=self.fast_math,
                    only=layout_name,
                )
            finally:
                self._install(plain, guard.weights if guard is not None else None)
        if choice.name != "plain" and isinstance(choice.module, fx.GraphModule):
            self.optimized = self._install(choice.module)
        choice.module = self.optimized
        self.layout = choice
        # The candidates that lost (a packed one holds a copy of the weights it packed) are
        # garbage now (fx modules and graphs refer to each other: the collector frees
        # them); glibc would keep their pages resident beside the user's model.
        gc.collect()
        memory.release_free_memory()
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
            loss_fn or remat.sum_of_outputs,
            self.example_inputs,
            memory_budget=memory_budget,
            planner=planner,
            optimizer=optimizer,
        )

    def _require_optimized(self) -> fx.GraphModule:
        if self.optimized is None:
            raise FxoptError("call optimize() before verify_correctness() or benchmark()")
        return self.optimized


_CAPTURE = "(capture)"


def _count(random_sets: int) -> str:
    return "1 random input" if random_sets == 1 else f"{random_sets} random inputs"


def _inputs_from_values(gm: fx.GraphModule, example: tuple, values: tuple) -> tuple:
    """Model-level inputs for placeholder ``values`` (export graphs flatten their inputs)."""
    if getattr(gm, "_in_spec", None) is not None:
        _, spec = pytree.tree_flatten((tuple(example), {}))
        args, _ = pytree.tree_unflatten(list(values), spec)
        return tuple(args)
    return tuple(values[: len(example)])


def _to(x: object, device: torch.device) -> object:
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _in_standard_layouts(inputs: tuple, names: Sequence[str]) -> tuple[tuple, list[str]]:
    """``inputs`` with every tensor that is in no standard memory format (a slice such as
    ``mask.cumsum(-1)[:, -4:]``, an expanded mask) made contiguous, and which those were
    (``positions``, ``past[0][1]``; ``names``: the forward's parameter names). Captured as
    given, the graph would be right for that exact stride pattern only, and its contract
    would refuse a contiguous copy of the very example."""
    changed: list[str] = []

    def standard(path, value):
        if (
            isinstance(value, torch.Tensor)
            and value.layout == torch.strided
            and value.dim() >= 2
            and contracts.memory_format(value) is None
        ):
            index = path[0].idx
            name = names[index] if index < len(names) else f"inputs[{index}]"
            changed.append(name + pytree.keystr(path[1:]))
            return value.contiguous()
        return value

    return pytree.tree_map_with_path(standard, inputs), changed


def _parameter_names(model: nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a builtin or C forward: no signature
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in positional]


def _device(device: str | torch.device) -> torch.device:
    """``device`` as a torch.device that exists on this machine."""
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise UserInputError(f"unknown device {device!r}: {error}") from None
    try:
        torch.empty(0, device=resolved)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise UserInputError(
            f"device '{resolved}' is not available on this machine ({first}); use 'cpu' or a "
            "device torch can see"
        ) from None
    return resolved


def optimize(
    model: nn.Module,
    example_inputs: object,
    *,
    preset: str | None = None,
    passes: Sequence[PassLike] | None = None,
    mode: Mode = "auto",
    dynamic: str | None = "batch",
    dynamic_shapes: object = None,
    verify: bool = True,
    max_rounds: int = 4,
    benchmark_runs: int = 20,
    benchmark_budget_s: float | None = 10.0,
    device: str | torch.device = "cpu",
    name: str | None = None,
    autotune: bool | None = None,
    dump_after: Sequence[str] = (),
    progress: Callable[[str], object] | None = None,
    memory_check: bool = True,
    fast_math: bool = False,
    layout: str | None = None,
) -> OptimizeResult:
    """Optimize ``model`` with a preset (default ``speed``) or explicit ``passes``, guard the
    result with its input contract, verify it and report what changed.

    ``dynamic="batch"`` (default) lets dim 0 of every input vary; ``dynamic="all"`` every
    dim the model lets vary (a decode step's cache length; a dim of size 1 beyond the batch
    stays); ``dynamic=None`` fixes every dim; ``dynamic_shapes`` takes torch.export's spec.
    A transformers KV cache (``DynamicCache``) may be an input: the optimized module grows
    the object it is given, as the model does (:mod:`fxopt.caches`). ``benchmark_runs=0`` skips
    timing (``latency_ms`` values are then None); timing stops sooner once
    ``benchmark_budget_s`` seconds have passed and 5 calls of each model were timed
    (``report["latency_runs"]``; None: exactly ``benchmark_runs``). ``autotune``
    (default: on for the ``speed`` preset, off for a model in training mode) measures the
    layout candidates of :mod:`fxopt.layout` and keeps the fastest verified one
    (``report["layout"]``).
    ``dump_after`` names passes whose output graph ``report["dumps"]`` holds as text.
    ``progress(phase)`` is called as each phase starts (capture, passes, verify, layout,
    benchmark); ``report["phases_s"]`` has their wall times and ``report["memory"]`` their
    peak memory. With ``memory_check``, a model whose job needs more memory than the
    machine has free (:data:`fxopt.memory.OPTIMIZE_FACTOR` × its weights) is refused
    before anything runs (:class:`~fxopt.errors.NotEnoughMemoryError`).

    Exact by default: every rewrite holds for every input the contract accepts, NaN, ±inf
    and -0.0 included. ``fast_math=True`` also allows those exact for finite inputs only
    (``x + 0 → x``, oneDNN's fused ReLU, attention on SDPA unchecked; each pass's
    ``inexact_rewrites``); ``report["fast_math"]`` lists the ones applied. ``layout``
    names the layout candidate to use (``"onednn"``, ``"plain"``, ...: built and
    verified, not timed) instead of the fastest measured one.
    """
    _check_options(passes, preset, benchmark_runs, max_rounds)
    if memory_check and isinstance(model, nn.Module):
        memory.check_room(
            "optimize",
            memory.weight_bytes(model),
            memory.OPTIMIZE_FACTOR,
            "free some memory, or pass memory_check=False (--no-memory-check) to try anyway",
        )
    preset_name = preset or "speed"
    chosen = (
        list(passes) if passes is not None else presets.get(preset_name, fast_math=fast_math).passes
    )
    optimizer = GraphOptimizer(
        model,
        example_inputs,
        device=device,
        mode=mode,
        dynamic=dynamic,
        dynamic_shapes=dynamic_shapes,
        phases=Phases(progress),
        fast_math=fast_math,
    )
    module = optimizer.optimize(
        chosen,
        max_rounds=max_rounds,
        verify_result=verify,
        skip_freezing=passes is None,
        dump_after=dump_after,
    )
    assert optimizer.pipeline is not None
    if autotune is None:
        autotune = layout is not None or (passes is None and preset_name == "speed")
    choice = None
    layout_skipped = None
    if autotune and optimizer.training:
        layout_skipped = (
            "the model is in training mode: the layout candidates pack parameters as "
            "constants; call model.eval() to optimize for inference"
        )
        if layout is not None:
            raise UserInputError(f"layout={layout!r}: {layout_skipped}")
    elif autotune:
        choice = optimizer.choose_layout(layout_name=layout)
        module = optimizer.optimized
    report = build_report(
        optimizer, name or type(model).__name__, benchmark_runs, verify, benchmark_budget_s
    )
    report["layout"] = choice.to_dict() if choice is not None else None
    inexact = dict(optimizer.pipeline.inexact)
    for rewrite, count in ((report["layout"] or {}).get("inexact") or {}).items():
        inexact[rewrite] = inexact.get(rewrite, 0) + count
    # What "exact" gave up, or would: the rewrites applied that hold for finite inputs only.
    report["fast_math"] = {"enabled": optimizer.fast_math, "inexact": inexact}
    report["phases_s"] = optimizer.phases.rounded()
    report["memory"] = optimizer.phases.memory.report(memory.weight_bytes(model))
    if layout_skipped:
        report["layout_skipped"] = layout_skipped
    return OptimizeResult(module, report, optimizer.pipeline, optimizer.contract)


def _check_options(passes, preset, benchmark_runs, max_rounds) -> None:
    """Options that are wrong whatever the model: refused before any work."""
    if passes is not None and preset is not None:
        raise UserInputError("give either passes= or preset=, not both")
    if isinstance(benchmark_runs, bool) or not isinstance(benchmark_runs, int):
        raise UserInputError(f"benchmark_runs must be an integer, got {benchmark_runs!r}")
    if benchmark_runs < 0:
        raise UserInputError(f"benchmark_runs must be 0 or more, got {benchmark_runs!r}")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
        raise UserInputError(f"max_rounds must be an integer of at least 1, got {max_rounds!r}")
    if passes is not None and isinstance(passes, (str, Pass)):
        raise UserInputError(
            f"passes must be a list of pass names or Pass instances, got {passes!r}; "
            f"did you mean [{passes!r}]?"
        )


def build_report(
    optimizer: GraphOptimizer,
    name: str,
    benchmark_runs: int,
    verified: bool,
    benchmark_budget_s: float | None = None,
) -> dict:
    """The CLI's JSON object for one optimized model (keys in docs/architecture.md)."""
    pipeline = optimizer.pipeline
    assert pipeline is not None and optimizer.optimized is not None
    before = bench.graph_stats(optimizer.original)
    # What the passes did; the layout step's rewrite (conversions, packed-weight reads) is
    # reported on its own, under "layout".
    after = bench.graph_stats(pipeline.module)
    latency = {"original": None, "optimized": None}
    speedup = interval = within_noise = None
    runs = 0
    if benchmark_runs > 0:
        with optimizer.phases("benchmark"):
            timings = _benchmark(optimizer, benchmark_runs, benchmark_budget_s)
        latency = {k: round(v["median_ms"], 4) for k, v in timings.items()}
        runs = int(timings["optimized"]["runs"])
        speedup = (
            round(latency["original"] / latency["optimized"], 3) if latency["optimized"] else None
        )
        if speedup is not None and min(latency.values()) > 0:
            # Per-round ratios of the interleaved calls: what the machine's noise allows.
            paired = bench.speedup_of(
                timings["original"]["samples_ms"], timings["optimized"]["samples_ms"]
            )
            interval = [round(v, 3) for v in paired["ci95"]]
            within_noise = paired["within_noise"]
    check = optimizer.last_check
    contract = optimizer.contract
    return {
        "model": name,
        "mode": optimizer.mode,
        "requested_mode": optimizer.requested_mode,
        "training": optimizer.training,
        "passes": [record.to_dict() for record in pipeline.records],
        "dumps": dict(pipeline.dumps),
        "skipped_passes": list(optimizer.skipped_passes),
        "nodes_before": before["nodes"],
        "nodes_after": after["nodes"],
        "ops_before": before["ops"],
        "ops_after": after["ops"],
        "verified": bool(verified and check is not None and check.ok),
        "checked": list(optimizer.checked) if verified else [],
        "max_abs_error": check.max_abs_error if check is not None else None,
        "dynamic": list(contract.dynamic) if contract is not None else [],
        "contract": contract.to_dict() if contract is not None else None,
        "notes": list(optimizer.capture.get("notes", ())),
        "latency_ms": latency,
        "latency_runs": runs,
        "speedup": speedup,
        # 95 % interval of the per-round speedup; within noise: not a measured change.
        "speedup_ci95": interval,
        "speedup_within_noise": within_noise,
    }


def _benchmark(optimizer: GraphOptimizer, runs: int, budget_s: float | None) -> dict:
    assert optimizer.optimized is not None
    with isolated(optimizer.reference) as original, isolated(optimizer.optimized) as optimized:
        return bench.measure_latency(
            {"original": original, "optimized": optimized},
            optimizer.example_inputs,
            runs=runs,
            warmup=min(5, runs),
            budget_s=budget_s,
        )
