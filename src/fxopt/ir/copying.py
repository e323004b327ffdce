"""One copy of the weights: fxopt works beside the caller's model, not on copies of it.

Three tools, from cheapest to dearest:

* :func:`isolated`: run a module (the caller's own model included) and leave it as it
  was: its buffers are private scratch copies for the duration, its Python attributes,
  registries and training flags are put back, and a write into a parameter is refused.
  No weight is copied. fxopt checks, times and compares models this way.
* :func:`shared_copy`: a new module tree (modules, graphs, Python attributes) whose
  tensors are new tensor objects over the *same* storage as the original's. Rewriting the
  copy (a folded weight, a weight moved to another dtype or layout, a submodule swapped)
  leaves the original as it was; writing *into* a tensor in place would not, and no fxopt
  pass does (each pass replaces a tensor it changes). Capture and the PassManager copy
  this way: a 0.7 GiB model costs its modules' dictionaries, not 0.7 GiB.
* :func:`clone_module`: a deep copy, weights and all, for a caller who asks for one.

The aliases share the originals' version counters, so an in-place change of a model
tensor (fine-tuning, ``load_state_dict``) is seen through them (:func:`fxopt.ir.weights`).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> copy_ = shared_copy(model)
    >>> copy_[0] is model[0], copy_[0].weight is model[0].weight
    (False, False)
    >>> copy_[0].weight.data_ptr() == model[0].weight.data_ptr()
    True
"""

from __future__ import annotations

import contextlib
import copy
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx, nn

from fxopt.errors import WritesWeightsError
from fxopt.ir import ops
from fxopt.ir.weights import WeightWatch


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy, weights included, silencing the pytree deprecation warning that copying
    the codegen of ``torch.export``'s GraphModules triggers (torch 2.13).

    Every module holds a dozen hook tables, nearly always empty, which ``deepcopy``
    rebuilds one by one through ``__reduce_ex__``: they go into its memo as new empty
    tables up front (what ``deepcopy`` would make of them; a table shared by two modules
    stays shared). A third of the copy's time on a 100k-node model.

        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> copied = clone_module(model)
        >>> copied[0].weight is model[0].weight, copied[0]._forward_hooks is model[0]._forward_hooks
        (False, False)
    """
    return _deepcopy(module, _empty_tables(module))


def shared_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure whose parameters, buffers and tensor attributes are
    aliases of the original's (new tensor objects, same storage and version counter): no
    weight is copied. Tied tensors stay tied. See the module docstring for the contract.

        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> other = shared_copy(model)
        >>> other.weight = torch.nn.Parameter(torch.zeros(2, 2))   # rewriting the copy
        >>> bool(model.weight.abs().sum() > 0)                     # leaves the model alone
        True
    """
    memo = _empty_tables(module)
    for submodule in module.modules():
        for registry in (submodule._parameters, submodule._buffers):
            for tensor in registry.values():
                if tensor is not None and id(tensor) not in memo:
                    memo[id(tensor)] = alias(tensor)
        for value in submodule.__dict__.values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = alias(value)
            elif isinstance(value, WeightWatch):  # the copy reads the same weights
                memo[id(value)] = value
    return _deepcopy(module, memo)


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``tensor``'s storage, sharing its version counter: a
    Parameter stays a Parameter (same ``requires_grad``, same Python attributes)."""
    if not _has_storage(tensor):
        return tensor  # opaque (an mkldnn packed weight): nothing writes into it
    if isinstance(tensor, nn.Parameter):
        out: torch.Tensor = nn.Parameter(tensor.detach(), requires_grad=tensor.requires_grad)
    else:
        out = tensor.detach()
        if tensor.requires_grad and tensor.is_leaf:
            out.requires_grad_(True)
    out.__dict__.update(getattr(tensor, "__dict__", {}))
    return out


def _has_storage(tensor: torch.Tensor) -> bool:
    return tensor.layout == torch.strided and not tensor.is_mkldnn


def _empty_tables(module: nn.Module) -> dict[int, object]:
    memo: dict[int, object] = {}
    for submodule in module.modules():
        for value in submodule.__dict__.values():
            if type(value) in _TABLES and not value and not getattr(value, "__dict__", None):
                memo[id(value)] = type(value)()
    return memo


def _deepcopy(module: nn.Module, memo: dict[int, object]) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(module, memo)


#: Container types whose empty instances clone_module makes anew: plain, without state.
_TABLES = (dict, OrderedDict, set, list)


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph that shares ``gm``'s submodules,
    parameters and buffers: for editing the graph alone (taking a guard out) without
    copying the weights, which for a large model is most of a deep copy's time and memory.

        >>> import torch
        >>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> other = graph_copy(gm)
        >>> other.weight is gm.weight, other.graph is gm.graph
        (True, False)
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    out.meta.update(gm.meta)
    return out


def may_change_state(module: nn.Module) -> bool:
    """Whether calling ``module`` could change it: any module but a GraphModule whose
    every call is a known op that writes nothing and keeps no state (by
    :mod:`fxopt.ir.ops`; a module with hooks is not known); the user's own modules and
    in-place ops could.

        >>> import torch
        >>> may_change_state(fx.symbolic_trace(torch.nn.Linear(2, 2)))
        False
        >>> may_change_state(fx.symbolic_trace(torch.nn.Sequential(torch.nn.BatchNorm1d(2))))
        True
    """
    if not isinstance(module, fx.GraphModule):
        return True
    if ops.any_call(module, lambda op: not op.known or op.stateful or op.random):
        return True
    # An in-place op changes the module only through an attribute (or an input it was
    # given): one on a value the graph computed (relu_ on a kernel's output) changes nothing.
    table = ops.table(module)
    return any(_writes_outside(node, table) for node in module.graph.nodes if table[node].inplace)


def _writes_outside(node: fx.Node, table) -> bool:
    """Whether in-place ``node`` may write an attribute or a graph input (through views)."""
    for value in _written_args(node, table[node]):
        while isinstance(value, fx.Node) and table[value].view and value.args:
            value = value.args[0]
        if not isinstance(value, fx.Node) or value.op in ("get_attr", "placeholder"):
            return True
    return False


def written_buffers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The buffers a call of ``module`` may write, as (owning module, name): for a
    GraphModule the buffers its in-place ops write (an exported BatchNorm's statistics),
    and every buffer of a submodule it calls that may change state (by
    :mod:`fxopt.ir.ops`: a training BatchNorm, a module it does not know); for any other
    module, every buffer (its code is not known)."""
    if not isinstance(module, fx.GraphModule):
        return _all_buffers(module)
    found: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    for node in module.graph.nodes:
        for owner, name in _buffers_written_by(node, module):
            found[(id(owner), name)] = (owner, name)
    return list(found.values())


def _buffers_written_by(node: fx.Node, gm: fx.GraphModule) -> list[tuple[nn.Module, str]]:
    if node.op == "call_module":
        called = gm.get_submodule(str(node.target))
        if isinstance(called, fx.GraphModule):
            return written_buffers(called)
        return _all_buffers(called) if _may_write(ops.info(node, gm)) else []
    if not ops.is_compute(node) or not _may_write(op := ops.info(node, gm)):
        return []
    written = []
    for value in _written_args(node, op):
        if isinstance(value, fx.Node) and value.op == "get_attr":
            owner, name = _owner(gm, str(value.target))
            if owner is not None and name in owner._buffers:
                written.append((owner, name))
    return written


def _may_write(op: ops.OpInfo) -> bool:
    return not op.known or op.stateful or op.inplace


def _written_args(node: fx.Node, op: ops.OpInfo) -> list[object]:
    """The arguments ``op`` writes: all of them for an op the table does not know."""
    if not op.known or "*" in op.mutates:
        return list(node.all_input_nodes)
    written = []
    for where in op.mutates:
        if isinstance(where, int) and where < len(node.args):
            written.append(node.args[where])
        elif isinstance(where, str) and where in node.kwargs:
            written.append(node.kwargs[where])
    return written


def _all_buffers(module: nn.Module) -> list[tuple[nn.Module, str]]:
    return [
        (owner, name)
        for owner in module.modules()
        for name, value in owner._buffers.items()
        if value is not None
    ]


def _owner(module: nn.Module, target: str) -> tuple[nn.Module | None, str]:
    path, _, name = target.rpartition(".")
    try:
        return (module.get_submodule(path) if path else module), name
    except AttributeError:
        return None, name


def own_written_buffers(module: nn.Module) -> list[torch.Tensor]:
    """Give ``module`` its own copy of every buffer a call may write (so that calling it
    never changes another module that shares its tensors); returns the tensors replaced."""
    replaced: dict[int, torch.Tensor] = {}
    clones: dict[int, torch.Tensor] = {}
    for owner, name in written_buffers(module):
        value = owner._buffers[name]
        if id(value) not in clones:
            clones[id(value)] = value.clone()
            replaced[id(value)] = value
        owner._buffers[name] = clones[id(value)]
    return list(replaced.values())


@contextlib.contextmanager
def isolated(module: nn.Module) -> Iterator[nn.Module]:
    """Run ``module`` within the block and find it afterwards as it was before.

    Within the block, every buffer a call may write (:func:`written_buffers`) is a scratch
    copy, so calls made there see each other's updates (a counter runs on, BatchNorm
    statistics move) as for the user; at the end the module's buffers, parameters and
    submodules (the registries), its other attributes (``self.calls += 1``) and the
    training flags are those it had. Parameters are not copied: a parameter written in
    place (its version counter moved) raises :class:`WritesWeightsError` at the end,
    naming it. Mutable attribute values changed in place (a list appended to) are not
    restored.

    What that costs grows with the model (a second or more on a 100k-module model), so
    it is paid once: a GraphModule whose calls can change nothing
    (:func:`may_change_state`) needs no protection, and for any other module the first
    session learns which buffers and which modules' attributes its calls changed; later
    sessions (in the same training mode) protect those, and check every other buffer's
    version counter at the end: a write there (a forward that writes other state on a
    later call than on its first) raises :class:`WritesWeightsError`.

        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(3)              # training mode: forward updates stats
        >>> with isolated(bn) as running:
        ...     _ = running(torch.randn(4, 3))
        >>> float(bn.running_mean.abs().sum()), int(bn.num_batches_tracked)
        (0.0, 0)
    """
    if isinstance(module, fx.GraphModule) and not may_change_state(module):
        yield module
        return
    callees = _stateful_callees(module)
    if callees is not None:  # a graph whose state is that of modules it calls
        with contextlib.ExitStack() as sessions:
            for callee in callees:
                sessions.enter_context(isolated(callee))
            yield module
        return
    learned = _LEARNED.get(module)
    if learned is not None and learned.training != module.training:
        learned = None
    session = _Session(module, learned)
    failed = False
    try:
        yield module
    except BaseException:
        failed = True
        raise
    finally:
        session.end(failed)


def _stateful_callees(gm: nn.Module) -> list[nn.Module] | None:
    """The modules a GraphModule calls whose calls may change state, when those calls are
    all that may (so isolating each of them isolates the graph: a wrapper calling the
    user's model, whose sessions are learned); else None."""
    if not isinstance(gm, fx.GraphModule):
        return None
    callees: dict[int, nn.Module] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            called = gm.get_submodule(str(node.target))
            if isinstance(called, fx.GraphModule) or _may_write(ops.info(node, gm)):
                callees[id(called)] = called
        elif ops.is_compute(node) and _may_write(ops.info(node, gm)):
            return None
    return list(callees.values())


@dataclass
class _Writes:
    """What one module's calls were seen to change in its first isolated session, by the
    submodules' paths (a reference to the module itself would keep it alive)."""

    training: bool
    buffers: list[tuple[str, str]]
    attributes: list[str]


#: Module -> what its calls change (isolated's first session learns it).
_LEARNED: weakref.WeakKeyDictionary[nn.Module, _Writes] = weakref.WeakKeyDictionary()


class _Session:
    """One isolated session: the state saved at its start, put back at its end."""

    def __init__(self, module: nn.Module, learned: _Writes | None):
        self.module, self.learned = module, learned
        named = dict(module.named_modules(remove_duplicate=False))
        modules = list(module.modules())
        self.paths = {id(m): path for path, m in named.items()}
        self.flags = [(m, m.training) for m in modules]
        if learned is None:
            watched, written = modules, written_buffers(module)
        else:
            watched = [named[path] for path in learned.attributes if path in named]
            written = [(named[path], name) for path, name in learned.buffers if path in named]
        self.saved = [_ModuleState(m) for m in watched]
        self.params = [(name, p, p._version) for name, p in module.named_parameters()]
        self.clones: dict[tuple[int, str], torch.Tensor] = {}
        by_tensor: dict[int, torch.Tensor] = {}
        for owner, name in written:
            value = owner._buffers.get(name)
            if value is None:
                continue
            if id(value) not in by_tensor:
                by_tensor[id(value)] = value.clone()
            owner._buffers[name] = self.clones[(id(owner), name)] = by_tensor[id(value)]
        self.written = written
        # Buffers left in place: version counters, to tell a write there.
        self.others = [
            (owner, name, value, value._version)
            for owner in modules
            for name, value in owner._buffers.items()
            if value is not None and (id(owner), name) not in self.clones
        ]

    def end(self, failed: bool) -> None:
        changed = [state.module for state in self.saved if state.restore()]
        for m, training in self.flags:
            m.training = training
        if self.learned is None and not failed:
            written = [
                (self.paths[id(owner)], name)
                for owner, name in self.written
                if _was_written(self.clones.get((id(owner), name)), owner, name)
            ]
            attributes = [self.paths[id(m)] for m in changed]
            _LEARNED[self.module] = _Writes(self.module.training, written, attributes)
        if failed:
            return
        params = [name for name, p, version in self.params if p._version != version]
        if params:
            raise WritesWeightsError(
                f"{type(self.module).__name__} writes its parameter '{params[0]}' in place "
                "when it runs (under torch.no_grad()); fxopt shares the model's weights "
                "instead of copying them and cannot run such a forward: move the write out "
                "of forward"
            )
        buffers = [name for _, name, value, version in self.others if value._version != version]
        if buffers:
            _LEARNED.pop(self.module, None)  # the next session protects every buffer
            raise WritesWeightsError(
                f"{type(self.module).__name__} wrote its buffer '{buffers[0]}' in place on "
                "a call after writing other state on its first: fxopt protects what a "
                "model's first run writes; make the writes the same on every call"
            )


class _ModuleState:
    """What a forward could change in one module, besides the contents of its tensors."""

    __slots__ = ("attributes", "module", "registries")

    def __init__(self, module: nn.Module):
        self.module = module
        self.attributes = dict(module.__dict__)
        self.registries = {
            key: dict(value)
            for key, value in self.attributes.items()
            if key in _REGISTRIES and isinstance(value, dict)
        }

    def restore(self) -> bool:
        """Put the module's attributes back; whether anything had changed."""
        changed = False
        current = self.module.__dict__
        for key in [k for k in current if k not in self.attributes]:
            del current[key]
            changed = True
        for key, value in self.attributes.items():
            if current.get(key, _MISSING) is not value and key != "training":
                current[key] = value
                changed = True
        for key, contents in self.registries.items():
            registry = current[key]
            same = len(registry) == len(contents) and all(
                registry.get(name, _MISSING) is value for name, value in contents.items()
            )
            if not same:
                registry.clear()
                registry.update(contents)
                changed = True
        return changed


_REGISTRIES = ("_parameters", "_buffers", "_modules")
_MISSING = object()


def _was_written(clone: torch.Tensor | None, owner: nn.Module, name: str) -> bool:
    """Whether a session's scratch copy of ``owner.name`` was written. By its version
    counter, and by value too: a native kernel can write through the data pointer without
    bumping it (BatchNorm's running statistics)."""
    if clone is None:
        return False
    if clone._version != 0:
        return True
    original = owner._buffers.get(name)
    return original is None or not torch.equal(clone, original)
