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

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxopt.errors import CaptureError, InputMismatchError

_CACHE_MODULE = "transformers.cache_utils"


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
