from __future__ import annotations

from .base import ROUTE_WINDOW1, GgufTarget, TrtllmTarget
from .llama import LlamaFamily


class Qwen2Family(LlamaFamily):
    """Qwen2: Llama layout plus q/k/v biases (the v bias survives HARP)."""

    name = "qwen2"
    model_types = ("qwen2",)
    hf_config_class = "Qwen2Config"
    qkv_bias = True
    # TensorRT-LLM's Qwen2ForCausalLM: qwen_type and attn_bias are read with no default
    # (tensorrt_llm/models/qwen/model.py QWenDecoderLayer.__init__, models/qwen/config.py QWenConfig);
    # docs/trtllm-contract.md rows qwen-type, qwen-seq-length
    trtllm = TrtllmTarget("Qwen2ForCausalLM", ROUTE_WINDOW1, seq_length_field=True,
                          extra_config={"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False,
                                        "use_logn_attn": False, "mlp_only_layers": [],
                                        "decoder_sparse_step": 1, "disable_weight_only_quant_plugin": False})
    # kept layers' q/k/v biases would load (llama_model_base::create_tensor_qkv) and be added
    # (llm_graph_context::build_qkv), but a pruned layer keeps alpha * W_O . repeat(b_V), a constant that
    # deci's linear attention drops: llama_model_deci::graph computes build_lora_mm(wo, cur) only, the
    # attn_output bias it loads (wo_b) is added on the self-attention path alone (src/models/deci.cpp)
    gguf = GgufTarget("deci", refusal="llama.cpp's deci linear attention has no bias (src/models/deci.cpp adds "
                      "attn_output.bias only on kept layers), so a pruned Qwen2 layer's folded V bias "
                      "alpha * W_O . b_V cannot be written")


FAMILY = Qwen2Family
