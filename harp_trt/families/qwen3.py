from __future__ import annotations

from typing import Any

from .base import QK_NORM_WEIGHTS, ROUTE_WINDOW1, GgufTarget, TrtllmTarget
from .llama import LlamaFamily


class Qwen3Family(LlamaFamily):
    """Qwen3 (dense): Llama layout plus a per-head RMSNorm on Q and K before RoPE (``q_norm``,
    ``k_norm``, transformers ``modeling_qwen3.py`` ``Qwen3Attention.forward``), no q/k/v bias,
    ``head_dim`` set on its own (128 at every size, so ``heads * head_dim != hidden`` at 0.6B, 4B
    and 8B), tied embeddings at the small sizes. A pruned layer loses Q, K and their norms with
    them, so HARP's layer is Llama's: ``h <- h + alpha * o_proj(repeat_kv(v_proj(norm(h))))``."""

    name = "qwen3"
    model_types = ("qwen3",)
    hf_config_class = "Qwen3Config"
    qk_norm = True
    weight_names = {**LlamaFamily.weight_names, **QK_NORM_WEIGHTS}
    # TensorRT-LLM's Qwen3ForCausalLM is QWenForCausalLM (models/__init__.py MODEL_MAP) with qwen_type
    # 'qwen3': QWenDecoderLayer.__init__ (models/qwen/model.py) turns on Attention(qk_layernorm=True,
    # RmsNorm) and reads attn_bias from config.json, whose QWenConfig default is True, so it is written
    # False as QWenConfig.from_hugging_face writes it for qwen3; docs/trtllm-contract.md rows qwen3-*
    trtllm = TrtllmTarget("Qwen3ForCausalLM", ROUTE_WINDOW1, seq_length_field=True, qk_layernorm=True,
                          extra_config={"qwen_type": "qwen3", "attn_bias": False, "mlp_bias": False,
                                        "use_logn_attn": False, "mlp_only_layers": [],
                                        "decoder_sparse_step": 1, "disable_weight_only_quant_plugin": False})
    gguf = GgufTarget("deci", refusal="llama.cpp's deci graph has no per-head Q/K RMSNorm (src/models/deci.cpp "
                      "builds Q and K straight from wq/wk), which Qwen3's kept layers need")

    def tiny_config_kwargs(self) -> dict[str, Any]:
        kw = super().tiny_config_kwargs()
        kw.update(head_dim=32, attention_bias=False)  # heads * head_dim = 128 != hidden 64, as in Qwen3-4B
        return kw


FAMILY = Qwen3Family
