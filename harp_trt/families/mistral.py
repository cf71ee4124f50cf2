from __future__ import annotations

from .llama import LlamaFamily


class MistralFamily(LlamaFamily):
    """Mistral: Llama layout; v0.3 has no sliding window (``sliding_window=None``)."""

    name = "mistral"
    model_types = ("mistral",)
    hf_config_class = "MistralConfig"

    def layer_windows(self, hf_config) -> tuple[int | None, ...]:
        """``config.sliding_window`` on every layer when set (v0.1: 4096; v0.3: None), whatever
        ``layer_types`` says: ``modeling_mistral.py`` ``MistralAttention.forward`` passes
        ``sliding_window=config.sliding_window`` for all layers and ``MistralConfig`` has no layer types."""
        return (getattr(hf_config, "sliding_window", None) or None,) * hf_config.num_hidden_layers


FAMILY = MistralFamily
