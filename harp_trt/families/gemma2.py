from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import ROUTE_WINDOW1, FamilySpec, GgufTarget, TrtllmTarget


class Gemma2Family(FamilySpec):
    """Gemma2: post-attention and pre/post-feed-forward norms, ``(1 + w)`` RMSNorm gains,
    attention and final-logit soft-capping, alternating sliding-window layers. HARP's alpha goes
    after the post-attention norm: ``h <- h + alpha * post_attention_layernorm(o_proj(...))``."""

    name = "gemma2"
    model_types = ("gemma2",)
    hf_config_class = "Gemma2Config"
    alpha_after_post_attn_norm = True
    norm_weight_offset = 1.0
    attn_implementation = "eager"
    attn_implementation_required = True
    extra_layer_norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    weight_names = {**FamilySpec.weight_names,
                    "pre_feedforward_layernorm": "pre_feedforward_layernorm.weight",
                    "post_feedforward_layernorm": "post_feedforward_layernorm.weight"}
    # TensorRT-LLM's Gemma2ForCausalLM: norms are stored as 1 + w (tensorrt_llm/models/gemma/convert.py);
    # the model scales embeddings by sqrt(hidden) itself, so the writer stores them unscaled
    # (tensorrt_llm/models/gemma/model.py GemmaModel.forward); docs/trtllm-contract.md row gemma-norm
    trtllm = TrtllmTarget("Gemma2ForCausalLM", ROUTE_WINDOW1, inter_layernorms=True,
                          softcapping=True, parallel_embedding=True, share_embedding=True,
                          extra_config={"attn_bias": False, "mlp_bias": False, "inter_layernorms": True})
    # llama_model_deci::graph (src/models/deci.cpp) has no post-attention / feed-forward norms, no sqrt(hidden)
    # embedding scale, no logit soft-capping, no sliding windows and a SiLU MLP only
    gguf = GgufTarget("deci", refusal="llama.cpp's deci graph has none of Gemma2's extra norms, embedding scale, "
                      "logit soft-capping, sliding windows or GELU MLP")

    def attn_residual(self, layer: nn.Module, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        return h + layer.post_attention_layernorm(attn_out)

    def mlp_residual(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))

    def tiny_config_kwargs(self) -> dict[str, Any]:
        kw = super().tiny_config_kwargs()
        kw.update(sliding_window=8, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                  final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
        return kw


FAMILY = Gemma2Family
