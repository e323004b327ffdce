"""A region of a graph run by code a compiler generated for it, with the region's own fx
graph kept beside it: :class:`CompiledRegion` (see :mod:`fxopt.passes.inductor_regions`,
which builds them).

It lives in ``fxopt.ir`` because the op table knows it: a region is pure (the compiled
code writes nothing it is given), so passes and :func:`fxopt.ir.copying.may_change_state`
treat its call like any other pure op.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from fxopt.ir.guard import GUARD_NAME


class CompiledRegion(nn.Module):
    """``eager`` (an fx GraphModule returning a tuple) and ``compiled``, the code
    generated for it, called with a list of tensors (Inductor's boxed convention).

    ``shapes`` is None when the code holds for every size the graph allows; a
    :class:`SymbolicLayouts` when it holds for the sizes its guards accept; otherwise
    the (shape, stride, dtype) of each tensor input it was specialised to, and any other
    input runs ``eager``. ``single`` unpacks a
    one-value result, as the fused call site expects. Generated code does not pickle: a
    region saved with ``torch.save`` runs ``eager`` once loaded.

        >>> import torch
        >>> gm = torch.fx.symbolic_trace(lambda x: (x.relu() + 1,))
        >>> region = CompiledRegion(gm, lambda xs: gm(*xs), None, single=True)
        >>> region(torch.tensor([-1.0, 2.0]))
        tensor([1., 3.])
    """

    def __init__(
        self,
        eager: fx.GraphModule,
        compiled: Callable[[list], Sequence[torch.Tensor]],
        shapes: tuple | None,
        *,
        single: bool,
    ):
        super().__init__()
        self.eager = eager
        self.compiled = compiled
        self.shapes = shapes
        self.single = single

    def forward(self, *args):
        if self.compiled is None or (self.shapes is not None and not _matches(args, self.shapes)):
            out = self.eager(*args)
        else:
            out = self.compiled(list(args))
        return out[0] if self.single else tuple(out)

    def __getstate__(self) -> dict:
        # Generated code does not pickle: a saved region runs its fx graph once loaded.
        return {**self.__dict__, "compiled": None}

    def __deepcopy__(self, memo: dict) -> CompiledRegion:
        # The generated code is stateless (weights it holds, it only reads): copies share it.
        return CompiledRegion(
            copy.deepcopy(self.eager, memo), self.compiled, self.shapes, single=self.single
        )


def layout_of(value: object) -> object:
    """What a specialised region compares of each input: a tensor's shape, stride and
    dtype; any other value itself."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype)
    return value


class SymbolicLayouts:
    """What code compiled for symbolic sizes accepts: each input's kind (a tensor's dtype,
    rank and device; any other input's value), and the guards its shape environment
    collected on the tensors' sizes and strides while the code was generated (torch's own
    guard expression over the inputs at ``positions``, whose fake values are ``fakes``)."""

    def __init__(self, example: Sequence, positions: Sequence[int], fakes: Sequence, shape_env):
        self.kinds = tuple(map(_kind_of, example))
        self.positions = tuple(positions)
        self.expression = shape_env.produce_guards_expression(list(fakes), ignore_static=False)
        self._compile()

    def _compile(self) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        self._code = None if self.expression is None else compile(self.expression, "guard", "eval")
        self._names = dict(SYMPY_INTERP)

    def __call__(self, args: Sequence) -> bool:
        if len(args) != len(self.kinds) or not all(map(_same_kind, args, self.kinds)):
            return False
        if self._code is None:
            return True
        tensors = {f"t{i}": args[p] for i, p in enumerate(self.positions)}
        return bool(eval(self._code, self._names, {"L": tensors}))

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_code", "_names")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._compile()


def _kind_of(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.dim(), value.device)
    return value


def _same_kind(value: object, kind: object) -> bool:
    return _kind_of(value) == kind


def _matches(args: tuple, shapes) -> bool:
    if isinstance(shapes, SymbolicLayouts):
        return shapes(args)
    if len(args) != len(shapes):
        return False
    return all(layout_of(a) == s for a, s in zip(args, shapes))


def returns_a_tuple(sub: fx.GraphModule) -> bool:
    """Make ``sub`` return a tuple (what Inductor compiles); True when it returned one
    value before."""
    output = sub.graph.output_node()
    (returned,) = output.args
    if isinstance(returned, (tuple, list)):
        return False
    output.args = ((returned,),)
    sub.recompile()
    return True


def inline(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace ``node``, a call of an fx submodule, by a copy of that submodule's ops, and
    delete the submodule; the call's ``getitem`` users read the copied values."""
    sub = gm.get_submodule(str(node.target))
    with gm.graph.inserting_before(node):
        out = _copy_into(gm.graph, sub.graph, list(node.args))
    picks = [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
    if picks and len(picks) == len(node.users):
        for pick in picks:
            _, index = pick.args
            pick.replace_all_uses_with(out[index])
            gm.graph.erase_node(pick)
    else:  # a one-value submodule, made to return a tuple
        node.replace_all_uses_with(out[0] if isinstance(out, (tuple, list)) else out)
    gm.graph.erase_node(node)
    delattr(gm, str(node.target))


def _copy_into(graph: fx.Graph, sub: fx.Graph, args: list) -> object:
    env: dict[fx.Node, object] = {}
    placeholders = iter(args)
    for n in sub.nodes:
        if n.op == "placeholder":
            env[n] = next(placeholders)
        elif n.op == "output":
            (returned,) = n.args
            return fx.node.map_arg(returned, lambda a: env[a])
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
    raise AssertionError("a graph without an output")


def flat_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm``'s graph taking its flattened inputs and returning its outputs as one flat
    tuple, without its input guard; it shares ``gm``'s attributes and submodules."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            returned = pytree.tree_leaves(node.args[0])
            graph.output(tuple(env[n] if isinstance(n, fx.Node) else n for n in returned))
        elif not (node.op == "call_module" and node.target == GUARD_NAME):
            env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(gm, graph)


def input_leaves(gm: fx.GraphModule, example_inputs: Sequence) -> list:
    """The example as ``gm``'s placeholders receive it (flattened by its input spec)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.in_spec is None:
        return list(example_inputs)
    return list(fx_pytree.tree_flatten_spec((list(example_inputs), {}), info.in_spec))


def calling(gm: fx.GraphModule, region: nn.Module, name: str) -> fx.GraphModule:
    """A module with ``gm``'s signature (inputs, outputs, metadata) whose body is one
    call of ``region`` (its submodule ``name``) on the flattened inputs, which returns
    the outputs as one flat tuple (:func:`flat_graph`'s convention)."""
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    placeholders = [graph.node_copy(n, lambda n: n) for n in gm.graph.find_nodes(op="placeholder")]
    root = nn.Module()
    root.add_module(name, region)
    call = graph.call_module(name, tuple(placeholders))
    returned, spec = pytree.tree_flatten(gm.graph.output_node().args[0])
    picks = [graph.call_function(operator.getitem, (call, i)) for i in range(len(returned))]
    graph.output(pytree.tree_unflatten(picks, spec))
    out = fx.GraphModule(root, graph)
    out.meta.update(gm.meta)
    return out
