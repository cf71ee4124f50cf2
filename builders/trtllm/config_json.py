"""The TensorRT-LLM checkpoint's ``config.json``, written from the Hugging Face config and the family's
``TrtllmTarget`` as TensorRT-LLM 1.2's own converters write it (``models/{qwen,gemma,nemotron_nas}/
config.py`` ``*Config.from_hugging_face``); each field's reader is a row of ``docs/trtllm-contract.md``."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harp_trt.dims import ModelDims
from harp_trt.errors import PreconditionError
from harp_trt.mapping import ParallelMapping

from .config import STAGE
from .targets import TrtllmTarget

if TYPE_CHECKING:
    from .checkpoint import LayerKinds

__all__ = ["rope_fields", "trtllm_config", "sliding_window_pattern"]

STAGE_NAME = STAGE.name


def rope_fields(config, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(RoPE base, TensorRT-LLM ``rotary_scaling`` or None) of the config's layers of ``layer_type``
    (transformers 5 keys ``rope_parameters`` by layer type for Gemma3; flat for the others)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    legacy = getattr(config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    return theta, {"type": rope_type, **params}


def sliding_window_pattern(layer_types: list[str]) -> int:
    """TensorRT-LLM's ``_sliding_window_pattern`` p for Hugging Face's ``layer_types``: its Gemma3
    layer i is local iff ``(i + 1) % p`` (models/gemma/model.py ``GemmaDecoderLayer.__init__``,
    ``is_sliding``), so the types must follow that period, else the checkpoint is refused."""
    n = len(layer_types)
    full = [i for i, t in enumerate(layer_types) if t != "sliding_attention"]
    p = full[0] + 1 if full else n + 1
    want = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
    if list(layer_types) != want:
        raise PreconditionError(
            STAGE_NAME, f"Gemma3's layer_types {list(layer_types)} do not follow one period; TensorRT-LLM makes "
            "layer i local iff (i + 1) % _sliding_window_pattern (models/gemma/model.py GemmaDecoderLayer)",
            "the ORT, genai and Triton targets take any layer_types")
    return p


def _gemma3_group(config, scaling: dict | None) -> dict[str, Any]:
    """Gemma3ConfigGroup (models/modeling_utils.py; set in models/gemma/config.py GemmaConfig.__init__);
    ``scaling``: the global layers' RoPE scaling (``rope_fields``)."""
    theta_local, scaling_local = rope_fields(config, "sliding_attention")
    if scaling or scaling_local:
        # GemmaConfig.from_hugging_face reads getattr(hf_config, "rotary_scaling", None), a field Hugging Face
        # configs do not have, so TensorRT-LLM's own converter drops it; the reader has no local-layer scaling
        raise PreconditionError(
            STAGE_NAME, f"Gemma3 RoPE scaling ({scaling or scaling_local}) is not written for TensorRT-LLM: its own "
            "converter drops it (models/gemma/config.py GemmaConfig.from_hugging_face)",
            "the ORT, genai and Triton targets take it")
    return {"_sliding_window_pattern": sliding_window_pattern(config.layer_types),
            "rope_local_base_freq": theta_local, "sliding_window": int(config.sliding_window)}


def trtllm_config(config, target: TrtllmTarget, lk: "LayerKinds", dims: ModelDims, dtype: str, tp: int,
                  pp: int) -> dict[str, Any]:
    theta, scaling = rope_fields(config)
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    cfg: dict[str, Any] = {
        "architecture": target.architecture, "dtype": dtype, "logits_dtype": "float32",
        "vocab_size": dims.vocab, "hidden_size": dims.hidden, "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
        "head_size": dims.head_dim, "intermediate_size": dims.intermediate, "hidden_act": act,
        "norm_epsilon": float(config.rms_norm_eps), "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": int(config.max_position_embeddings),
        "rotary_base": theta, "rotary_scaling": scaling,
        "mapping": ParallelMapping(tp, pp).to_config(),
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": bool(target.parallel_embedding and tp > 1),
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        **target.extra_config,
    }
    if target.seq_length_field:
        # written as TensorRT-LLM's own converter writes it (models/qwen/config.py
        # QWenConfig.from_hugging_face: getattr(hf_config, "seq_length", 8192)) so that our config.json
        # equals its; nothing in models/qwen/model.py reads it (the span is max_position_embeddings)
        cfg["seq_length"] = int(getattr(config, "seq_length", None) or 8192)
    if target.share_embedding:
        cfg["share_embedding_table"] = True
    if target.layer_configs:
        cfg["layer_configs"] = [
            {"attention": {"impl": k, "num_key_value_heads": dims.kv_heads if k == "attention" else None},
             "ffn": {"impl": "mlp", "intermediate_size": dims.intermediate}} for k in lk.kinds]
    if target.softcapping:  # Gemma2 config group
        cfg["query_pre_attn_scalar"] = config.query_pre_attn_scalar
        cfg["attn_logit_softcapping"] = getattr(config, "attn_logit_softcapping", None)
        cfg["final_logit_softcapping"] = getattr(config, "final_logit_softcapping", None)
    if target.gemma3_group:
        cfg["query_pre_attn_scalar"] = config.query_pre_attn_scalar
        cfg["final_logit_softcapping"] = getattr(config, "final_logit_softcapping", None)
        cfg.update(_gemma3_group(config, scaling))
    windows = lk.window_list()
    if windows is not None:
        # Engine default for KvCacheConfig.max_attention_window (models/modeling_utils.py
        # RuntimeDefaults). No sink_token_length: KvCacheConfig::setSinkTokenLength requires > 0.
        cfg["runtime_defaults"] = {"max_attention_window": windows}
    return cfg
