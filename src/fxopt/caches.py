"""transformers' KV caches (``DynamicCache``, ``StaticCache``, ...) as inputs and outputs.

A decode step takes the cache of the tokens so far and returns it grown by one token.
torch.export takes and returns such an object only once its class is a pytree node: then
the graph's inputs and outputs are the cache's key and value tensors, and the object is
rebuilt around them on the way out. transformers ships that registration (it exports its
own models the same way); :func:`register` calls it for the models and inputs that need it.

A cache is also changed by the call that reads it (``DynamicCache.update`` appends to it,
``StaticCache`` writes into its tensors), so every run fxopt makes of a model gets its own
copy (:func:`fxopt.verify.fresh` copies through pytree nodes), and the optimized module
writes the grown cache back into the object it was given, as the model does
(:func:`write_back`).

>>> register(torch.nn.Linear(2, 2), (torch.ones(1, 2),))  # no transformers object: nothing
[]
"""

from __future__ import annotations

import copy as copy_module
import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxopt.errors import CaptureError, InputMismatchError

_CACHE_MODULE = "transformers.cache_utils"
# The layer of a DynamicCache that holds nothing but its keys and values (a sliding-window
# layer also counts the tokens it has seen).
_PLAIN_LAYER = "DynamicLayer"


def is_cache(value: object) -> bool:
    """True for an instance of a transformers ``Cache`` class (without importing it)."""
    cache_utils = sys.modules.get(_CACHE_MODULE)
    return cache_utils is not None and isinstance(value, getattr(cache_utils, "Cache", ()))


def register(model: nn.Module, inputs: Iterable) -> list[str]:
    """Make the transformers cache classes ``model`` may take or return pytree nodes;
    returns the names of the cache classes among ``inputs``. A model that is not a
    transformers model, given no cache, needs nothing (and nothing is imported)."""
    found = sorted({type(v).__name__ for v in among(inputs)})
    from_transformers = type(model).__module__.startswith("transformers.")
    if not found and not (from_transformers and _CACHE_MODULE in sys.modules):
        return found
    from transformers.integrations import executorch

    # DynamicCache flattens to its keys and values and is rebuilt layer by layer.
    executorch.register_dynamic_cache_export_support()
    try:  # (transformers 5: every other Cache class, StaticCache included)
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model
    except ImportError:
        return found
    register_cache_pytrees_for_model(model)
    return found


def check_example(inputs: Iterable) -> None:
    """Refuse an example whose cache :func:`unfaithful` names (:class:`CaptureError`)."""
    reason = unfaithful(inputs)
    if reason is not None:
        raise CaptureError(reason)


def among(inputs: Iterable) -> list[object]:
    """The caches among ``inputs`` (in any container)."""
    return [v for v in pytree.tree_leaves(tuple(inputs), is_leaf=is_cache) if is_cache(v)]


def unfaithful(inputs: Iterable) -> str | None:
    """Why a cache among ``inputs`` is more than its tensors (None: none is). A graph sees
    a cache as its key and value tensors and rebuilds the object from them: state beyond
    them (a sliding-window layer's count of the tokens it has seen, once past its window)
    is lost, and the graph would compute a mask for the wrong position."""
    for cache in among(inputs):
        if _of_plain_layers(cache):
            continue
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        difference = _first_difference(cache, rebuilt, type(cache).__name__)
        if difference is not None:
            return (
                f"the {type(cache).__name__} holds {difference}, which its tensors do not "
                "tell: a captured graph cannot take it (a sliding-window layer past its "
                "window); optimize the model without that cache, or with a cache shorter "
                "than the window"
            )
    return None


def _of_plain_layers(cache: object) -> bool:
    """True for a ``DynamicCache`` (not offloading) whose layers are all plain
    ``DynamicLayer``s: their state is their key and value tensors (and the dtype and device
    those have), so the object rebuilt from its tensors is the same. Checked without
    rebuilding, which would copy the whole cache on every call (transformers' rebuild
    appends each tensor to an empty one)."""
    layers = getattr(cache, "layers", None)
    return (
        type(cache).__name__ == "DynamicCache"
        and getattr(cache, "offloading", False) is False
        and isinstance(layers, list)
        and all(type(layer).__name__ == _PLAIN_LAYER for layer in layers)
    )


def _first_difference(a: object, b: object, where: str, depth: int = 0) -> str | None:
    """The first plain value (number, bool, string) that differs between ``a`` and ``b``,
    their attributes and list items followed a few levels down."""
    if isinstance(a, (bool, int, float, str)) or a is None:
        return None if a == b else f"{where} = {a!r} (rebuilt: {b!r})"
    if depth > 3 or isinstance(a, torch.Tensor):
        return None
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return f"{where} of {len(a)} items"
        pairs = [(f"{where}[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b))]
    elif hasattr(a, "__dict__") and type(a) is type(b):
        pairs = [(f"{where}.{k}", v, vars(b).get(k)) for k, v in vars(a).items()]
    else:
        return None
    for name, x, y in pairs:
        found = _first_difference(x, y, name, depth + 1)
        if found is not None:
            return found
    return None


def check_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook (``with_kwargs=True``): refuses a cache :func:`unfaithful`
    names, before the graph computes a wrong answer from it."""
    reason = unfaithful((args, kwargs))
    if reason is not None:
        raise InputMismatchError(reason)


def write_back_hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
    """A forward hook (``with_kwargs=True``) that applies :func:`write_back`."""
    return write_back((args, kwargs), output)


def install_hooks(module: nn.Module) -> None:
    """:func:`check_hook` and :func:`write_back_hook` on ``module`` (once)."""
    if check_hook not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(check_hook, with_kwargs=True)
    if write_back_hook not in module._forward_hooks.values():
        module.register_forward_hook(write_back_hook, with_kwargs=True)


def write_back(inputs: Iterable, output: object) -> object:
    """``output`` with each cache it returns replaced by the input cache of the same class,
    which is updated to hold the returned one's state: a model reading a cache changes that
    object and returns it, and a caller may keep using the object it passed."""
    given: dict[type, list] = {}
    for value in among(inputs):
        given.setdefault(type(value), []).append(value)
    if not given:
        return output

    def restore(value: object) -> object:
        passed = given.get(type(value))
        if not passed or value is passed[0]:
            return value
        target = passed.pop(0)
        target.__dict__.update(value.__dict__)
        return target

    return pytree.tree_map(restore, output, is_leaf=is_cache)


class _GrownCache:
    """In a graph's output spec, a transformers cache the graph returns (the spec's context is
    the cache's own spec): rebuilt by :func:`_rebuild`, never instantiated."""


def _rebuild(leaves: list, spec: pytree.TreeSpec) -> object:
    """The cache ``spec`` describes, holding ``leaves``. transformers' own rebuild of a
    ``DynamicCache`` appends each tensor to an empty one: a copy of the whole cache per
    decode step (18 ms at batch 8, 4 layers, 1024 tokens), on top of the graph's own."""
    cache = _without_copies(leaves, spec)
    return cache if cache is not None else pytree.tree_unflatten(leaves, spec)


def _without_copies(leaves: list, spec: pytree.TreeSpec) -> object | None:
    """A ``DynamicCache`` of plain layers holding ``leaves`` themselves, or None when the
    cache is another kind. The first one of a ``spec`` is built by transformers' rebuild
    from empty slices of the tensors (so its state is what that rebuild gives) and proved
    to flatten back to ``leaves`` in ``spec``; later ones are copies of it (a decode step
    returns a cache of the same spec on every call)."""
    if spec.type.__name__ != "DynamicCache" or not all(
        isinstance(x, torch.Tensor) and x.dim() == 4 for x in leaves
    ):
        return None
    if spec not in _TEMPLATES:
        built = _built_without_copies(leaves, spec)
        if built is not None:  # (the template keeps no tensor alive)
            built = _copy_holding(built, [None] * len(leaves))
        _TEMPLATES[spec] = built
    template = _TEMPLATES[spec]
    return None if template is None else _copy_holding(template, leaves)


#: The DynamicCache :func:`_without_copies` built first for a spec, holding no tensors
#: (None: that spec's cache is another kind).
_TEMPLATES: dict = {}


def _copy_holding(template: object, leaves: list) -> object:
    """A shallow copy of ``template`` (a cache of plain layers) whose layers hold
    ``leaves`` (keys, then values)."""
    cache = copy_module.copy(template)
    count = len(template.layers)
    cache.layers = [copy_module.copy(layer) for layer in template.layers]
    for layer, keys, values in zip(cache.layers, leaves, leaves[count:]):
        layer.keys, layer.values = keys, values
    return cache


def _built_without_copies(leaves: list, spec: pytree.TreeSpec) -> object | None:
    """transformers' rebuild of ``spec`` from empty slices of ``leaves``, its layers then
    given ``leaves`` themselves; None unless every layer is plain and the result flattens
    back to ``leaves`` in ``spec``."""
    cache = pytree.tree_unflatten([x[:, :, :0] for x in leaves], spec)
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or 2 * len(layers) != len(leaves):
        return None
    for layer, keys, values in zip(layers, leaves, leaves[len(layers) :]):
        if type(layer).__name__ != _PLAIN_LAYER:
            return None  # a sliding-window layer counts the tokens it has seen
        layer.keys, layer.values = keys, values
    again, again_spec = pytree.tree_flatten(cache)
    if again_spec != spec or any(a is not b for a, b in zip(again, leaves)):
        return None
    return cache


pytree.register_pytree_node(
    _GrownCache,
    lambda value: ([], None),  # never called: no _GrownCache object exists
    _rebuild,
)


def returned_without_copies(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """``spec`` (a graph's output spec) with each transformers cache in it rebuilt by
    :func:`_rebuild` instead of the cache class's own unflatten."""
    if spec.is_leaf():
        return spec
    cache_class = getattr(sys.modules.get(_CACHE_MODULE), "Cache", ())
    if isinstance(spec.type, type) and issubclass(spec.type, cache_class):
        leaf = pytree.tree_flatten(0)[1]
        return pytree.TreeSpec(_GrownCache, spec, [leaf] * spec.num_leaves)
    children = [returned_without_copies(child) for child in spec.children()]
    return pytree.TreeSpec(spec.type, spec.context, children)


def return_without_copies(gm: torch.fx.GraphModule) -> None:
    """Make ``gm`` (in place) rebuild the caches it returns by :func:`_rebuild`."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None or info.out_spec is None:
        return
    spec = returned_without_copies(info.out_spec)
    if spec != info.out_spec:
        gm.graph._codegen.pytree_info = info._replace(out_spec=spec)
        gm.recompile()


def copy(value: object) -> object:
    """``value`` with each tensor in it (caches included) a clone."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, value)


def per_call(inputs: tuple) -> Callable[[], tuple]:
    """Inputs for one more call of a model: ``inputs`` themselves, but a copy of each
    input that holds a cache (a timed loop would otherwise grow it call after call, and
    write into the caller's example)."""
    holding = [bool(among((x,))) for x in inputs]
    if not any(holding):
        return lambda: inputs
    return lambda: tuple(copy(x) if held else x for x, held in zip(inputs, holding))
