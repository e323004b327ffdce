"""Weights an optimized module derived from the model's: never silently stale.

An optimized module reads the model's own weight storage wherever no pass changed a weight,
so fine-tuning the model, or ``load_state_dict`` into it, reaches the module too (as it
reaches ``torch.compile``'s). A weight a pass *derived* (a convolution with a BatchNorm
folded in, a weight packed for oneDNN, a folded constant computed from parameters) would
not follow: passes record what they derived it from (:func:`note_derived`), and the module's
input guard checks on every call that none of those sources was written in place since
(:class:`WeightWatch`: a version counter per source, a few nanoseconds each). When one
was, the call raises :class:`~fxopt.errors.StaleWeightsError` instead of computing with
the old values.

    >>> import torch
    >>> from torch import fx
    >>> model = torch.nn.Linear(2, 2)
    >>> gm = fx.symbolic_trace(model)
    >>> note_derived(gm, [gm.weight], by="fold-example")
    >>> watch = WeightWatch.of(model, gm)
    >>> watch.check()                      # nothing changed
    >>> with torch.no_grad():
    ...     _ = model.weight.add_(1.0)     # fine-tuning the model in place
    >>> try:
    ...     watch.check()
    ... except StaleWeightsError as error:
    ...     print(str(error)[:60])
    the model's 'weight' was changed in place after fold-example
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import fx, nn

from fxopt.errors import StaleWeightsError

#: gm.meta key: {storage data_ptr: name of the pass that derived a tensor from it}.
DERIVED_KEY = "fxopt.derived_from"


def storage_key(tensor: torch.Tensor) -> int | None:
    """What identifies a tensor's memory across aliases and views (None: no storage)."""
    if tensor.layout != torch.strided or tensor.is_mkldnn or tensor.device.type == "meta":
        return None
    return tensor.untyped_storage().data_ptr() or None


def note_derived(gm: fx.GraphModule, sources: Iterable[torch.Tensor | None], *, by: str) -> None:
    """Record in ``gm.meta`` that pass ``by`` computed a new tensor from ``sources``. The
    record is ``gm``'s own: one another module's meta shares (``meta.update``) is copied
    before it is written."""
    record = gm.meta.get(DERIVED_KEY)
    if not isinstance(record, _Record) or record.owner != id(gm):
        record = _Record(record or {})
        record.owner = id(gm)
        gm.meta[DERIVED_KEY] = record
    for tensor in sources:
        key = storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None:
            record.setdefault(key, by)


class _Record(dict):
    """{storage: pass} of one GraphModule (``owner``: its id)."""

    owner: int = 0


class WeightWatch:
    """The model tensors a module's derived weights came from, and their versions then."""

    def __init__(self, entries: list[tuple[str, weakref.ref, int, str]]):
        self._entries = entries

    @classmethod
    def of(cls, model: nn.Module, gm: fx.GraphModule) -> WeightWatch:
        """The sources ``gm``'s passes recorded, as ``model``'s tensors (those it holds)."""
        derived = gm.meta.get(DERIVED_KEY) or {}
        entries, seen = [], set()

        def watch(name: str, tensor: torch.Tensor, by: str) -> None:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                entries.append((name, weakref.ref(tensor), tensor._version, by))

        for path, module in model.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            sources = [
                (name, tensor)
                for name, tensor in (*module._parameters.items(), *module._buffers.items())
                if tensor is not None and storage_key(tensor) in derived
            ]
            for name, tensor in sources:
                watch(prefix + name, tensor, derived[storage_key(tensor)])
            # BatchNorm's kernel writes its running statistics through the data pointer,
            # with no version bump; its counter of batches is bumped (add_) every time.
            counter = module._buffers.get("num_batches_tracked")
            if sources and counter is not None:
                watch(prefix + "num_batches_tracked", counter, derived[storage_key(sources[0][1])])
        return cls(entries)

    def __len__(self) -> int:
        return len(self._entries)

    # A deep copy or a pickled module holds copies of every weight, the model's included:
    # it follows none of the model's tensors, so there is nothing to watch. (A shared copy,
    # fxopt.ir.copying.shared_copy, keeps the watch: it reads the same memory.)
    def __deepcopy__(self, memo: dict) -> WeightWatch:
        return WeightWatch([])

    def __getstate__(self) -> dict:
        return {"_entries": []}

    def check(self) -> None:
        """Raise StaleWeightsError when a source was written in place since."""
        for name, ref, version, by in self._entries:
            tensor = ref()
            if tensor is not None and tensor._version != version:
                raise StaleWeightsError(
                    f"the model's '{name}' was changed in place after {by} derived a weight "
                    "of this module from it; optimize the model again (its other weights are "
                    "read live)"
                )
