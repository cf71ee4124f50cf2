from __future__ import annotations

from .base import ROUTE_LINEAR, FamilySpec, GgufTarget, TrtllmTarget


class LlamaFamily(FamilySpec):
    """Llama 2/3/3.1 and SmolLM2: pre-norm, RoPE, GQA, no biases."""

    name = "llama"
    model_types = ("llama",)
    hf_config_class = "LlamaConfig"
    # TensorRT-LLM's DeciLMForCausalLM (Nemotron-NAS): a pruned layer is a linear attention
    # (tensorrt_llm/models/nemotron_nas/model.py DeciLMDecoderLayer); docs/trtllm-contract.md decilm-*
    trtllm = TrtllmTarget("DeciLMForCausalLM", ROUTE_LINEAR, layer_configs=True, mlp_prefix="ffn",
                          hf_heterogeneous=True)
    # llama.cpp's deci architecture (Nemotron-51B's) computes a kept layer as llama does and a pruned one
    # as attn_output . attn_norm(x) + x (vendor/llama.cpp src/models/deci.cpp, llama_model_deci::graph)
    gguf = GgufTarget("deci")


FAMILY = LlamaFamily
