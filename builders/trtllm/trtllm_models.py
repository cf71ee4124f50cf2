"""What TensorRT-LLM 1.2 (TensorRT backend) computes from a checkpoint's ``config.json``, as the
reader's own table: the facts the PyTorch reader (``reader.py``) runs, each taken from the
TensorRT-LLM model source that implements it and cited beside it.

This module is the reader's *independent* oracle. It must never read the family tables
(``harp_trt.families``, ``FamilySpec.trtllm``) that the writer (``checkpoint.py``) writes from: a
wrong fact there then makes the written checkpoint disagree with this reading and the golden test
fail, instead of passing in both (``tests/test_trtllm_oracle.py`` checks the imports and mutates the
writer's table). The facts are keyed, like TensorRT-LLM's own registry, by the checkpoint's
``architecture`` string (``tensorrt_llm/models/__init__.py``: ``MODEL_MAP``), and the config fields are
read with the defaults TensorRT-LLM's config classes give them (``models/modeling_utils.py``:
``PretrainedConfig.__init__``; ``models/{llama,qwen,gemma,nemotron_nas}/config.py``).

Sources: ``NVIDIA/TensorRT-LLM``, 1.x TensorRT-backend model code (``tensorrt_llm/``), read for this
module; ``docs/trtllm-contract.md`` section "The reader's own facts" lists them with their tests."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from harp_trt.errors import CorruptWeightsError, UnsupportedArchitectureError
from harp_trt.mapping import ParallelMapping

__all__ = ["ModelFacts", "MODELS", "ACTIVATIONS", "LayerConfig", "ModelConfig", "resolve", "pad_vocab",
           "HF_DECILM_NAMES", "ffn_mult_to_intermediate", "QWEN_MLP_DIVISOR", "QK_NORM_EPS"]


@dataclass(frozen=True)
class ModelFacts:
    """One TensorRT-LLM model class as an architecture string selects it. Every field names the
    source that implements it (paths relative to ``tensorrt_llm/``)."""

    model_class: str                 # models/__init__.py MODEL_MAP[architecture]
    mlp_module: str = "mlp"          # the decoder layer's MLP attribute: LLaMA/QWen/Gemma ``self.mlp``,
    #                                  nemotron_nas/model.py DeciLMDecoderLayer._init_ffn ``self.ffn``
    embedding_scale: bool = False    # gemma/model.py GemmaModel.forward: vocab_embedding(ids) * sqrt(hidden_size)
    gemma2: bool = False             # gemma/config.py GemmaConfig.is_gemma_2 (architecture == Gemma2ForCausalLM):
    #   inter_layernorms forced True (whatever config.json says), query_pre_attn_scalar required;
    #   gemma/model.py GemmaDecoderLayer.__init__: q_scaling = sqrt(query_pre_attn_scalar) / sqrt(head_size),
    #   max_attn_value = attn_logit_softcapping or 0; GemmaDecoderLayer.forward: post_layernorm on the
    #   attention output, pre_/post_feedforward_layernorm around the MLP
    forced_parallel_embedding: bool = False  # gemma/config.py GemmaConfig.__init__:
    #   use_parallel_embedding = mapping.tp_size > 1, the config.json value ignored
    attn_bias: bool | None = False   # default of config.attn_bias (None: no field, no bias):
    #   llama/config.py LLaMAConfig False, qwen/config.py QWenConfig True, gemma/config.py GemmaConfig False;
    #   nemotron_nas/model.py DeciLMDecoderLayer._init_attention Attention(bias=False)
    dense_bias_follows: bool = True  # layers/attention.py Attention.__init__: dense_bias defaults to bias;
    #   qwen/model.py QWenDecoderLayer.__init__ passes dense_bias=False
    mlp_bias: bool | None = False    # default of config.mlp_bias (None: GatedMLP(bias=False), DeciLM)
    generic_head: bool = True        # modeling_utils.py DecoderModelForCausalLM.forward: final logit soft-capping when
    #   the config has the Gemma2ConfigGroup fields, output_multiplier_scale, mup_width_multiplier;
    #   nemotron_nas/model.py DeciLMForCausalLM.forward overrides it with none of these
    own_config_fields: bool = False  # the config class takes query_pre_attn_scalar / *_softcapping as named
    #   arguments (gemma/config.py GemmaConfig.__init__), so they become attributes only for Gemma2;
    #   other classes set every unknown config.json key as an attribute (PretrainedConfig.__init__ kwargs)
    heterogeneous: bool = False      # nemotron_nas/config.py DeciConfig: per-layer layer_configs
    renames: tuple[tuple[str, str], ...] = ()  # nemotron_nas/convert.py update_weights_following_modelopt_optimization,
    #   DeciLMForCausalLM.from_checkpoint's preprocess hook: tensor-name substrings replaced on load
    qwen: bool = False               # qwen/model.py QWenDecoderLayer.__init__ reads config.qwen_type and
    #   config.seq_length with no default; qwen_type 'qwen' halves intermediate_size; use_logn_attn
    llama_multipliers: bool = False  # llama/config.py LLaMAConfig: embedding_/attention_/residual_multiplier,
    #   residual_mlp (Granite, defaults 1.0 / False)
    rope_by_default: bool = False    # position_embedding_type default: PretrainedConfig learned_absolute;
    #   DeciConfig and GemmaConfig rope_gpt_neox
    gemma3: bool = False             # gemma/config.py GemmaConfig.is_gemma_3 (architecture == Gemma3ForCausalLM):
    #   inter_layernorms forced True and query_pre_attn_scalar required (GemmaConfig.__init__, as Gemma2),
    #   Gemma3ConfigGroup (_sliding_window_pattern, rope_local_base_freq, sliding_window) read;
    #   gemma/model.py GemmaDecoderLayer.__init__: qk_layernorm=True, q_scaling = sqrt(qpas) / sqrt(head_size),
    #   no attention soft-capping, is_sliding = bool((layer_idx + 1) % _sliding_window_pattern) picks
    #   rotary_embedding_base_local = rope_local_base_freq for that layer


# layers/attention.py Attention.__init__: the QK-norm RmsNorms get Attention's own eps (default 1e-05);
# QWenDecoderLayer and GemmaDecoderLayer pass none, whatever config.norm_epsilon says
QK_NORM_EPS = 1e-5
# qwen/model.py QWenDecoderLayer.__init__: qk_layernorm = config.qwen_type in ('qwen3', 'qwen3_moe')
QWEN_QK_NORM_TYPES = ("qwen3", "qwen3_moe")


# LLaMA: defaults from llama/config.py LLaMAConfig; the decoder layer (bias=config.attn_bias, dense bias
# by the Attention default, GatedMLP self.mlp) as in llama/model.py LLaMADecoderLayer
_LLAMA = ModelFacts("LLaMAForCausalLM", llama_multipliers=True)
_GEMMA = dict(embedding_scale=True, forced_parallel_embedding=True, own_config_fields=True, rope_by_default=True)
_QWEN = ModelFacts("QWenForCausalLM", attn_bias=True, dense_bias_follows=False, qwen=True)

# architecture -> facts (a subset of models/__init__.py MODEL_MAP: the decoders this reader implements)
MODELS: dict[str, ModelFacts] = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "QWenForCausalLM": _QWEN,
    "Qwen2ForCausalLM": _QWEN,
    "Qwen3ForCausalLM": _QWEN,
    "GemmaForCausalLM": ModelFacts("GemmaForCausalLM", **_GEMMA),
    "Gemma2ForCausalLM": ModelFacts("GemmaForCausalLM", gemma2=True, **_GEMMA),
    "Gemma3ForCausalLM": ModelFacts("GemmaForCausalLM", gemma3=True, **_GEMMA),
    "DeciLMForCausalLM": ModelFacts(
        "DeciLMForCausalLM", mlp_module="ffn", attn_bias=None, mlp_bias=None, generic_head=False,
        heterogeneous=True, rope_by_default=True,
        renames=((".mlp.", ".ffn."), (".attn_replacing_linear.", ".attention."), (".mlp_replacing_linear.", ".ffn."))),
}


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """functional.py ``gelu``: the tanh approximation, for every GELU name in ACT2FN."""
    return F.gelu(x, approximate="tanh")


# functional.py ACT2FN, the entries a GatedMLP (layers/mlp.py) can apply to its ``fc`` branch.
# 'gelu' is the tanh approximation there, unlike Hugging Face's exact 'gelu'.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "relu": F.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "gelu": _gelu, "gelu_new": _gelu, "gelu_fast": _gelu, "gelu_pytorch_tanh": _gelu, "openai-gelu": _gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu2": lambda x: F.relu(x).square(), "squared-relu": lambda x: F.relu(x).square(),
}


def pad_vocab(vocab: int, tp: int) -> int:
    """_utils.py ``pad_vocab_size``: the LM head (and a vocab-split embedding) has a multiple of tp rows."""
    return int(math.ceil(vocab / tp) * tp)


def ffn_mult_to_intermediate(ffn_mult: float, hidden: int) -> int:
    """nemotron_nas/convert.py ``_ffn_mult_to_intermediate_size``: round up to a multiple of 256."""
    n = int(2 * ffn_mult * hidden / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


# nemotron_nas/convert.py load_model_weights: the HF DeciLM tensor each checkpoint tensor is read from
# ("{i}" is the HF layer index); lm_head.weight is read unconditionally (tied or not).
HF_DECILM_NAMES: dict[str, str] = {
    "embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight",
    "input_ln": "model.layers.{i}.input_layernorm.weight", "post_ln": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight", "o": "model.layers.{i}.self_attn.o_proj.weight",
    "linear_attn": "model.layers.{i}.self_attn.linear_attn.weight",
    "fc": "model.layers.{i}.mlp.gate_proj.weight", "gate": "model.layers.{i}.mlp.up_proj.weight",
    "proj": "model.layers.{i}.mlp.down_proj.weight", "linear_mlp": "model.layers.{i}.mlp.linear_mlp.weight",
}


@dataclass(frozen=True)
class LayerConfig:
    """nemotron_nas/layer_config.py DeciLayerConfig after DeciConfig.get_layer_config (Nones filled)."""
    attention: str      # AttentionImplementation: attention | linear | no_op
    kv_heads: int       # this layer's KV heads (global, before tp)
    ffn: str            # FFNImplementation: mlp | linear | no_op
    intermediate: int   # this layer's MLP width (global, before tp)


@dataclass(frozen=True)
class ModelConfig:
    """config.json as TensorRT-LLM's config class for its architecture reads it."""
    architecture: str
    facts: ModelFacts
    vocab: int
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_size: int
    rotary_dim: int
    rotary_base: float
    rotary_scaling: dict | None
    act: str
    eps: float
    tp: int
    pp: int
    parallel_embedding: bool
    embedding_sharding_dim: int
    attn_bias: bool
    dense_bias: bool
    mlp_bias: bool
    embed_scale: float
    inter_layernorms: bool
    q_scaling: float
    attn_softcap: float          # 0: none (Attention max_attn_value)
    final_softcap: float | None
    logit_scale: float           # output_multiplier_scale / mup_width_multiplier
    layers: tuple[LayerConfig, ...]
    qk_norm: bool = False        # Attention(qk_layernorm=True): per-head RmsNorm of q and k before RoPE
    local: tuple[bool, ...] = ()  # per layer: RoPE base rotary_base_local (Gemma3's is_sliding)
    rotary_base_local: float | None = None


def _need(c: dict[str, Any], key: str, where: str) -> Any:
    if c.get(key) is None:
        raise CorruptWeightsError(f"config.json has no {key!r}; TensorRT-LLM reads it with no default ({where})")
    return c[key]


def _refuse(what: str, where: str) -> None:
    raise UnsupportedArchitectureError(f"reader: {what} is not implemented ({where} in TensorRT-LLM)",
                                       "the reader covers the decoders harp-trt writes")


def resolve(c: dict[str, Any]) -> ModelConfig:
    """Read ``config.json`` (a dict) as TensorRT-LLM does: ``PretrainedConfig.from_dict`` picks the
    config class of ``MODEL_MAP[architecture]``, whose defaults fill the missing fields."""
    arch = c.get("architecture")
    if arch not in MODELS:
        raise UnsupportedArchitectureError(f"reader: architecture {arch!r} is not supported; "
                                           f"supported: {', '.join(MODELS)}")
    f = MODELS[arch]
    q = c.get("quantization") or {}
    if q.get("quant_algo") or q.get("kv_cache_quant_algo"):
        _refuse(f"quantization {q}", "quantization/")
    hidden, heads = int(_need(c, "hidden_size", "PretrainedConfig")), int(_need(c, "num_attention_heads", "PretrainedConfig"))
    head = int(c.get("head_size") or hidden // heads)                      # PretrainedConfig.__init__
    rot = c.get("rotary_embedding_dim") or c.get("rotary_dim") or int(head * c.get("rotary_pct", 1.0))
    pos = c.get("position_embedding_type") or ("rope_gpt_neox" if f.rope_by_default else "learned_absolute")
    if pos != "rope_gpt_neox":
        _refuse(f"position_embedding_type {pos!r}", "PositionEmbeddingType")
    act = c.get("hidden_act") or "gelu"                                     # PretrainedConfig default 'gelu'
    if act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"reader: hidden_act {act!r} is not in TensorRT-LLM's ACT2FN subset "
                                           f"the reader implements: {', '.join(ACTIVATIONS)}")
    mapping = ParallelMapping.from_config(c.get("mapping"))
    tp, pp = mapping.tp_size, mapping.pp_size
    attn_bias = bool(c.get("attn_bias", f.attn_bias)) if f.attn_bias is not None else False
    mlp_bias = bool(c.get("mlp_bias", f.mlp_bias)) if f.mlp_bias is not None else False
    parallel = tp > 1 if f.forced_parallel_embedding else bool(c.get("use_parallel_embedding", False))
    kv = int(c.get("num_key_value_heads") or heads)                        # PretrainedConfig.__init__
    inter = int(c.get("intermediate_size") or hidden * 4)                  # PretrainedConfig.__init__
    if f.qwen:
        inter = _qwen_intermediate(c, inter)
    if f.llama_multipliers:
        for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier"):
            if float(c.get(k, 1.0)) != 1.0:
                _refuse(f"LLaMAConfig.{k} = {c[k]}", "llama/model.py")
        if c.get("residual_mlp"):
            _refuse("residual_mlp", "llama/model.py")
    q_scaling, attn_cap, final_cap = 1.0, 0.0, None
    qk_norm, local, base_local = bool(f.qwen and c.get("qwen_type") in QWEN_QK_NORM_TYPES), (), None
    if f.gemma3:
        q_scaling = math.sqrt(float(_need(c, "query_pre_attn_scalar", "gemma/config.py GemmaConfig.__init__"))) / math.sqrt(head)
        pattern = int(_need(c, "_sliding_window_pattern", "gemma/model.py GemmaDecoderLayer.__init__"))
        base_local = float(_need(c, "rope_local_base_freq", "gemma/model.py GemmaDecoderLayer.__init__"))
        local, qk_norm = tuple(bool((i + 1) % pattern) for i in range(int(c["num_hidden_layers"]))), True
        if c.get("rotary_scaling"):
            _refuse("Gemma3 rotary_scaling", "layers/attention.py rotary_embedding_base_local")
        if c.get("final_logit_softcapping"):
            _refuse("Gemma3 final_logit_softcapping", "modeling_utils.py DecoderModelForCausalLM.forward")
    if f.gemma2:
        qpas = c.get("query_pre_attn_scalar")
        if qpas is None:  # GemmaConfig.__init__ asserts it
            raise CorruptWeightsError("config.json has no 'query_pre_attn_scalar'; TensorRT-LLM's GemmaConfig "
                                      "requires it for Gemma2ForCausalLM")
        q_scaling = math.sqrt(float(qpas)) / math.sqrt(head)
        attn_cap = float(c.get("attn_logit_softcapping") or 0.0)
    group = ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping")
    if f.generic_head and (f.gemma2 or not f.own_config_fields and all(k in c for k in group)):
        final_cap = c.get("final_logit_softcapping") or None
    scale = float(c.get("output_multiplier_scale", 1.0)) if f.generic_head else 1.0
    if f.generic_head and c.get("mup_width_multiplier"):
        scale /= float(c["mup_width_multiplier"])
    return ModelConfig(
        arch, f, int(_need(c, "vocab_size", "PretrainedConfig")), hidden, int(_need(c, "num_hidden_layers", "PretrainedConfig")),
        heads, kv, head, int(rot), float(c.get("rotary_base", 10000.0)), c.get("rotary_scaling"), act,
        float(c.get("norm_epsilon", 1e-5)), tp, pp, parallel, int(c.get("embedding_sharding_dim", 0)),
        attn_bias, attn_bias and f.dense_bias_follows, mlp_bias, math.sqrt(hidden) if f.embedding_scale else 1.0,
        f.gemma2 or f.gemma3, q_scaling, attn_cap, final_cap, scale, _layer_configs(c, f, kv, inter),
        qk_norm, local, base_local)


# qwen/model.py QWenDecoderLayer.__init__: "Qwen's real inter_size depends on qwen_type" -- the divisor
# of intermediate_size per qwen_type (qwen/config.py QWenConfig.from_hugging_face's valid types; the MoE
# types are not implemented here)
QWEN_MLP_DIVISOR: dict[str, int] = {"qwen": 2, "qwen2": 1, "qwen2_vl": 1, "qwen2_audio": 1, "qwen2_llava_onevision": 1,
                                    "qwen3": 1}


def _qwen_intermediate(c: dict[str, Any], inter: int) -> int:
    """The MLP width a QWen checkpoint's layers have; logn scaling and MoE refused."""
    qwen_type = _need(c, "qwen_type", "qwen/model.py QWenDecoderLayer.__init__")
    _need(c, "seq_length", "qwen/model.py QWenDecoderLayer.__init__: max_seqlen_for_logn_scaling")
    if c.get("use_logn_attn"):
        _refuse("use_logn_attn", "layers/attention.py use_logn_scaling")
    moe = c.get("moe") or {}
    if moe.get("num_experts") or c.get("moe_num_experts"):
        _refuse(f"Qwen MoE ({qwen_type})", "qwen/model.py")
    if qwen_type not in QWEN_MLP_DIVISOR:
        raise UnsupportedArchitectureError(f"reader: qwen_type {qwen_type!r} is not implemented; "
                                           f"implemented: {', '.join(QWEN_MLP_DIVISOR)}")
    return inter // QWEN_MLP_DIVISOR[qwen_type]


def _layer_configs(c: dict[str, Any], f: ModelFacts, kv: int, inter: int) -> tuple[LayerConfig, ...]:
    """Per layer: attention / FFN implementation and sizes. Only DeciConfig has layer_configs
    (nemotron_nas/config.py DeciConfig.__init__ requires one per layer; get_layer_config fills None
    KV heads and MLP width from the model's); other models are uniform attention + MLP."""
    n = int(c["num_hidden_layers"])
    raw = c.get("layer_configs") if f.heterogeneous else None
    if raw is None:
        return tuple(LayerConfig("attention", kv, "mlp", inter) for _ in range(n))
    if len(raw) != n:
        raise CorruptWeightsError(f"config.json has {len(raw)} layer_configs for {n} layers "
                                  "(DeciConfig.__init__ asserts they match)")
    out = []
    for i, lc in enumerate(raw):
        a, m = lc.get("attention") or {}, lc.get("ffn") or {}
        ai, fi = a.get("impl", "attention"), m.get("impl", "mlp")
        if ai not in ("attention", "linear", "no_op") or fi not in ("mlp", "linear", "no_op"):
            raise CorruptWeightsError(f"layer_configs[{i}] has attention impl {ai!r} / ffn impl {fi!r}; "
                                      "layer_config.py AttentionImplementation / FFNImplementation have "
                                      "attention|linear|no_op and mlp|linear|no_op")
        out.append(LayerConfig(ai, int(a.get("num_key_value_heads") or kv), fi, int(m.get("intermediate_size") or inter)))
    return tuple(out)
