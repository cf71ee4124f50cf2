from __future__ import annotations

from .base import FamilySpec


class LlamaFamily(FamilySpec):
    """Llama 2/3/3.1 and SmolLM2: pre-norm, RoPE, GQA, no biases."""

    name = "llama"
    model_types = ("llama",)
    hf_config_class = "LlamaConfig"
