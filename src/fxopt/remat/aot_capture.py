"""AOTAutograd's joint training graph in one trace instead of two.

``torch._functorch.aot_autograd.aot_export_module(trace_joint=True)`` traces the model
once into a joint graph whose calling convention is ``(primals, tangents) -> (forward
outputs, one gradient per input)``, then traces *that graph* a second time with make_fx,
only to flatten its inputs and outputs, drop the unused tangent placeholder and drop the
``None`` gradients of buffers and inputs. On ResNet-152 the second trace is about 40 % of
capture. :func:`export_joint_once` makes the same graph from the first trace by editing
it: the ops, their order and their metadata are the first trace's, the placeholders and
outputs are the ones ``aot_export_module`` would produce, and the signature is built by
the same torch helper. When the first trace's graph has a shape this module does not
expect (a tangent that is read, a gradient for an input that does not require grad, a
torch version that changed the convention), it falls back to ``aot_export_module``.

    >>> import torch
    >>> from fxopt.remat.aot_capture import export_joint_once
    >>> class Loss(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model = torch.nn.Linear(4, 2)
    ...     def forward(self, x):
    ...         return (self.model(x).square().mean(),)
    >>> gm, signature = export_joint_once(Loss(), (torch.randn(3, 4),))
    >>> [n.op for n in gm.graph.nodes].count("placeholder"), len(gm.graph.output_node().args[0])
    (3, 3)
    >>> sorted(signature.backward_signature.gradients_to_parameters.values())
    ['model.bias', 'model.weight']
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from fxopt.errors import UserInputError

_NO_GRADIENT = "did not receive a gradient"  # aot_export_module's message, which callers read


class _Unexpected(Exception):
    """The first trace's graph is not in the shape this module rewrites."""


def export_joint_once(wrapper: nn.Module, inputs: tuple) -> tuple[fx.GraphModule, object]:
    """``aot_export_module(wrapper, inputs, trace_joint=True, output_loss_index=0)``'s graph
    and signature, traced once. ``wrapper(*inputs)`` returns ``(loss,)``.

    Raises AssertionError naming a parameter that "did not receive a gradient" as
    ``aot_export_module`` does, so callers can freeze unused parameters and retry.
    """
    from torch._functorch import aot_autograd

    params = dict(wrapper.named_parameters(remove_duplicate=False))
    buffers = dict(wrapper.named_buffers(remove_duplicate=False))
    flat_state, state_spec = pytree.tree_flatten({**params, **buffers})
    functional_call = aot_autograd.create_functional_call(
        wrapper, state_spec, len(flat_state), store_orig_mod=True
    )

    def loss_of(*args):
        (loss,) = functional_call(*args)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserInputError(
                f"loss_fn must return a scalar loss, got {shape}; reduce it, e.g. with .mean()"
            )
        if not loss.requires_grad:
            raise UserInputError(
                "loss_fn must return a scalar tensor that depends on the parameters: its "
                "result does not require gradients"
            )
        return (loss,)

    full_args = (*flat_state, *inputs)
    gm, metadata, in_spec, out_spec = aot_autograd._aot_export_function(
        loss_of,
        full_args,
        num_params_buffers=len(flat_state),
        no_tangents=True,
        trace_joint=True,
    )
    try:
        _flatten_joint(gm, full_args, num_forward_outputs=1 + _mutated_inputs(metadata))
    except _Unexpected:
        return aot_autograd.aot_export_module(
            wrapper, inputs, trace_joint=True, output_loss_index=0
        )
    signature = aot_autograd.create_graph_signature(
        gm,
        metadata,
        in_spec,
        out_spec,
        user_args_flat=pytree.arg_tree_leaves(*inputs),
        params_and_buffers_flat=list(flat_state),
        param_names=list(params),
        buffer_names=list(buffers),
        trace_joint=True,
        num_user_fw_outs=1,
        loss_index=0,
    )
    return gm, signature


def _mutated_inputs(metadata) -> int:
    return metadata.num_mutated_inp_runtime_indices


def _flatten_joint(gm: fx.GraphModule, full_args: tuple, num_forward_outputs: int) -> None:
    """Turn ``(primals, tangents) -> (forward outputs, gradients)`` into ``(*primals) ->
    (*forward outputs, *gradients of the inputs that require grad)``, in place."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    if len(placeholders) - len(tangents) != len(full_args) or any(t.users for t in tangents):
        raise _Unexpected
    output = graph.output_node()
    outs = list(output.args[0])
    if len(outs) != num_forward_outputs + len(full_args):
        raise _Unexpected
    forward, gradients = outs[:num_forward_outputs], outs[num_forward_outputs:]
    kept = []
    for position, (arg, grad) in enumerate(zip(full_args, gradients)):
        wants_grad = isinstance(arg, torch.Tensor) and arg.requires_grad
        if wants_grad and grad is None:
            raise AssertionError(f"the input at position {position} {_NO_GRADIENT}")
        if grad is not None and not wants_grad:
            raise _Unexpected
        if wants_grad:
            kept.append(grad)
    for tangent in tangents:
        graph.erase_node(tangent)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs and a flat output tuple
    output.args = (tuple(forward + kept),)
    graph.lint()
    gm.recompile()
