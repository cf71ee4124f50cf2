from __future__ import annotations

from .llama import LlamaFamily


class Qwen2Family(LlamaFamily):
    """Qwen2: Llama layout plus q/k/v biases (the v bias survives HARP)."""

    name = "qwen2"
    model_types = ("qwen2",)
    hf_config_class = "Qwen2Config"
    qkv_bias = True
