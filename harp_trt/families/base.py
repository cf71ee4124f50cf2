"""``FamilySpec``: everything harp-trt needs to know about one decoder family, in one place.

A new family is one file here with a ``FamilySpec`` subclass as its ``FAMILY`` (found by the registry).
Module names follow Hugging Face ``*ForCausalLM`` models (``model.layers[i].self_attn.q_proj``...).
How the family lands in TensorRT-LLM is plain data here too (``TrtllmTarget``); ``builders/trtllm``
reads it and never branches on family or architecture names (this package imports no builder)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

__all__ = ["FamilySpec", "TrtllmTarget", "GgufTarget", "ROUTE_LINEAR", "ROUTE_WINDOW1", "QK_NORM_WEIGHTS"]

# How a HARP-pruned layer is written for TensorRT-LLM (builders/trtllm/targets.py explains both).
ROUTE_LINEAR = "linear"    # DeciLM linear attention: alpha * W_O . repeat_kv(W_V), no KV cache
ROUTE_WINDOW1 = "window1"  # the family's own architecture, Q/K zeroed, a one-token attention window


@dataclass(frozen=True)
class TrtllmTarget:
    """What a family's TensorRT-LLM (1.x, TensorRT backend) model is, as plain data. Facts about
    the Hugging Face side (q/k/v biases, the ``1 + w`` norm gain, where alpha goes, the extra norms)
    are the ``FamilySpec``'s own fields; the writer folds them in."""

    architecture: str                 # TensorRT-LLM ``MODEL_MAP`` key written to config.json
    route: str                        # ROUTE_LINEAR or ROUTE_WINDOW1
    layer_configs: bool = False       # per-layer ``layer_configs`` (attention impl) in config.json (DeciLM)
    mlp_prefix: str = "mlp"           # tensor prefix of the MLP (DeciLM: ``ffn``)
    inter_layernorms: bool = False    # Gemma2: post-attention, pre/post feed-forward norms
    softcapping: bool = False         # Gemma2: query_pre_attn_scalar, attention / final logit soft-capping
    parallel_embedding: bool = False  # Gemma forces use_parallel_embedding when tp > 1
    share_embedding: bool = False     # Gemma ties lm_head to the embedding table
    hf_heterogeneous: bool = False    # an HF DeciLM (block_configs) checkpoint can be written
    seq_length_field: bool = False    # config.json carries seq_length as QWenConfig.from_hugging_face writes it
    qk_layernorm: bool = False        # per-head Q/K RMSNorm gains as attention.{q,k}_layernorm (Qwen3, Gemma3)
    gemma3_group: bool = False        # Gemma3ConfigGroup: _sliding_window_pattern, rope_local_base_freq, sliding_window
    extra_config: Mapping[str, Any] = field(default_factory=dict)  # written into config.json as is


@dataclass(frozen=True)
class GgufTarget:
    """How a family lands in llama.cpp as a GGUF (``builders/gguf``), as plain data. ``architecture``:
    the llama.cpp architecture written (``deci``: per-layer head counts, a pruned layer a
    ``hidden x hidden`` linear attention; vendor/llama.cpp ``src/models/deci.cpp``). ``refusal``: why
    llama.cpp's graph for it cannot compute this family's HARP model exactly (None: it can)."""

    architecture: str = "deci"
    refusal: str | None = None


QK_NORM_WEIGHTS = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}  # Qwen3, Gemma3


@dataclass(frozen=True)
class FamilySpec:
    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]      # HF config.model_type values served by this spec
    hf_config_class: ClassVar[str]              # transformers config class, for tiny test models
    qkv_bias: ClassVar[bool] = False            # q/k/v projections carry a bias (Qwen2)
    # Gemma2 normalises the attention output *before* the residual add, so alpha must scale after
    # that norm: h <- h + alpha * post_attention_layernorm(o_proj(...)) (README, the formula at the top).
    alpha_after_post_attn_norm: ClassVar[bool] = False
    norm_weight_offset: ClassVar[float] = 0.0   # RMSNorm gain is (offset + w): Gemma uses 1 + w
    attn_implementation: ClassVar[str] = "sdpa"  # Gemma2 needs eager (sdpa cannot soft-cap)
    attn_implementation_required: ClassVar[bool] = False  # a caller's choice cannot override it (Gemma2)
    extra_layer_norms: ClassVar[tuple[str, ...]] = ()  # norms beyond input/post-attention (Gemma2)
    trtllm: ClassVar[TrtllmTarget | None] = None  # how the family lands in TensorRT-LLM (None: it does not)
    gguf: ClassVar[GgufTarget | None] = None      # how the family lands in llama.cpp (None: not written)
    trtllm_refusal: ClassVar[str | None] = None   # with trtllm None: why TensorRT-LLM cannot take the family
    qk_norm: ClassVar[bool] = False               # per-head RMSNorm on Q and K before RoPE (Qwen3, Gemma3)

    # ---- checkpoint names (Hugging Face safetensors) ---------------------------------------
    layers_module_path: ClassVar[str] = "model.layers"
    layer_prefix: ClassVar[str] = "model.layers.{i}."
    lm_head_name: ClassVar[str] = "lm_head.weight"
    # role -> tensor name; "{i}." names are relative to ``layer_prefix``
    weight_names: ClassVar[dict[str, str]] = {
        "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
        "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
        "o": "self_attn.o_proj.weight", "qb": "self_attn.q_proj.bias", "kb": "self_attn.k_proj.bias",
        "vb": "self_attn.v_proj.bias", "input_ln": "input_layernorm.weight",
        "post_attn_ln": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
        "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
    }

    def weight_name(self, role: str, layer: int | None = None) -> str:
        """Checkpoint name of a tensor role (``"q"``, ``"embed"``...) in layer ``layer``."""
        name = self.weight_names[role]
        return name if layer is None else self.layer_prefix.format(i=layer) + name

    def attn_implementation_for(self, requested: str | None = None) -> str:
        """The transformers attention implementation to load with: the caller's, unless the family
        requires its own (Gemma2's soft-capping runs in eager only)."""
        if requested is None or self.attn_implementation_required:
            return self.attn_implementation
        return requested

    # ---- attention windows ----------------------------------------------------------------
    def layer_windows(self, hf_config) -> tuple[int | None, ...]:
        """Per decoder layer, the attention window transformers runs it with (None: full attention).

        The one rule every stage reads (``ModelDims.windows``). Default: ``config.sliding_window`` on
        the layers ``config.layer_types`` marks ``"sliding_attention"``, as the attention modules do
        (``modeling_qwen2.py`` / ``modeling_gemma2.py``: ``self.sliding_window = config.sliding_window
        if self.layer_type == "sliding_attention" else None``). The configs derive ``layer_types``:
        Qwen2 slides layers ``i >= max_window_layers`` only when ``use_sliding_window`` (otherwise
        ``sliding_window`` is set to None), Gemma2 slides the even layers 0, 2, 4..."""
        n = hf_config.num_hidden_layers
        window = getattr(hf_config, "sliding_window", None)
        types = list(getattr(hf_config, "layer_types", None) or [])
        if not window or not types:
            return (None,) * n
        return tuple(window if t == "sliding_attention" else None for t in types)

    # ---- module access --------------------------------------------------------------------
    @staticmethod
    def decoder(model: nn.Module) -> nn.Module:
        return model.model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return self.decoder(model).layers

    # ---- the two halves of a decoder layer (used by the cached alpha search) --------------
    def attn_residual(self, layer: nn.Module, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual add of an attention output: ``h + attn_out``."""
        return h + attn_out

    def mlp_residual(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The MLP half of the layer: ``h + mlp(post_attention_layernorm(h))``."""
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (where the family has it) logit soft-capping."""
        return self.softcap(model, model.lm_head(self.final_norm(model, h)))

    def final_norm(self, model: nn.Module, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(model).norm(h)

    @staticmethod
    def softcap(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
        cap = getattr(model.config, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    # ---- tiny random models for tests -----------------------------------------------------
    def tiny_config_kwargs(self) -> dict[str, Any]:
        return dict(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        )

    def tiny_config(self, **overrides: Any):
        import transformers

        cls = getattr(transformers, self.hf_config_class)
        kw = self.tiny_config_kwargs()
        kw.update(overrides)
        return cls(**kw)
