"""The Hugging Face side of a HARP deployment on TensorRT-LLM: a heterogeneous-layer DeciLM
(Nemotron-NAS style) checkpoint, read by TensorRT-LLM's PyTorch backend and ``trtllm-serve``
(``DeciLMForCausalLM``, ``block_configs``).

Each layer has a block config ``{"attention": {...}, "ffn": {...}}``: a kept layer is a normal GQA
attention (``n_heads_in_group = heads / kv_heads``), a HARP-pruned layer has
``replace_with_linear: true`` and one weight ``model.layers.{i}.self_attn.linear_attn.weight``
(``alpha * W_O . repeat_kv(W_V)``, hidden x hidden), an ``alpha = 0`` layer has ``no_op: true`` and
no attention weights at all. The MLP width is stored as ``ffn_mult``, from which readers recompute
``intermediate = round_up(int(2 * ffn_mult * hidden / 3), 256)``; a model whose intermediate size is
not a multiple of 256 cannot be expressed and is reported as skipped.

``model_type`` ``nemotron-nas`` is unknown to ``transformers``, so the folder carries a small config
class of its own (``configuration_decilm.py``, ``auto_map``): load it with
``trust_remote_code=True``. Only Llama-style families fit (no attention biases, no extra norms)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from harp_trt.families import family_of
from harp_trt.plan import Plan

from .checkpoint import DTYPES, ModelDims, _layer_tensors, _rope_fields, check_plan_matches, fold_vo
from .targets import target_for

__all__ = ["write_hf_decilm", "ffn_mult_for", "intermediate_from_ffn_mult", "HF_CONFIG_MODULE"]

log = logging.getLogger(__name__)

HF_CONFIG_MODULE = "configuration_decilm.py"
_CONFIG_SOURCE = '''"""Config class for a HARP-pruned heterogeneous (DeciLM / Nemotron-NAS style) checkpoint written by
harp-trt. Block configs become small objects with attribute access (``block.attention.no_op``)."""
from dataclasses import asdict, dataclass, field
from typing import Optional

from transformers import PretrainedConfig


@dataclass
class AttentionBlockConfig:
    n_heads_in_group: Optional[int] = None
    no_op: bool = False
    replace_with_linear: bool = False
    sparsify: Optional[list] = None


@dataclass
class FFNBlockConfig:
    ffn_mult: Optional[float] = None
    no_op: bool = False
    replace_with_linear: bool = False
    sparsify: Optional[list] = None


@dataclass
class BlockConfig:
    attention: AttentionBlockConfig = field(default_factory=AttentionBlockConfig)
    ffn: FFNBlockConfig = field(default_factory=FFNBlockConfig)

    @classmethod
    def from_dict(cls, d):
        return cls(AttentionBlockConfig(**d.get("attention", {})), FFNBlockConfig(**d.get("ffn", {})))


class DeciLMConfig(PretrainedConfig):
    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, rope_theta=10000.0, rope_scaling=None, **kwargs):
        self.block_configs = [b if isinstance(b, BlockConfig) else BlockConfig.from_dict(b)
                              for b in (block_configs or [])]
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        super().__init__(**kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["block_configs"] = [asdict(b) for b in self.block_configs]
        return out
'''


def intermediate_from_ffn_mult(ffn_mult: float, hidden: int) -> int:
    """How DeciLM readers turn ``ffn_mult`` back into an MLP width (rounded up to 256)."""
    n = int(2 * ffn_mult * hidden / 3)
    return n if n % 256 == 0 else n + 256 - n % 256


def ffn_mult_for(intermediate: int, hidden: int) -> float | None:
    """The ``ffn_mult`` that round-trips to ``intermediate``, or None when none can."""
    if intermediate % 256:
        return None
    mult = intermediate * 3 / (2 * hidden)
    return mult if intermediate_from_ffn_mult(mult, hidden) == intermediate else None


def write_hf_decilm(model, plan: Plan, out_dir: str | Path, *, dtype: str = "float16",
                    tokenizer=None) -> dict[str, Any]:
    """Write the HF DeciLM checkpoint into ``out_dir``. Returns ``{"written": bool, ...}``; when the
    family or the MLP width cannot be expressed, nothing is written and ``reason`` says why."""
    from safetensors.torch import save_file

    family = family_of(model.config)
    target = target_for(family.name)
    if not target.hf_heterogeneous:
        return {"written": False, "reason": f"{family.name} has features DeciLM lacks (see targets.py); "
                "use the TensorRT-LLM checkpoint"}
    dims = ModelDims.of(model.config)
    mult = ffn_mult_for(dims.intermediate, dims.hidden)
    if mult is None:
        return {"written": False, "reason": f"intermediate_size {dims.intermediate} is not expressible as a "
                "DeciLM ffn_mult (needs a multiple of 256)"}
    check_plan_matches(model, plan, family)
    amap = plan.alpha_map
    cfg = model.config
    theta, scaling = _rope_fields(cfg)
    blocks, tensors = [], {}
    tdt = DTYPES[dtype]
    dec = family.decoder(model)

    def put(name: str, t: torch.Tensor) -> None:
        tensors[name] = t.detach().to(tdt, copy=True).contiguous()

    put("model.embed_tokens.weight", dec.embed_tokens.weight)
    put("model.norm.weight", dec.norm.weight)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if not tied:
        put("lm_head.weight", model.lm_head.weight)
    for i, layer in enumerate(family.layers(model)):
        p = f"model.layers.{i}."
        t = _layer_tensors(family, layer, dims)
        alpha = amap.get(i)
        if alpha == 0.0:
            attn = {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False, "sparsify": None}
        elif alpha is not None:
            attn = {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True, "sparsify": None}
            put(p + "input_layernorm.weight", t["input_ln"])
            put(p + "self_attn.linear_attn.weight", fold_vo(t["v"], t["o"], dims, alpha))
        else:
            attn = {"n_heads_in_group": dims.heads // dims.kv_heads, "no_op": False,
                    "replace_with_linear": False, "sparsify": None}
            put(p + "input_layernorm.weight", t["input_ln"])
            for n in "qkvo":
                put(p + f"self_attn.{n}_proj.weight", t[n])
        blocks.append({"attention": attn, "ffn": {"ffn_mult": mult, "no_op": False,
                                                   "replace_with_linear": False, "sparsify": None}})
        put(p + "post_attention_layernorm.weight", t["post_attn_ln"])
        for n in ("gate", "up", "down"):
            put(p + f"mlp.{n}_proj.weight", t[n])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = {
        "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
        "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
        "hidden_size": dims.hidden, "num_attention_heads": dims.heads, "num_hidden_layers": dims.layers,
        "num_key_value_heads": dims.kv_heads, "head_dim": dims.head_dim, "intermediate_size": dims.intermediate,
        "vocab_size": dims.vocab, "hidden_act": cfg.hidden_act, "rms_norm_eps": float(cfg.rms_norm_eps),
        "rope_theta": theta, "rope_scaling": scaling,
        "max_position_embeddings": int(cfg.max_position_embeddings), "tie_word_embeddings": tied,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype,
        "bos_token_id": getattr(cfg, "bos_token_id", None), "eos_token_id": getattr(cfg, "eos_token_id", None),
        "block_configs": blocks,
        "harp": {"layers": list(plan.layers), "alphas": list(plan.alphas), "model_digest": plan.model_digest},
    }
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    (out / HF_CONFIG_MODULE).write_text(_CONFIG_SOURCE)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    log.info("wrote HF DeciLM checkpoint to %s", out)
    return {"written": True, "files": sorted(p.name for p in out.iterdir()), "ffn_mult": mult}
