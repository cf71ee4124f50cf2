from __future__ import annotations

from .llama import LlamaFamily


class MistralFamily(LlamaFamily):
    """Mistral: Llama layout; v0.3 has no sliding window (``sliding_window=None``)."""

    name = "mistral"
    model_types = ("mistral",)
    hf_config_class = "MistralConfig"
    uniform_sliding_window = True  # v0.1's 4096-token window on every layer; v0.3 has none
