"""``ModelDims``: the decoder shapes several stages need (FLOP counts, checkpoint layouts, KV
sizes), read once from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ModelDims", "attention_dims"]


def attention_dims(cfg: Any) -> tuple[int, int, int] | None:
    """(heads, kv_heads, head_dim) of a Hugging Face config, given as a config object or as the
    ``config.json`` dict (a multimodal ``text_config`` is used); None when it has no heads.
    ``num_key_value_heads`` defaults to the heads (MHA), ``head_dim`` to hidden / heads."""
    if isinstance(cfg, Mapping):
        cfg = cfg.get("text_config", cfg)
        get = cfg.get
    else:
        def get(name, default=None):
            return getattr(cfg, name, default)
    heads = get("num_attention_heads")
    if not heads:
        return None
    hidden = get("hidden_size")
    hd = get("head_dim") or (hidden // heads if hidden else None)
    return (int(heads), int(get("num_key_value_heads") or heads), int(hd)) if hd else None


@dataclass(frozen=True)
class ModelDims:
    """The shapes the count needs, read from a Hugging Face config (``from_config``)."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    windows: tuple[int | None, ...] = field(default=())  # per layer: None = full (FamilySpec.layer_windows)

    @classmethod
    def from_config(cls, cfg: Any) -> "ModelDims":
        heads, kv, hd = attention_dims(cfg)
        n = cfg.num_hidden_layers
        windows = tuple(_family(cfg).layer_windows(cfg))
        return cls(n, cfg.hidden_size, heads, kv, hd, cfg.intermediate_size, cfg.vocab_size, windows)

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None


def _family(cfg: Any):
    """The config's family, whose ``layer_windows`` is the one sliding-window rule; a model type no
    family serves gets the default rule (``config.layer_types``)."""
    from .errors import UnsupportedArchitectureError
    from .families import FamilySpec, family_of

    try:
        return family_of(cfg)
    except UnsupportedArchitectureError:
        return FamilySpec()
