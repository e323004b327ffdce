"""Capture one training iteration (forward, loss, backward) as a single joint fx graph.

AOTAutograd traces ``loss_fn(model, *inputs)`` and its backward into one functional ATen
graph (``aot_export_module(..., trace_joint=True)``): parameters, buffers and inputs are
placeholders; the outputs are ``(*buffer updates, loss, *parameter gradients)``. The graph
is *functional*: in-place ops (``relu_``, BatchNorm's running-stat updates) become
out-of-place ops whose results the caller writes back, so recomputing a value can never
replay a mutation, and running the graph changes nothing until :class:`Joint` users apply
the buffer updates (once per step).

Every later stage needs the forward/backward boundary. The forward is what the forward
outputs (loss, buffer updates) depend on; everything else is backward. Nodes traced during
the forward that only the backward uses (``detach`` of saved values) are moved after the
forward, so the graph reads ``forward nodes | backward nodes`` and each node carries
``meta["fxopt.phase"]``. Each forward random op (dropout) the backward may need is
preceded by a snapshot of its device's RNG state (:mod:`fxopt.remat.rng`), so a plan can
recompute it by replaying that state:

    >>> import torch, torch.nn.functional as F
    >>> from fxopt.remat.capture import capture_joint, phase
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> joint = capture_joint(model, lambda m, x: m(x).square().mean(), (torch.randn(3, 4),))
    >>> [phase(n) for n in joint.gm.graph.nodes].count("forward") > 0, joint.loss_index
    (True, 0)
    >>> joint.grad_params
    ('0.weight', '0.bias', '2.weight', '2.bias')
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx, nn

from fxopt import op_failures
from fxopt.errors import CaptureError, UserInputError
from fxopt.ir import ops
from fxopt.remat.aot_capture import export_joint_once
from fxopt.remat.chunked_head import ChunkedHead
from fxopt.remat.storage import storage_base, storage_readers, value_bytes
from fxopt.remat.table import BACKWARD, FORWARD, INPUT, OUTPUT
from fxopt.remat.tags import PHASE, phase

if TYPE_CHECKING:
    from fxopt.passes.manager import PipelineResult


@dataclass
class Joint:
    """A captured training iteration.

    ``gm(*params, *buffers, *inputs)`` returns ``(*buffer_updates, loss, *grads)``; the
    names say which parameter or buffer each placeholder and output belongs to.
    """

    gm: fx.GraphModule
    params: tuple[str, ...]  # placeholder order, parameters first
    buffers: tuple[str, ...]
    num_inputs: int
    buffer_updates: tuple[str, ...]  # buffer written by output i, for i < len(buffer_updates)
    loss_index: int
    grad_params: tuple[str, ...]  # parameter whose gradient is output loss_index + 1 + i
    #: What the ``remat-prepare`` pipeline did to ``gm`` (records, skipped sites, dumps).
    prepared: PipelineResult | None = None
    #: Bytes of the largest LM head's logits whose cross-entropy the loss takes (0: none),
    #: and the chunks it was traced in (1: as written; :mod:`fxopt.remat.chunked_head`).
    lm_head_bytes: int = 0
    lm_head_chunks: int = 1
    lm_head_weight_bytes: int = 0  # that head's weight (and its gradient)


class _LossModule(nn.Module):
    """``loss_fn(model, *inputs)`` as a module, so AOTAutograd sees one scalar output."""

    def __init__(self, model: nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        return (self.loss_fn(self.model, *inputs),)


def capture_joint(
    model: nn.Module,
    loss_fn: Callable,
    example_inputs: Sequence,
    *,
    dump_after: Sequence[str] = (),
    lm_head_chunks: int = 1,
) -> Joint:
    """Trace ``loss_fn(model, *example_inputs)`` with its backward into one joint graph.

    Tracing uses fake tensors: no compute, no RNG draws, and the model's parameters and
    buffers are not touched. Random forward ops get RNG-state snapshots
    (the ``add-snapshots`` pass) that ``recompute`` erases unless it replays them.
    ``lm_head_chunks`` > 1 traces each cross-entropy of a linear's rows (an LM head's
    loss) in that many chunks of rows (:mod:`fxopt.remat.chunked_head`).
    """
    if not isinstance(model, nn.Module):
        raise UserInputError(f"expected an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise UserInputError("loss_fn must be callable as loss_fn(model, *inputs)")
    inputs = tuple(example_inputs)
    _check_not_distributed(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise UserInputError("the model has no parameter that requires grad: nothing to train")
    heads = ChunkedHead(lm_head_chunks)
    gm, signature = _export_joint(model, loss_fn, inputs, heads)
    joint = _joint_of(gm, signature)
    if heads.chunked:
        _drop_metadata_checks(gm)
    joint.lm_head_bytes, joint.lm_head_chunks = heads.logit_bytes, max(1, lm_head_chunks)
    joint.lm_head_weight_bytes = heads.weight_bytes
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    tag_phases(
        gm,
        forward_outputs=list(output.args[0])[: joint.loss_index + 1],
        keep_big_readers=bool(heads.chunked),
    )
    joint.prepared = prepare(gm, dump_after=dump_after, accumulate_in_place=bool(heads.chunked))
    return joint


def _frees_more_than_it_makes(
    gm: fx.GraphModule,
    node: fx.Node,
    backward: set[fx.Node],
    position: dict[fx.Node, tuple[int, ...]],
) -> bool:
    """Whether ``node`` is the last reader of backward storages larger than its own: sunk
    to its first user it would keep them alive meanwhile (each chunk of a chunked LM
    head's logit gradient, until the `cat` that joins the chunks' row gradients). A view
    is its base's storage."""
    freed = 0
    for base in {storage_base(gm, i) for i in node.all_input_nodes}:
        readers = storage_readers(gm, base)
        if base in backward and max(position[r] for r in readers) == position[node]:
            freed += value_bytes(gm, base)
    return freed > value_bytes(gm, node)


def _drop_metadata_checks(gm: fx.GraphModule) -> None:
    """Erase torch.export's dtype/device checks of values the graph computes: they hold by
    construction (the trace saw those values' dtypes), and a check of a value nothing
    else reads kept it computed (an LM head's full logits once the loss reads chunks).
    Only in a chunked trace: elsewhere the checks change which plan is found (see
    :func:`_move_after_forward`)."""
    for node in list(gm.graph.nodes):
        if ops.info(node, gm).name != "_assert_tensor_metadata" or node.users:
            continue
        checked = ops.tensor_args(node)
        if checked and all(n.op == "call_function" for n in checked):
            gm.graph.erase_node(node)


def _check_not_distributed(model: nn.Module) -> None:
    """A data-parallel wrapper does its communication in autograd and module hooks, which
    one process's joint graph does not contain: name it instead of failing inside it."""
    wrapper = None
    if isinstance(model, nn.parallel.DistributedDataParallel):
        wrapper = "DistributedDataParallel"
    elif torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        for module in model.modules():
            if isinstance(module, FSDPModule):
                wrapper = "FSDP2 (fully_shard)"
            elif isinstance(module, FullyShardedDataParallel):
                wrapper = "FullyShardedDataParallel"
    if wrapper is not None:
        raise CaptureError(
            f"cannot capture a {wrapper} model's training step (torch {torch.__version__}): "
            "its gradient communication runs in hooks a joint graph does not contain. For "
            "DistributedDataParallel use torch.compile(ddp_model, "
            "backend=fxopt.remat.backend(...)), planned per gradient bucket; for FSDP2 "
            "use fxopt.remat.compile_blocks(<the sharded blocks>), planned per block; FSDP1 "
            "is not supported (docs/remat.md)"
        )


def prepare(
    gm: fx.GraphModule, *, dump_after: Sequence[str] = (), accumulate_in_place: bool = False
) -> PipelineResult:
    """The rewrites a phase-tagged joint graph gets before profiling, in place: dropouts
    split (an output recomputable from its mask, drawing nothing), then RNG snapshots for
    the random ops left, so a plan may recompute them; with ``accumulate_in_place`` (a
    chunked LM head), sums of backward values into a dying operand."""
    from fxopt.passes import PassManager  # these passes read the phases defined here
    from fxopt.remat.accumulate_in_place import AccumulateInPlace
    from fxopt.remat.snapshots import AddSnapshots
    from fxopt.remat.split_dropouts import SplitDropouts

    passes = [SplitDropouts(), AddSnapshots()]
    if accumulate_in_place:
        passes.append(AccumulateInPlace())
    return PassManager(
        passes,
        copy=False,
        name="remat-prepare",
        dump_after=dump_after,
    ).run(gm)


def _export_joint(model: nn.Module, loss_fn: Callable, inputs: tuple, heads: ChunkedHead) -> tuple:
    """AOTAutograd's joint graph of ``loss_fn(model, *inputs)`` and its graph signature,
    traced under ``heads``. A failure is the user's (an op rejects the inputs) or a
    CaptureError that says why."""
    wrapper = _LossModule(model, loss_fn)

    def export():
        with warnings.catch_warnings(), _as_export_traces(), heads:
            warnings.simplefilter("ignore")
            return export_joint_once(wrapper, inputs)

    with op_failures.quiet_fake_tensor_failures(model) as failed:
        try:
            try:
                return export()
            except AssertionError as error:
                if "did not receive a gradient" not in str(error):
                    raise
                return _with_unused_parameters_frozen(export, wrapper, inputs)
        except UserInputError:
            raise
        except Exception as error:
            failure = op_failures.input_failure(error, failed, model)
            if failure is not None:  # an op rejected the inputs: not control flow
                raise op_failures.example_input_error(failure, inputs) from error
            raise CaptureError(_explain(error)) from error


def _as_export_traces():
    """torch.export's "compiling" and "exporting" flags, set as torch.export sets them for
    its own (non-strict) trace: code that branches on tensor values in eager and takes a
    path valid for every value under a compiler takes that path here too (transformers'
    attention masks: ``padding_mask.all()`` and packed-sequence detection are skipped, the
    mask is always built). Without torch's helper, nothing is set."""
    try:
        from torch._export.utils import _compiling_state_context
    except ImportError:
        return contextlib.nullcontext()
    return _compiling_state_context()


def _with_unused_parameters_frozen(export: Callable, wrapper: nn.Module, inputs: tuple):
    """``export()`` with the trainable parameters the loss does not use frozen meanwhile:
    AOTAutograd wants a gradient for every trainable parameter (eager leaves their .grad
    as it is, and so does Step)."""
    unused = _unused_parameters(wrapper, inputs)
    for p in unused:
        p.requires_grad_(False)
    try:
        return export()
    finally:
        for p in unused:
            p.requires_grad_(True)


def _joint_of(gm: fx.GraphModule, signature) -> Joint:
    """The :class:`Joint` of an exported graph: which parameter, buffer and gradient each
    placeholder and output is. Rejects a loss_fn that mutates its inputs or whose loss is
    not a scalar."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    names = [n.name if isinstance(n, fx.Node) else None for n in outs]
    # Outputs are (*updated inputs, loss, *gradients). (The signature's `loss_output`
    # names the first output, not the loss, when buffers are updated: torch 2.13.)
    grads = signature.backward_signature.gradients_to_parameters
    loss_index = len(outs) - len(grads) - 1
    if signature.user_inputs_to_mutate:
        raise UserInputError(
            "loss_fn writes into its inputs in place "
            f"({', '.join(signature.user_inputs_to_mutate.values())}); remat needs inputs "
            "that the step only reads"
        )
    _check_scalar(outs[loss_index])
    prefix = "model."
    return Joint(
        gm=gm,
        params=tuple(p.removeprefix(prefix) for p in signature.parameters),
        buffers=tuple(b.removeprefix(prefix) for b in signature.buffers),
        num_inputs=len(signature.user_inputs),
        buffer_updates=tuple(
            signature.buffers_to_mutate[n].removeprefix(prefix) for n in names[:loss_index]
        ),
        loss_index=loss_index,
        grad_params=tuple(grads[n].removeprefix(prefix) for n in names[loss_index + 1 :]),
    )


def _unused_parameters(wrapper: nn.Module, inputs: tuple) -> list[nn.Parameter]:
    """Trainable parameters the loss does not depend on, found on fake tensors."""
    from torch._subclasses import FakeTensorMode

    params = [(n, p) for n, p in wrapper.named_parameters() if p.requires_grad]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = {n: mode.from_tensor(p).requires_grad_(True) for n, p in params}
        buffers = {n: mode.from_tensor(b) for n, b in wrapper.named_buffers()}
        fake_inputs = tuple(
            mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs
        )
        loss = torch.func.functional_call(wrapper, {**fakes, **buffers}, fake_inputs)[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UserInputError("loss_fn must return a scalar tensor")
        grads = torch.autograd.grad(loss, list(fakes.values()), allow_unused=True)
    return [p for (_, p), g in zip(params, grads) if g is None]


def _check_scalar(loss: object) -> None:
    val = loss.meta.get("val") if isinstance(loss, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.numel() != 1:
        raise UserInputError(
            f"loss_fn must return a scalar loss, got a tensor of shape {tuple(val.shape)}; "
            "reduce it, e.g. with .mean()"
        )


def _explain(error: Exception) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    data_dependent = "DataDependent" in type(error).__name__ or "_local_scalar_dense" in text
    if not data_dependent and ("scalar" in first or "requires gradients" in text):
        return f"loss_fn must return one scalar tensor that depends on the parameters: {first}"
    if data_dependent:
        construct = "a Python branch or .item() on a tensor's values (data-dependent)"
    else:
        construct = "an untraceable construct"
    where = _user_frame(error)
    if data_dependent and _in_torch_source(error, "batchnorm.py", "num_batches_tracked"):
        return (
            "cannot capture the training step as one graph: a BatchNorm with momentum=None "
            "(a cumulative average) divides by its batch count read as a Python number, a "
            "value a graph cannot hold"
            + (f" (reached from {where})" if where else "")
            + "; give it a momentum (0.1 is torch's default), or train it eagerly"
        )
    if where.startswith("transformers/masking_utils"):
        fix = (
            "transformers builds the attention mask by branching on its values: pass the "
            "additive 4-D float mask instead, (1.0 - mask[:, None, None, :].float()) * "
            "torch.finfo(torch.float32).min (same outputs)"
        )
    else:
        fix = "make it depend on shapes only, or move it out of loss_fn"
    return (
        f"cannot capture the training step as one graph: the model or loss uses {construct}"
        + (f" at {where}" if where else "")
        + f" ({type(error).__name__}: {first}); {fix}"
    )


def _in_torch_source(error: BaseException, filename: str, text: str) -> bool:
    """True when a frame of torch's own ``filename`` whose line holds ``text`` is in
    ``error``'s traceback or in the errors it chains."""
    import linecache
    import traceback

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            ours = frame.filename.endswith(filename) and "torch" in frame.filename
            if ours and text in linecache.getline(frame.filename, frame.lineno):
                return True
        error = error.__cause__ or error.__context__
    return False


def _user_frame(error: BaseException) -> str:
    """'file:line in function: source' of the innermost frame of the model's code (not
    torch's, not fxopt's) in ``error``'s traceback or the errors it chains, else ''."""
    import linecache
    import traceback
    from pathlib import Path

    ours = (Path(torch.__file__).parent, Path(__file__).parents[1])
    found = ""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for frame in traceback.extract_tb(error.__traceback__):
            path = Path(frame.filename)
            if frame.filename.startswith("<") or any(p in path.parents for p in ours):
                continue
            parts = path.parts
            short = (
                "/".join(parts[parts.index("site-packages") + 1 :])
                if ("site-packages" in parts)
                else frame.filename
            )
            line = linecache.getline(frame.filename, frame.lineno).strip()
            found = f"{short}:{frame.lineno} in {frame.name}" + (f" (`{line}`)" if line else "")
        error = error.__cause__ or error.__context__
    return found


def tag_phases(
    gm: fx.GraphModule, forward_outputs: Sequence[object], *, keep_big_readers: bool = False
) -> int:
    """Tag every node with its phase and move backward-only nodes after the forward.

    The forward is every node the ``forward_outputs`` depend on. Returns the index of the
    first backward node (the boundary). Moving a non-forward node later keeps the order
    topological: nothing in the forward depends on it.
    """
    graph = gm.graph
    late = _tag(graph, _forward_nodes(graph, forward_outputs))
    _move_after_forward(gm, late, keep_big_readers)
    boundary = sum(1 for n in graph.nodes if phase(n) in (INPUT, FORWARD))
    graph.lint()
    gm.recompile()
    return boundary


def _forward_nodes(graph: fx.Graph, forward_outputs: Sequence[object]) -> set[fx.Node]:
    """Every node the ``forward_outputs`` depend on."""
    forward: set[fx.Node] = set()
    stack = [n for n in forward_outputs if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in forward:
            continue
        forward.add(node)
        stack.extend(node.all_input_nodes)
    # A getitem of a forward multi-output op stays with it: fx code keeps the whole tuple
    # (BatchNorm's output among it) alive until the last getitem has run.
    for node in graph.nodes:
        if node.target is operator.getitem and node.args[0] in forward:
            forward.add(node)
    return forward


def _tag(graph: fx.Graph, forward: set[fx.Node]) -> list[fx.Node]:
    """Set every node's phase; return the backward nodes, in graph order."""
    backward: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "placeholder":
            node.meta[PHASE] = INPUT
        elif node.op == "output":
            node.meta[PHASE] = OUTPUT
        elif node in forward:
            node.meta[PHASE] = FORWARD
        else:
            node.meta[PHASE] = BACKWARD
            backward.append(node)
    return backward


def _move_after_forward(
    gm: fx.GraphModule, late: list[fx.Node], keep_big_readers: bool = False
) -> None:
    """Move backward nodes traced during the forward (AOTAutograd's `detach` of saved
    values) after the forward, each right before its first user: the forward then ends
    where the backward begins, and a saved value's first backward use is where it is
    really needed."""
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for node in reversed(late):  # dead aliases (`detach` nobody reads) would pin memory
        if not node.users and ops.info(node, gm).removable:
            graph.erase_node(node)
    late = [node for node in late if node.graph is graph and node in node.graph.nodes]
    for node in late:
        output.prepend(node)
    # Order keys kept exact as nodes move: a node put right before `first` sorts after
    # everything already there (a later counter) and before `first`. (Float offsets tied
    # when several moved nodes shared a first user, e.g. SDPA's gradients feeding one
    # `stack`, and put a getitem before its op.)
    position: dict[fx.Node, tuple[int, ...]] = {node: (i,) for i, node in enumerate(graph.nodes)}
    # With ``keep_big_readers`` (a chunked LM head), a backward node that is the last
    # reader of storages larger than its own output stays where it was traced. Not by
    # default: on a 0.18 GiB Llama's LM loss the planner then reached a lower simulated
    # peak (0.59 of the baseline, not 0.70) by recomputing 333 nodes, not 239, and the
    # step measured 7% fewer allocated bytes but +0.09-0.14x the weights more resident
    # memory and 13% more time (benchmarks/memory.py).
    backward = set(late)
    sinking = [
        n
        for n in late
        if not (keep_big_readers and _frees_more_than_it_makes(gm, n, backward, position))
    ]
    for counter, node in enumerate(reversed(sinking), start=1):
        first = min(node.users, key=position.__getitem__, default=None)
        if first is not None and first is not output:
            first.prepend(node)
            key = position[first]
            position[node] = (*key[:-1], key[-1] - 1, counter)
