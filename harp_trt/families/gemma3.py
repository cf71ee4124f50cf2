from __future__ import annotations

from typing import Any

from .base import QK_NORM_WEIGHTS, ROUTE_WINDOW1, GgufTarget, TrtllmTarget
from .gemma2 import Gemma2Family


class Gemma3Family(Gemma2Family):
    """Gemma3 (text; ``gemma3_text``): Gemma2's sandwich norms and ``(1 + w)`` gains plus a per-head
    Q/K RMSNorm (``q_norm``, ``k_norm``), local (sliding-window) and global layers in a 5:1 pattern
    with their own RoPE bases (``rope_parameters`` per layer type), ``query_pre_attn_scalar``, no
    soft-capping (transformers ``modeling_gemma3.py`` ``Gemma3DecoderLayer.forward``,
    ``Gemma3Attention.forward``). HARP's alpha goes where Gemma2's goes:
    ``h <- h + alpha * post_attention_layernorm(o_proj(repeat_kv(v_proj(norm(h)))))``. With no
    soft-capping, sdpa computes it (the export's opset-23 Attention, a window mask on local layers)."""

    name = "gemma3"
    model_types = ("gemma3_text",)
    hf_config_class = "Gemma3TextConfig"
    qk_norm = True
    attn_implementation = "sdpa"
    attn_implementation_required = False
    weight_names = {**Gemma2Family.weight_names, **QK_NORM_WEIGHTS}
    # TensorRT-LLM's Gemma3ForCausalLM is GemmaForCausalLM (models/gemma/config.py GEMMA3_ARCHITECTURE):
    # GemmaConfig.__init__ forces inter_layernorms and requires query_pre_attn_scalar as for Gemma2;
    # GemmaDecoderLayer.__init__ (models/gemma/model.py) adds qk_layernorm and makes layer i local
    # (RoPE base rope_local_base_freq) when (i + 1) % _sliding_window_pattern; the windows themselves
    # are runtime max_attention_window entries; docs/trtllm-contract.md rows gemma3-*
    trtllm = TrtllmTarget("Gemma3ForCausalLM", ROUTE_WINDOW1, inter_layernorms=True, parallel_embedding=True,
                          share_embedding=True, qk_layernorm=True, gemma3_group=True,
                          extra_config={"attn_bias": False, "mlp_bias": False, "inter_layernorms": True})
    gguf = GgufTarget("deci", refusal="llama.cpp's deci graph has no per-head Q/K RMSNorm and none of Gemma's "
                      "extra norms, embedding scale, sliding windows or GELU MLP (src/models/deci.cpp)")

    def tiny_config_kwargs(self) -> dict[str, Any]:
        kw = super().tiny_config_kwargs()
        for k in ("attn_logit_softcapping", "final_logit_softcapping"):
            kw.pop(k, None)
        kw.update(sliding_window=8, tie_word_embeddings=True)
        return kw

    def tiny_config(self, **overrides: Any):
        """Local layers with one global layer in every three (the real 5:1 pattern, shortened so a
        4-layer model has a global layer, 2, among local ones), unless ``layer_types`` is given."""
        n = overrides.get("num_hidden_layers", self.tiny_config_kwargs()["num_hidden_layers"])
        overrides.setdefault("layer_types", ["full_attention" if i % 3 == 2 else "sliding_attention"
                                             for i in range(n)])
        return super().tiny_config(**overrides)


FAMILY = Gemma3Family
