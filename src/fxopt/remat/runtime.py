"""Run training steps on a rewritten joint graph: ``compile_step`` and a ``torch.compile``
backend.

``compile_step`` is the whole pipeline on one training iteration:

    capture (joint fwd+bwd graph) → profile (cost table) → plan (budget) → rewrite → Step

and ``Step(*inputs)`` runs one iteration: the rewritten graph computes the loss, every
gradient and the new BatchNorm statistics without touching the model; only when it has
finished are the statistics written back (once), the gradients accumulated into
``param.grad``, and the optimizer stepped. A step that fails leaves the model as it was
(unless ``update_in_backward=True``: then each update is applied inside the backward).

    >>> import torch, torch.nn.functional as F
    >>> from fxopt.remat import compile_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
    ...                             torch.nn.Linear(32, 32), torch.nn.ReLU(),
    ...                             torch.nn.Linear(32, 4))
    >>> x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    >>> step = compile_step(model, lambda m, x, y: F.cross_entropy(m(x), y), (x, y),
    ...                     memory_budget=0.8, profile_runs=1)
    >>> loss = step(x, y)
    >>> model[0].weight.grad.shape, step.plan.peak <= step.plan.budget_bytes
    (torch.Size([32, 8]), True)

:func:`fxopt.remat.compile_backend.backend` gives the same rewrite to an ordinary training loop
through ``torch.compile``.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from fxopt import op_failures
from fxopt.capture import as_input_tuple
from fxopt.errors import InputMismatchError, UserInputError
from fxopt.ir.copying import shared_copy
from fxopt.passes.manager import PipelineResult
from fxopt.phases import Phases
from fxopt.remat.capture import Joint, capture_joint
from fxopt.remat.chunked_head import DEFAULT_CHUNKS
from fxopt.remat.planners import (
    PLANNERS,
    BudgetError,
    Offload,
    RematPlan,
    budget_bytes,
    make_plan,
    plan,
)
from fxopt.remat.profile import joint_inputs, profile_within
from fxopt.remat.rewrite import Recompute
from fxopt.remat.simulate import simulate
from fxopt.remat.snapshots import AddSnapshots
from fxopt.remat.split_dropouts import SplitDropouts
from fxopt.remat.table import Table
from fxopt.remat.updates import ApplyUpdates, parameter_update

#: The graph rewrites of a step, in order (``dump_after`` names, ``--dump-after``).
REWRITES = (SplitDropouts.name, AddSnapshots.name, Recompute.name, ApplyUpdates.name)


class Step:
    """One compiled training iteration. Call it with inputs shaped like the examples."""

    def __init__(
        self,
        model: nn.Module,
        joint: Joint,
        graph: fx.GraphModule,
        table: Table,
        plan: RematPlan,
        example_inputs: tuple,
        optimizer: torch.optim.Optimizer | None,
        rewrite: PipelineResult | None = None,
        *,
        update_in_backward: bool = False,
    ):
        self.model = model
        # What each graph rewrite did, capture's first (records, skipped sites, dumps).
        runs = [r for r in (joint.prepared, rewrite) if r is not None]
        self.passes = [record for run in runs for record in run.records]
        self.dumps = {name: text for run in runs for name, text in run.dumps.items()}
        self.joint = joint
        self.graph = graph  # the rewritten joint graph
        self.baseline_graph = joint.gm  # the captured graph, nothing recomputed
        self.table = table
        self.plan = plan
        self.optimizer = optimizer
        #: The graph applies each parameter's update itself (see :mod:`fxopt.remat.updates`).
        self.update_in_backward = update_in_backward
        self._examples = tuple(example_inputs)
        self._signature = [_describe(x) for x in example_inputs]
        #: The training flag of every submodule when the step was captured: its graph has
        #: their dropout and BatchNorm behaviour built in.
        self._training = [m.training for m in model.modules()]
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self._params = [params[n] for n in joint.params]
        self._buffers = [buffers[n] for n in joint.buffers]
        self._updates = [buffers[n] for n in joint.buffer_updates]
        self._grad_params = [params[n] for n in joint.grad_params]
        #: Seconds per setup phase (capture, profile, plan, rewrite; then the first step);
        #: replan: plan, rewrite. ``setup_memory()``: each one's peak memory.
        self.setup_s: dict[str, float] = {}
        self._clock: Phases | None = None
        #: The baseline's peak before the LM head was chunked to meet the budget (None:
        #: traced as ``joint.lm_head_chunks`` says from the start).
        self.unchunked_peak: int | None = None

    def replan(self, memory_budget: float | int, planner: str = "greedy", **options) -> Step:
        """Another step for the same model and inputs with a new plan: no re-capture, no
        re-profiling (the cost table is shared)."""
        clock = Phases()
        with clock("plan"):
            chosen = plan(self.table, memory_budget, planner, **options)
        with clock("rewrite"):
            graph, rewrite = _rewrite(
                self.model, self.joint, chosen, self.optimizer if self.update_in_backward else None
            )
        step = Step(
            self.model,
            self.joint,
            graph,
            self.table,
            chosen,
            self._examples,
            self.optimizer,
            rewrite,
            update_in_backward=self.update_in_backward,
        )
        step.setup_s, step._clock = clock.seconds, clock
        return step

    def setup_memory(self) -> dict:
        """Peak resident memory of each setup phase and of the first step
        (:meth:`fxopt.memory.MemoryPhases.report`), beside the model's weights."""
        if self._clock is None:
            return {}
        weights = sum(p.numel() * p.element_size() for p in self._params)
        weights += sum(b.numel() * b.element_size() for b in self._buffers)
        return self._clock.memory.report(weights)

    def arguments(self, inputs: Sequence) -> list:
        """The flat argument list of the joint graphs for these inputs."""
        return [*self._params, *self._buffers, *inputs]

    def __call__(self, *inputs: Any) -> torch.Tensor:
        """Run one iteration; return the loss. Gradients accumulate into ``param.grad``."""
        self._check(inputs)
        if self._clock is not None and "first step" not in self._clock.seconds:
            with self._clock("first step"):  # its time and memory, beside the setup's
                return self._step(inputs)
        return self._step(inputs)

    def _step(self, inputs: Sequence) -> torch.Tensor:
        with torch.no_grad():
            outs = self.graph(*self.arguments(inputs))
            # Nothing of the model was written until here (but the in-backward updates): a
            # failure above leaves it intact.
            for buffer, value in zip(self._updates, outs):
                buffer.copy_(value)
            if not self.update_in_backward:
                for param, grad in zip(self._grad_params, outs[self.joint.loss_index + 1 :]):
                    if param.grad is None:
                        param.grad = grad
                    else:
                        param.grad.add_(grad)
        if self.optimizer is not None and not self.update_in_backward:
            self.optimizer.step()
        return outs[self.joint.loss_index]

    def _check(self, inputs: Sequence) -> None:
        if self.update_in_backward and any(p.grad is not None for p in self.model.parameters()):
            raise UserInputError(
                "a parameter has a gradient before a step that updates in the backward (each "
                "update would also apply it, and optimizer.step() would see several): "
                "call optimizer.zero_grad(set_to_none=True) first"
            )
        flags = [m.training for m in self.model.modules()]
        if flags != self._training:
            name, module = next(
                (name, module)
                for (name, module), was in zip(self.model.named_modules(), self._training)
                if module.training != was
            )
            now = "training" if module.training else "eval"
            raise InputMismatchError(
                f"{name or 'the model'} is in {now} mode, but this step was compiled with it "
                f"in {'eval' if module.training else 'training'} mode (its dropout and "
                "BatchNorm are built into the step): set the mode back, or compile a step for "
                "the model as it is now"
            )
        got = [_describe(x) for x in inputs]
        if got != self._signature:
            raise UserInputError(
                f"step inputs {got} do not match the example inputs it was compiled for "
                f"{self._signature} ({_first_difference(got, self._signature)}): a plan "
                "holds for one shape, dtype and device; compile another step for these"
            )

    def report(self) -> dict:
        """The plan as a JSON-ready dict: what is recomputed (and offloaded), memory and
        cost estimates."""
        p = self.plan
        rows = self.table.rows

        def described(name: str) -> dict:
            row = rows[self.table.index(name)]
            size = sum(self.table.storage_bytes[s] for s in row.owns)
            return {"name": name, "op": row.op, "bytes": size, "time_s": row.time_s}

        recomputed = [described(name) for name in p.recompute]
        offload = None
        if p.offload:
            offload = {
                "nodes": [described(name) for name in p.offload],
                "bytes": p.offloaded_bytes,
                "transfer_s": p.transfer_s,
                "bandwidth_bytes_s": p.details.get("bandwidth_bytes_s"),
                # On the host, "offloaded" memory is the same memory: only simulated.
                "simulated": self._on_host(p.offload),
            }
        return {
            "planner": p.planner,
            "budget_bytes": p.budget_bytes,
            "baseline": {
                "peak_activation_bytes": p.baseline_peak,
                "saved_activation_bytes": p.baseline_saved,
            },
            "optimized": {"peak_activation_bytes": p.peak, "saved_activation_bytes": p.saved},
            "lm_head": self._lm_head(),
            "recompute_s": p.recompute_s,
            "estimated_overhead": p.estimated_overhead,
            "recomputed": recomputed,
            "offload": offload,
            "nodes": {
                "baseline": len(self.baseline_graph.graph.nodes),
                "optimized": len(self.graph.graph.nodes),
            },
            "passes": [record.to_dict() for record in self.passes],
            "setup_s": dict(self.setup_s),
            "setup_memory": self.setup_memory(),
            "memory": self._memory(),
        }

    def _lm_head(self) -> dict:
        """Whether the loss's LM head was traced in chunks (fxopt.remat.chunked_head)."""
        chunks = self.joint.lm_head_chunks if self.joint.lm_head_bytes else 1
        return {
            "logit_bytes": self.joint.lm_head_bytes,
            "chunks": chunks,
            "unchunked_peak_activation_bytes": self.unchunked_peak,
            **({"note": _CHUNKED_NOTE} if chunks > 1 else {}),
        }

    def _on_host(self, names: Sequence[str]) -> bool:
        nodes = {n.name: n for n in self.baseline_graph.graph.nodes}
        return all(nodes[name].meta["val"].device.type == "cpu" for name in names)

    def _memory(self) -> dict:
        """Bytes beside the activations: parameters, their gradients (all alive at the end
        of the backward, or one update at a time), and the optimizer's state."""
        state = 0
        if self.optimizer is not None:
            for values in self.optimizer.state.values():
                state += sum(
                    v.numel() * v.element_size() for v in values.values() if torch.is_tensor(v)
                )
        return {
            "parameter_bytes": sum(p.numel() * p.element_size() for p in self._params),
            "gradient_bytes": sum(p.numel() * p.element_size() for p in self._grad_params),
            "gradients_alive_at_once": not self.update_in_backward,
            "optimizer_state_bytes": state,
            "update_in_backward": self.update_in_backward,
        }


def _first_difference(got: list, expected: list) -> str:
    """Which input differs from the example, and in what: '... input 0 dtype float64, not
    float32'."""
    if len(got) != len(expected):
        return f"{len(got)} inputs, not {len(expected)}"
    for i, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple):
            for what, x, y in zip(("shape", "dtype", "device"), a, b):
                if x != y:
                    return f"input {i} {what} {x}, not {y}"
        return f"input {i} is {a}, not {b}"
    return "same"


def _describe(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype).removeprefix("torch."), x.device.type)
    return type(x).__name__


def sum_of_outputs(model: nn.Module, *inputs: object) -> torch.Tensor:
    """The default loss: the sum of every floating-point tensor ``model(*inputs)`` returns,
    however it nests them (a tensor, tuples, lists, dicts such as ``{"logits": y}``).

    Its backward runs through every op that produced those outputs, as the backward of a
    real loss on them would.

    >>> import torch
    >>> sum_of_outputs(lambda x: {"y": x, "index": x.long()}, torch.ones(2, 3))
    tensor(6.)
    """
    leaves = tree_leaves(model(*inputs))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        kinds = sorted(
            {str(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves}
        )
        raise UserInputError(
            f"the model returns no floating-point tensor to differentiate (it returns "
            f"{', '.join(kinds) or 'nothing'}); pass a loss_fn(model, *inputs) returning a "
            "scalar loss"
        )
    return sum(t.sum() for t in tensors)


def compile_step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor] | None,
    example_inputs: object,
    *,
    memory_budget: float | int = 0.5,
    planner: str = "greedy",
    optimizer: torch.optim.Optimizer | None = None,
    update_in_backward: bool = False,
    profile_runs: int = 3,
    time_limit_s: float = 20.0,
    offload: Offload | None = None,
    dump_after: Sequence[str] = (),
    strict: bool = False,
    lm_head_chunks: int | str = 1,
) -> Step:
    """Capture, profile, plan and rewrite one training step of ``model``.

    ``loss_fn(model, *inputs)`` returns the scalar loss; None means :func:`sum_of_outputs`
    (the model may return any nesting of tensors then). ``memory_budget`` is a fraction in
    (0, 1] of the baseline's peak activation memory, or an int number of bytes.
    ``optimizer``, when given, is stepped after every iteration (eagerly, on the gradients
    the graph produced); with ``update_in_backward=True`` the graph itself applies each
    parameter's update as soon as its gradient exists and frees the gradient
    (:mod:`fxopt.remat.updates`), so gradients never all live at once and ``param.grad`` is
    None after a step. ``offload``: an :class:`~fxopt.remat.Offload` cost model lets the
    ``greedy`` planner keep saved activations on the host as well as recompute them (on a
    CPU its memory effect is simulated: ``report()["offload"]["simulated"]``).
    ``dump_after`` names rewrite passes (:data:`REWRITES`) whose output graph
    ``Step.dumps`` keeps as text. A budget no plan meets (an LM head's logits can be the
    floor) gives a warning and the best plan found, as :func:`~fxopt.remat.backend` does;
    ``strict=True`` raises :class:`~fxopt.remat.BudgetError` instead.

    ``lm_head_chunks`` (opt-in: the head weight's gradient then rounds a few ulps apart):
    an int > 1 traces a loss that is a cross-entropy of a linear's rows (an LM head) in
    that many chunks of rows (:mod:`fxopt.remat.chunked_head`); ``"auto"`` does so, with
    8 chunks, only when the budget is missed without them and chunks could meet it (the
    budget keeps its bytes). When a missed budget's floor holds an LM head's logits, the
    warning says so.
    """
    if planner not in PLANNERS:
        raise UserInputError(f"unknown planner '{planner}'; valid planners: {', '.join(PLANNERS)}")
    for name in dump_after:
        if name not in REWRITES:
            raise UserInputError(
                f"cannot dump the graph after '{name}': not a remat rewrite; valid names: "
                + ", ".join(REWRITES)
            )
    budget_bytes(memory_budget, 1)  # range check before any expensive work
    if offload is not None and planner != "greedy":
        raise UserInputError(f"offload is planned by the 'greedy' planner only, not '{planner}'")
    inputs = as_input_tuple(example_inputs)
    if optimizer is not None:
        _check_optimizer(model, optimizer)
    if update_in_backward and optimizer is None:
        raise UserInputError("update_in_backward=True needs the optimizer that applies them")
    auto = _chunks_option(lm_head_chunks) == "auto"
    clock = Phases()
    loss = sum_of_outputs if loss_fn is None else loss_fn
    attempt = _Attempt(model, loss, inputs, clock, dump_after, profile_runs)
    plan_options = dict(planner=planner, time_limit_s=time_limit_s, offload=offload)
    first = attempt(1 if auto else lm_head_chunks, memory_budget, **plan_options)
    joint, table, chosen, failed = first
    budget, unchunked_peak = memory_budget, None
    if failed is not None and auto and _chunks_may_reach(joint, table, failed, budget):
        # The LM head's logits may be the floor: trace it in chunks, for the same bytes,
        # and keep that unless it reached less.
        unchunked_peak = simulate(table).peak
        budget = budget_bytes(memory_budget, unchunked_peak)
        second = attempt(DEFAULT_CHUNKS, budget, **plan_options)
        if second[3] is None or _best_bytes(*second[1::2]) < _best_bytes(table, failed):
            joint, table, chosen, failed = second
        else:
            budget, unchunked_peak = memory_budget, None
        # The losing capture's graph is reference cycles: collected now, not during the
        # first steps (measured: 23 MiB held on a 0.18 GiB Llama).
        del first, second
        gc.collect()
    if failed is not None:
        failed = _name_the_head(joint, table, failed, budget)
        if strict:
            raise failed
        with clock("plan"):
            chosen = _best_reached(table, budget, planner, failed, offload)
    with clock("rewrite"):
        graph, rewrite = _rewrite(
            model, joint, chosen, optimizer if update_in_backward else None, dump_after
        )
    step = Step(
        model,
        joint,
        graph,
        table,
        chosen,
        inputs,
        optimizer,
        rewrite,
        update_in_backward=update_in_backward,
    )
    step.setup_s, step._clock = clock.seconds, clock
    step.unchunked_peak = unchunked_peak
    return step


_CHUNKED_NOTE = (
    "loss and gradients traced with the LM head in chunks of rows: the loss is eager's to "
    "the bit, the head weight's gradient is a sum over chunks (rounds a few ulps apart)"
)


#: "auto" traces chunks only when the floor they meet (the head weight's gradient, each
#: chunk's product computed into the running sum: one weight-sized tensor) is this far
#: under the lowest peak reached without them.
CHUNKED_FLOOR_MARGIN = 0.9


def _chunks_option(value: object) -> int | str:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserInputError(
            "lm_head_chunks must be an int >= 1 (1: no chunks) or 'auto' (chunks when the "
            f"budget needs them), got {value!r}"
        )
    return value


def _name_the_head(joint: Joint, table: Table, failed: BudgetError, budget) -> BudgetError:
    """``failed``, saying so when an unchunked LM head's logits hold its floor."""
    if joint.lm_head_chunks > 1 or not _chunks_may_reach(joint, table, failed, budget):
        return failed
    return BudgetError(
        f"{failed}; an LM head's logits are part of that floor: lm_head_chunks=8 (or "
        "'auto') traces them in chunks (docs/remat.md)",
        best_fraction=failed.best_fraction,
        floor_fraction=failed.floor_fraction,
        reached=failed.reached,
    )


def _chunks_may_reach(joint: Joint, table: Table, failed: BudgetError, budget) -> bool:
    """Whether chunking the LM head could lower the peak ``failed`` reached towards
    ``budget``: at most it frees the logits, their log-softmax and its gradient (three
    times the logits), and it then meets the weight gradient's floor."""
    best = _best_bytes(table, failed)
    gap = best - budget_bytes(budget, simulate(table).peak)
    return (
        joint.lm_head_bytes > 0
        and 3 * joint.lm_head_bytes >= gap
        and joint.lm_head_weight_bytes < CHUNKED_FLOOR_MARGIN * best
    )


def _best_bytes(table: Table, failed: BudgetError) -> float:
    """The lowest peak a plan of ``table`` reached when it missed its budget."""
    return failed.best_fraction * simulate(table).peak


class _Attempt:
    """Capture, profile and plan a step: the joint graph, its cost table, and the plan or
    the :class:`BudgetError` of a budget no plan meets."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable,
        inputs: tuple,
        clock: Phases,
        dump_after: Sequence[str],
        profile_runs: int,
    ):
        self.model, self.loss_fn, self.inputs, self.clock = model, loss_fn, inputs, clock
        self.dump_after, self.profile_runs = dump_after, profile_runs

    def __call__(self, chunks: int, budget: float | int, **plan_options):
        model, inputs, clock = self.model, self.inputs, self.clock
        with clock("capture"):
            joint = capture_joint(
                model,
                self.loss_fn,
                inputs,
                dump_after=self.dump_after,
                lm_head_chunks=chunks,
            )
        grads = range(joint.loss_index + 1, joint.loss_index + 1 + len(joint.grad_params))
        with clock("profile"):
            try:
                table = profile_within(
                    joint.gm,
                    joint_inputs(joint, model, inputs),
                    budget,
                    runs=self.profile_runs,
                    excluded_outputs=grads,
                )
            except op_failures.NodeFailed as failed:  # the captured step's first real run
                raise op_failures.example_input_error(failed.failure, inputs) from (
                    failed.__cause__
                )
        with clock("plan"):
            try:
                return joint, table, plan(table, budget, **plan_options), None
            except BudgetError as error:
                return joint, table, None, error


def _best_reached(
    table: Table, budget: float | int, planner: str, error: BudgetError, offload: Offload | None
) -> RematPlan:
    """The best plan ``error`` reached, with a warning saying so."""
    warnings.warn(
        f"fxopt remat: {error} -- using the best plan found, {error.best_fraction:.2f} of the "
        "baseline (strict=True raises instead)",
        stacklevel=3,
    )
    reached = error.reached or simulate(table)
    limit = budget_bytes(budget, simulate(table).peak)
    recomputed = frozenset(reached.recomputed)
    return make_plan(table, planner, limit, recomputed, reached, offload, budget_met=False)


def _rewrite(
    model: nn.Module,
    joint: Joint,
    chosen: RematPlan,
    updating: torch.optim.Optimizer | None,
    dump_after: Sequence[str] = (),
) -> tuple[fx.GraphModule, PipelineResult]:
    """A copy of the joint graph with the plan's recomputations and, when ``updating``,
    that optimizer's per-parameter updates in the backward."""
    from fxopt.passes import PassManager

    graph = shared_copy(joint.gm)
    passes: list = [Recompute(chosen.recompute, chosen.offload)]
    if updating is not None:
        params = dict(model.named_parameters(remove_duplicate=False))
        placeholders = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        updates = {
            joint.loss_index + 1 + k: (
                placeholders[joint.params.index(name)],
                parameter_update(updating, params[name]),
            )
            for k, name in enumerate(joint.grad_params)
        }
        passes.append(ApplyUpdates(updates))
    manager = PassManager(passes, copy=False, name="remat", dump_after=dump_after)
    return graph, manager.run(graph)


def _check_optimizer(model: nn.Module, optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserInputError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise UserInputError(
                    "the optimizer updates a tensor that is not a parameter of the model "
                    f"(shape {tuple(p.shape)}); its gradient would never be set by the step"
                )
