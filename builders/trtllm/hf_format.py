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
class of its own (``configuration_decilm.py``, ``auto_map``). TensorRT-LLM's PyTorch backend reads the
config through ``transformers.AutoConfig`` (``_torch/pyexecutor/config_utils.py``
``load_pretrained_config``), so ``trtllm-serve`` needs ``--trust_remote_code`` for this folder; the code
it runs is that one config class, written here. Only Llama-style families fit (NemotronNAS attention
and its linear replacement are bias-free, ``_torch/models/modeling_nemotron_nas.py``)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from harp_trt.dims import ModelDims
from harp_trt.families import FAMILIES, family_of
from harp_trt.plan import Plan

from .checkpoint import DTYPES, fold_vo
from .config_json import rope_fields
from .targets import target_for

__all__ = ["write_hf_decilm", "ffn_mult_for", "intermediate_from_ffn_mult", "HF_CONFIG_MODULE", "decilm_name"]

log = logging.getLogger(__name__)

# An HF DeciLM folder names its tensors as a Llama checkpoint does, plus one tensor for a linear
# attention: TensorRT-LLM reads exactly these (tensorrt_llm/models/nemotron_nas/convert.py,
# load_model_weights). The writer here takes the names from this; reader.read_hf_decilm has its own
# (trtllm_models.HF_DECILM_NAMES, from the same converter), so each checks the other.
_DECILM_LAYOUT = FAMILIES.get("llama")()
_DECILM_ROLES = {"linear_attn": "self_attn.linear_attn.weight"}


def decilm_name(role: str, layer: int | None = None) -> str:
    """Tensor name of ``role`` (a ``FamilySpec`` role, or ``"linear_attn"``) in an HF DeciLM folder."""
    if role in _DECILM_ROLES:
        return _DECILM_LAYOUT.layer_prefix.format(i=layer) + _DECILM_ROLES[role]
    return _DECILM_LAYOUT.weight_name(role, layer)

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


def _hf_tensors(src, dims: ModelDims, amap: dict[int, float], dtype: torch.dtype):
    """(name, tensor) of the DeciLM folder in file order, one layer resident at a time."""
    for role in ("embed", "final_norm", "lm_head"):
        # lm_head is always written, tied or not: TensorRT-LLM's DeciLM converter reads lm_head.weight
        # unconditionally (tensorrt_llm/models/nemotron_nas/convert.py, load_weights_from_hf)
        yield decilm_name(role), src.get(role).to(dtype)
    for i in range(dims.num_layers):
        alpha = amap.get(i)
        if alpha is None or alpha != 0.0:
            yield decilm_name("input_ln", i), src.get("input_ln", i).to(dtype)
        if alpha is not None and alpha != 0.0:
            yield decilm_name("linear_attn", i), fold_vo(src.get("v", i), src.get("o", i), dims, alpha).to(dtype)
        elif alpha is None:
            for n in "qkvo":
                yield decilm_name(n, i), src.get(n, i).to(dtype)
        yield decilm_name("post_attn_ln", i), src.get("post_attn_ln", i).to(dtype)
        for n in ("gate", "up", "down"):
            yield decilm_name(n, i), src.get(n, i).to(dtype)


def _block_configs(dims: ModelDims, amap: dict[int, float], mult: float) -> list[dict[str, Any]]:
    """One DeciLM block config per layer: GQA attention when kept, ``replace_with_linear`` when
    pruned, ``no_op`` at alpha = 0; every MLP kept at width ``ffn_mult``."""
    blocks = []
    for i in range(dims.num_layers):
        alpha = amap.get(i)
        attn = {"n_heads_in_group": dims.heads // dims.kv_heads if alpha is None else None,
                "no_op": alpha == 0.0, "replace_with_linear": alpha is not None and alpha != 0.0, "sparsify": None}
        blocks.append({"attention": attn, "ffn": {"ffn_mult": mult, "no_op": False, "replace_with_linear": False,
                                                  "sparsify": None}})
    return blocks


def write_hf_decilm(model_folder: str | Path, plan: Plan, out_dir: str | Path, *, dtype: str = "float16",
                    shard_bytes: int = 5 << 30) -> dict[str, Any]:
    """Write the HF DeciLM checkpoint of the model in ``model_folder`` into ``out_dir``, streaming
    tensors (shards of at most ``shard_bytes`` with ``model.safetensors.index.json`` when larger).
    Returns ``{"written": bool, ...}``; when the family or the MLP width cannot be expressed,
    nothing is written and ``reason`` says why."""
    from harp_trt.weights import SafetensorsWriter, TensorSpec, WeightReader

    from .checkpoint import _Source, check_plan_family, hf_config

    cfg = hf_config(model_folder)
    family = family_of(cfg)
    target = target_for(family.name)
    if not target.hf_heterogeneous:
        return {"written": False, "reason": (
            f"{family.name} has features DeciLM lacks: TensorRT-LLM's PyTorch backend has no heterogeneous model with "
            "attention biases or Gemma2's norms (NemotronNAS is bias-free, _torch/models/modeling_nemotron_nas.py) and "
            "runs mixed window lists for Gemma3 only; use the engine checkpoint")}
    dims = ModelDims.from_config(cfg)
    mult = ffn_mult_for(dims.intermediate, dims.hidden)
    if mult is None:
        return {"written": False, "reason": f"intermediate_size {dims.intermediate} is not expressible as a "
                "DeciLM ffn_mult (needs a multiple of 256)"}
    check_plan_family(plan, family, dims.num_layers)
    amap = plan.alpha_map
    theta, scaling = rope_fields(cfg)
    reader = WeightReader(model_folder)
    fitted = plan.fitted_tensors()  # calibrate --replacement rrr: the fitted V/O of those layers
    tdt = DTYPES[dtype]
    blocks = _block_configs(dims, amap, mult)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        specs = [TensorSpec(n, t.dtype, tuple(t.shape))
                 for n, t in _hf_tensors(_Source(reader, family, meta=True, overlay=fitted), dims, amap, tdt)]
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        names = (["model.safetensors"] if len(shards) == 1 else
                 [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
        where = {spec.name: k for k, shard in enumerate(shards) for spec in shard}
        writers = [SafetensorsWriter(out / n, shard) for n, shard in zip(names, shards)]
        try:
            for name, t in _hf_tensors(_Source(reader, family, meta=False, overlay=fitted), dims, amap, tdt):
                writers[where[name]].write(name, t)
        finally:
            for w in writers:
                w.close()
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": sum(s.nbytes for s in specs)},
             "weight_map": {n: names[k] for n, k in sorted(where.items())}}, indent=2))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    hf_cfg = {
        "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
        "auto_map": {"AutoConfig": "configuration_decilm.DeciLMConfig"},
        "hidden_size": dims.hidden, "num_attention_heads": dims.heads, "num_hidden_layers": dims.num_layers,
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
    log.info("wrote HF DeciLM checkpoint to %s (%d file(s))", out, len(names))
    return {"written": True, "files": sorted(p.name for p in out.iterdir()), "ffn_mult": mult,
            "kv_heads_per_layer": [0 if b["attention"]["n_heads_in_group"] is None else dims.kv_heads for b in blocks]}
