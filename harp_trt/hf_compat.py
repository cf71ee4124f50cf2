"""The transformers 5.x API differences the PyTorch paths meet, in one place. Tested releases: 5.17
(the GPU host the device tool lends, docs/large-models.md "GPU host versions"), 5.24 and 5.25 (the
pinned set, ``constraints.txt``); ``tests/test_harp.py`` runs the cache paths on whichever is installed.

* 5.17's decoder forwards take the KV cache as ``past_key_values=`` and return it as
  ``.past_key_values``; 5.24 renamed both to ``cache`` (``LlamaModel.forward``'s signature in each
  release). :func:`cache_kwarg` reads the name off the module's own ``forward``.
* A pruned layer's cache slot is a :class:`PrunedSlot`: it holds no K/V and answers the length
  questions from the first kept layer of its cache. Each release asks them differently
  (transformers/cache_utils.py):

  - 5.17 and 5.24 ``Cache.get_seq_length`` / ``Cache.get_mask_sizes``: a layer-0 slot that is no
    ``CacheLayerMixin`` is skipped for the first layer that is one (the slot is never asked);
  - 5.25 ``Cache.get_seq_length``: returns ``self.layers[layer_idx].get_seq_length()`` of the
    layer-0 slot directly (the skip was removed), as ``modeling_dory.DoryPastReader``, a
    ``DummyLayer`` subclass with its own ``get_seq_length``, expects.

  With layer 0 pruned, an answer of 0 (an empty layer) would restart positions and masks at 0 every
  step; so the slot defers to the first kept layer in every release. Where ``DummyLayer`` exists
  (5.24+) the slot is one, so ``Cache.is_dummy`` and the exporters' ``isinstance`` checks treat it
  as transformers' own no-cache layer."""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

__all__ = ["cache_kwarg", "no_kv_layer", "holds_no_kv", "PrunedSlot"]

try:  # transformers >= 5.24
    from transformers.cache_utils import DummyLayer as _Base
except ImportError:  # 5.17: no DummyLayer
    _Base = object


class PrunedSlot(_Base):
    """The cache slot of a layer pruned by HARP: no K/V, whole-cache edits are no-ops, and the
    sequence-length and mask questions are answered by the first kept layer of ``cache`` (0 / the
    query length while the cache has none). The link is a weak reference: a strong one would make
    every cache with a pruned slot a reference cycle, whose K/V (gigabytes at 7B) only the cyclic
    garbage collector frees; a ``deepcopy`` of the cache links the copied slot to the copied cache."""

    supports_early_init = False
    is_compileable = True
    is_croppable = True

    def __init__(self, cache: Any = None):
        self.is_initialized = True
        self.keys = self.values = None
        self._cache = None if cache is None else weakref.ref(cache)

    @property
    def cache(self) -> Any:
        return None if self._cache is None else self._cache()

    def __deepcopy__(self, memo: dict) -> "PrunedSlot":
        cache = self.cache  # deepcopy registers the copied cache in ``memo`` before its layers
        return PrunedSlot(None if cache is None else memo.get(id(cache), cache))

    def _kept(self):
        for layer in getattr(self.cache, "layers", ()) or ():
            if not holds_no_kv_by_design(layer):
                return layer
        return None

    def get_seq_length(self) -> int:
        kept = self._kept()
        return 0 if kept is None else kept.get_seq_length()

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        kept = self._kept()
        return (query_length, 0) if kept is None else kept.get_mask_sizes(query_length, *args)

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states is None and value_states is None:  # as DummyLayer: DDP rebuilds caches with these
            return None, None
        raise RuntimeError("a layer pruned by HARP keeps no KV cache: nothing may be written to it")

    def get_max_length(self) -> int:
        return -1

    def _nothing(self, *args, **kwargs) -> None:
        return None

    offload = prefetch = reset = crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _nothing


def cache_kwarg(module: Any) -> str:
    """``"cache"`` where ``module.forward`` takes it (transformers >= 5.24), else ``"past_key_values"``."""
    return _cache_kwarg(type(module))


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def no_kv_layer(cache: Any = None) -> PrunedSlot:
    """The slot of a pruned layer in ``cache`` (see the module docstring); pass the cache it goes
    into, so that its length answers come from that cache's first kept layer."""
    return PrunedSlot(cache)


def holds_no_kv_by_design(layer: Any) -> bool:
    """Whether ``layer`` is a slot that never holds K/V (ours or transformers' ``DummyLayer``)."""
    return isinstance(layer, PrunedSlot) or (_Base is not object and isinstance(layer, _Base))


def holds_no_kv(layer: Any) -> bool:
    """Whether ``layer`` holds no K/V: a pruned slot, transformers' ``DummyLayer``, or a layer that
    has no keys yet."""
    if holds_no_kv_by_design(layer):
        return True
    keys = getattr(layer, "keys", None)
    return keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0
