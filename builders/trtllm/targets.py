"""How each model family lands in stock TensorRT-LLM (1.x, TensorRT backend): one ``TrtllmTarget``
per family, looked up by family name. The writer (``checkpoint.py``) and the reader (``reader.py``)
never branch on family names; they read these fields.

Two routes exist for a HARP-pruned layer (arXiv 2507.01900, Eq. 4-5: the layer computes the per-token
linear map ``alpha * V.O``):

``linear``  (Llama, Mistral) -> ``DeciLMForCausalLM``, the heterogeneous-layer architecture of
    Nemotron-NAS. A pruned layer's attention has ``impl: "linear"``: one ``hidden x hidden`` matrix
    ``alpha * W_O . repeat_kv(W_V)`` (folded in fp32, then cast), no KV cache, no softmax. An
    ``alpha = 0`` layer becomes ``impl: "no_op"`` (no weights at all). Cost per pruned layer and
    token: one d x d GEMM (less than the unfolded V then O GEMMs), zero KV bytes.

``window1`` (Qwen2, Gemma2) -> the family's own architecture (``Qwen2ForCausalLM``,
    ``Gemma2ForCausalLM``). DeciLM has no attention biases (Qwen2's q/k biases change the scores of
    the *kept* layers), no Gemma2 pre/post feed-forward norms, no soft-capping and no query scale, so
    it cannot carry these families. A pruned layer stays a standard attention layer with Q and K
    weights (and biases) zeroed and a per-layer attention window of **one token**
    (``runtime_defaults.max_attention_window``): softmax over a single key is exactly 1, so the
    layer outputs ``o_proj(repeat_kv(v + b_v))`` per token, i.e. HARP exactly, v bias included.
    alpha goes into ``attention.dense`` (Qwen2) or into the post-attention norm gain (Gemma2, whose
    alpha sits after that norm). Cost per pruned layer: the KV cache holds one block
    (``tokens_per_block`` tokens) per sequence instead of the whole sequence (O(1), not O(L)); the
    QKV and dense GEMMs still run (Q/K on zero weights), plus an attention over one key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harp_trt.errors import UnsupportedArchitectureError

__all__ = ["TrtllmTarget", "TARGETS", "target_for", "ROUTE_LINEAR", "ROUTE_WINDOW1"]

ROUTE_LINEAR = "linear"
ROUTE_WINDOW1 = "window1"


@dataclass(frozen=True)
class TrtllmTarget:
    family: str
    architecture: str                 # TensorRT-LLM ``MODEL_MAP`` key written to config.json
    route: str                        # ROUTE_LINEAR or ROUTE_WINDOW1
    qkv_bias: bool = False            # attention.qkv.bias exists
    norm_offset: float = 0.0          # HF RMSNorm gain is (offset + w); TRT-LLM stores it folded
    inter_layernorms: bool = False    # Gemma2: post-attention, pre/post feed-forward norms
    embedding_scale: bool = False     # Gemma: hidden states start as embedding * sqrt(hidden)
    alpha_in_post_norm: bool = False  # Gemma2: alpha scales the post-attention norm's gain
    parallel_embedding: bool = False  # Gemma forces use_parallel_embedding when tp > 1
    share_embedding: bool = False     # Gemma ties lm_head to the embedding table
    hf_heterogeneous: bool = False    # an HF DeciLM (block_configs) checkpoint can be written
    seq_length_field: bool = False    # config.json carries seq_length (Qwen: QWenConfig.from_hugging_face)
    extra_config: dict[str, Any] = field(default_factory=dict)


TARGETS: dict[str, TrtllmTarget] = {t.family: t for t in [
    TrtllmTarget("llama", "DeciLMForCausalLM", ROUTE_LINEAR, hf_heterogeneous=True),
    TrtllmTarget("mistral", "DeciLMForCausalLM", ROUTE_LINEAR, hf_heterogeneous=True),
    TrtllmTarget("qwen2", "Qwen2ForCausalLM", ROUTE_WINDOW1, qkv_bias=True, seq_length_field=True,
                 extra_config={"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False,
                               "use_logn_attn": False, "mlp_only_layers": [],
                               "decoder_sparse_step": 1, "disable_weight_only_quant_plugin": False}),
    TrtllmTarget("gemma2", "Gemma2ForCausalLM", ROUTE_WINDOW1, norm_offset=1.0,
                 inter_layernorms=True, embedding_scale=True, alpha_in_post_norm=True,
                 parallel_embedding=True, share_embedding=True,
                 extra_config={"attn_bias": False, "mlp_bias": False, "inter_layernorms": True}),
]}


def target_for(family: str) -> TrtllmTarget:
    if family not in TARGETS:
        raise UnsupportedArchitectureError(
            f"no TensorRT-LLM mapping for family {family!r}; supported: {', '.join(sorted(TARGETS))}",
            "add a TrtllmTarget to builders/trtllm/targets.py")
    return TARGETS[family]
