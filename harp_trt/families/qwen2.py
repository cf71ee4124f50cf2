from __future__ import annotations

from .base import ROUTE_WINDOW1, TrtllmTarget
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
