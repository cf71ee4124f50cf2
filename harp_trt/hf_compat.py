"""The transformers 5.x API differences the PyTorch paths meet, in one place: this machine runs
5.24, the GPU host the device tool lends runs 5.17 (docs/large-models.md, "GPU host versions").

* 5.17's decoder forwards take the KV cache as ``past_key_values=`` and return it as
  ``.past_key_values``; 5.24 renamed both to ``cache`` (``LlamaModel.forward``'s signature in each
  release). :func:`cache_kwarg` reads the name off the module's own ``forward``.
* 5.24 has ``transformers.cache_utils.DummyLayer``, a cache layer that holds nothing, for layers
  without attention; 5.17 has none. :func:`no_kv_layer` gives a ``DummyLayer`` where it exists,
  else a :class:`NoKVLayer`. Neither is a ``CacheLayerMixin``, which is what makes 5.17's
  ``Cache.get_seq_length`` and ``Cache.get_mask_sizes`` (transformers/cache_utils.py) ask the first
  layer that is one: with layer 0 pruned an empty ``DynamicLayer`` there would report 0 cached
  tokens, and positions and masks would restart at 0 every step."""
from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_kwarg", "no_kv_layer", "holds_no_kv", "NoKVLayer"]


class NoKVLayer:
    """The cache slot of a layer that keeps no K/V, for transformers without ``DummyLayer``: what
    ``Cache`` reads of every layer (``is_initialized``, ``is_compileable``, ``is_croppable``,
    ``supports_early_init``, ``get_max_length``) and no-ops for what it asks of every layer
    (``reset``, ``crop``, ``reorder_cache``, the batch edits, ``offload``/``prefetch``)."""

    supports_early_init = False
    is_compileable = True
    is_croppable = True
    is_initialized = True
    keys = values = None

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states is None and value_states is None:
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


def no_kv_layer() -> Any:
    """A cache layer that holds no K/V: ``DummyLayer`` where transformers has it, else a
    :class:`NoKVLayer` (see the module docstring)."""
    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:  # transformers < 5.24
        return NoKVLayer()
    return DummyLayer()


def holds_no_kv(layer: Any) -> bool:
    """Whether ``layer`` holds no K/V: a ``DummyLayer``, or a layer that has no keys yet."""
    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:  # transformers < 5.24
        DummyLayer = NoKVLayer
    if isinstance(layer, (DummyLayer, NoKVLayer)):
        return True
    keys = getattr(layer, "keys", None)
    return keys is None or not getattr(layer, "is_initialized", True) or keys.numel() == 0
