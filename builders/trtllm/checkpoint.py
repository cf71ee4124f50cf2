"""Write a HARP-pruned model as a TensorRT-LLM checkpoint: ``config.json`` plus one
``rank{N}.safetensors`` per rank (``N = tp_rank + pp_rank * tp_size``), without importing
``tensorrt_llm``.

Layout facts follow TensorRT-LLM's own converters (``models/{nemotron_nas,qwen,gemma}/convert.py``):

* tensor names: ``transformer.vocab_embedding.weight``, ``transformer.layers.{i}.input_layernorm``,
  ``.attention.qkv`` (q, k, v rows concatenated *per rank*), ``.attention.dense``, ``.post_layernorm``,
  ``.mlp.fc`` (= HF gate_proj, the activated branch), ``.mlp.gate`` (= up_proj), ``.mlp.proj``,
  ``transformer.ln_f.weight``, ``lm_head.weight``; DeciLM uses ``.ffn.*`` for the MLP and
  ``.attention.weight`` for a linear attention; Gemma2 adds ``pre_/post_feedforward_layernorm``.
* ``i`` is the *local* layer index inside a pipeline stage; stage ``p`` owns
  ``torch.tensor_split(range(L), pp)[p]`` (the first ``L % pp`` stages get one extra layer).
* tensor parallel: q/fc/gate/lm_head/linear-attention are column-split (dim 0), dense/proj are
  row-split (dim 1); k/v heads are duplicated when ``tp > kv_heads`` (head g goes to ranks
  ``g*tp/kv ...``); lm_head is zero-padded to a multiple of ``tp`` rows; norms are replicated; the
  embedding is replicated except for Gemma, whose config forces a vocab-split embedding for tp > 1.
* all folds (alpha, V.O, Gemma's ``1 + w`` norm gains) are computed in fp32, then cast once.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harp_trt.dims import ModelDims
from harp_trt.errors import ConfigError, PreconditionError
from harp_trt.families import FamilySpec, family_of
from harp_trt.harp import ScaledNorm, harp_alphas
from harp_trt.plan import Plan

from .targets import ROUTE_LINEAR, TrtllmTarget, target_for

__all__ = ["DTYPES", "ModelDims", "write_checkpoint", "pp_layers", "valid_tp_sizes", "check_layout",
           "rank_of", "STAGE_NAME"]

log = logging.getLogger(__name__)
STAGE_NAME = "trtllm"
DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float32": torch.float32}


# ---- layout arithmetic ------------------------------------------------------------------------
def pp_layers(num_layers: int, pp_size: int, pp_rank: int) -> list[int]:
    """Global layer indices owned by pipeline stage ``pp_rank`` (TensorRT-LLM ``Mapping.pp_layers``)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return list(range(start, start + base + (1 if pp_rank < extra else 0)))


def rank_of(tp_rank: int, pp_rank: int, tp_size: int) -> int:
    return tp_rank + pp_rank * tp_size


def pad_to_multiple(n: int, k: int) -> int:
    return int(math.ceil(n / k) * k)




def _tp_problems(dims: ModelDims, target: TrtllmTarget, tp: int) -> list[str]:
    out = []
    if dims.heads % tp:
        out.append(f"{dims.heads} attention heads")
    if dims.kv_heads % tp and tp % dims.kv_heads:
        out.append(f"{dims.kv_heads} KV heads (need kv % tp == 0 or tp % kv == 0)")
    if dims.intermediate % tp:
        out.append(f"intermediate size {dims.intermediate}")
    if target.route == ROUTE_LINEAR and dims.hidden % tp:
        out.append(f"hidden size {dims.hidden} (linear attention is column-split)")
    if target.parallel_embedding and tp > 1 and dims.vocab % tp:
        out.append(f"vocab size {dims.vocab} (Gemma splits the embedding over tp)")
    return out


def valid_tp_sizes(dims: ModelDims, target: TrtllmTarget) -> list[int]:
    return [t for t in range(1, dims.heads + 1) if not _tp_problems(dims, target, t)]


def check_layout(dims: ModelDims, target: TrtllmTarget, dtype: str, tp_size: int, pp_size: int) -> None:
    """Raise ConfigError (what failed, what is valid) for a dtype / tp / pp this model cannot take."""
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported TensorRT-LLM dtype {dtype!r}; valid: {', '.join(DTYPES)}",
                          "fp16 -> float16, bf16 -> bfloat16, fp32 -> float32")
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ConfigError(f"pp_size must be a positive integer, got {pp_size!r}")
    problems = _tp_problems(dims, target, tp_size)
    if problems:
        valid = valid_tp_sizes(dims, target)
        raise ConfigError(
            f"tp_size={tp_size} does not divide the model's {'; '.join(problems)}; "
            f"valid tp_size values for this model: {', '.join(map(str, valid))}",
            "tensor parallelism splits attention heads (and KV heads, MLP columns) evenly over GPUs")
    if pp_size > dims.layers:
        raise ConfigError(
            f"pp_size={pp_size} exceeds the model's {dims.layers} decoder layers; "
            f"valid pp_size values: 1..{dims.layers}",
            "each pipeline stage needs at least one layer")


# ---- reading the HF (possibly HARP-patched) model ---------------------------------------------
def _norm_weight(norm) -> torch.Tensor:
    return (norm.norm if isinstance(norm, ScaledNorm) else norm).weight.detach()


def _rope_fields(config) -> tuple[float, dict | None]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    legacy = getattr(config, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    return theta, {"type": rope_type, **params}


def check_plan_matches(model, plan: Plan, family: FamilySpec) -> None:
    n = len(family.layers(model))
    if plan.family != family.name:
        raise PreconditionError(STAGE_NAME, f"plan is for family {plan.family!r} but the model is {family.name!r}",
                                "pass the model the plan was calibrated on")
    if plan.num_layers != n:
        raise PreconditionError(STAGE_NAME, f"plan has {plan.num_layers} layers but the model has {n}",
                                "pass the model the plan was calibrated on")
    applied = harp_alphas(model, family)
    if applied:
        want = plan.alpha_map
        stray = sorted(set(applied) - set(want))
        if stray:
            raise PreconditionError(STAGE_NAME, f"model layers {stray} are HARP-pruned but not in the plan "
                                    f"(plan prunes {sorted(want)})", "pass the unpruned model or the plan it was pruned with")
        bad = [i for i in applied if i in want and not math.isclose(applied[i], want[i], abs_tol=1e-7)
               and applied[i] != 0.0]
        if bad:
            raise PreconditionError(STAGE_NAME, f"model alphas {[applied[i] for i in bad]} on layers {bad} differ from "
                                    f"the plan's {[want[i] for i in bad]}", "pass the unpruned model")


def _layer_tensors(family: FamilySpec, layer, dims: ModelDims) -> dict[str, torch.Tensor | None]:
    """One HF decoder layer's weights (views, not copies: an 8B model is not duplicated in memory);
    q/k are None on a HARP-patched layer and v/o are None on an alpha=0 one."""
    attn = layer.self_attn

    def w(mod, attr="weight"):
        if mod is None:
            return None
        t = getattr(mod, attr, None)
        return None if t is None else t.detach()

    out = {
        "q": w(getattr(attn, "q_proj", None)), "k": w(getattr(attn, "k_proj", None)),
        "v": w(getattr(attn, "v_proj", None)), "o": w(getattr(attn, "o_proj", None)),
        "qb": w(getattr(attn, "q_proj", None), "bias"), "kb": w(getattr(attn, "k_proj", None), "bias"),
        "vb": w(getattr(attn, "v_proj", None), "bias"),
        "input_ln": _norm_weight(layer.input_layernorm),
        "post_attn_ln": _norm_weight(layer.post_attention_layernorm),
        "gate": w(layer.mlp.gate_proj), "up": w(layer.mlp.up_proj), "down": w(layer.mlp.down_proj),
    }
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
        if hasattr(layer, name):
            out[name] = _norm_weight(getattr(layer, name))
    if out["v"] is None:  # alpha = 0 on an already patched model: the block contributes nothing
        out["v"] = torch.zeros(dims.kv_heads * dims.head_dim, dims.hidden)
        out["o"] = torch.zeros(dims.hidden, dims.heads * dims.head_dim)
        if family.qkv_bias:
            out["vb"] = torch.zeros(dims.kv_heads * dims.head_dim)
    return out


def fold_vo(v: torch.Tensor, o: torch.Tensor, dims: ModelDims, alpha: float) -> torch.Tensor:
    """``alpha * W_O . repeat_kv(W_V)`` as one ``hidden x hidden`` matrix (HARP Eq. 4-5), in fp32.

    Query head h reads KV head ``h // n_rep``, so the o_proj columns of the n_rep heads sharing a KV
    head are summed first: ``W_O repeat(W_V) = (sum over the group of W_O[:, h]) W_V[g]``."""
    n_rep = dims.heads // dims.kv_heads
    o_fold = o.float().view(dims.hidden, dims.kv_heads, n_rep, dims.head_dim).sum(2)
    return alpha * (o_fold.reshape(dims.hidden, dims.kv_heads * dims.head_dim) @ v.float())


def _gain(offset: float, w: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale * (offset + w)`` computed in fp32 (Gemma stores ``1 + w``; HARP's alpha folds in);
    the untouched tensor itself when there is nothing to fold."""
    if offset == 0.0 and scale == 1.0:
        return w
    return scale * (offset + w.float())


# ---- logical (unsharded) tensors ---------------------------------------------------------------
# A logical tensor carries its TP rule: rep | col | row | qkv | qkv_bias | vocab_pad | vocab_split
@dataclass
class _Logical:
    rule: str
    tensor: Any  # torch.Tensor, or (q, k, v) for qkv rules


def _dup_kv(t: torch.Tensor, kv: int, tp: int, head_dim: int) -> torch.Tensor:
    """Repeat every KV head ``tp // kv`` times (TensorRT-LLM ``dup_kv_weight``)."""
    reps = tp // kv
    shape = t.shape
    t = t.reshape(kv, 1, head_dim, *shape[1:]).expand(kv, reps, head_dim, *shape[1:])
    return t.reshape(kv * reps * head_dim, *shape[1:])


def _shard(lt: _Logical, tp: int, tp_rank: int, dims: ModelDims, kv_heads: int) -> torch.Tensor:
    if lt.rule == "rep" or tp == 1 and lt.rule not in ("qkv", "qkv_bias"):
        return lt.tensor
    if lt.rule == "col" or lt.rule == "vocab_split":
        return lt.tensor.chunk(tp, 0)[tp_rank]
    if lt.rule == "row":
        return lt.tensor.chunk(tp, 1)[tp_rank]
    if lt.rule == "vocab_pad":
        t = lt.tensor
        padded = pad_to_multiple(t.shape[0], tp)
        if padded != t.shape[0]:
            t = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])
        return t.chunk(tp, 0)[tp_rank]
    if lt.rule in ("qkv", "qkv_bias"):
        q, k, v = lt.tensor
        if tp > kv_heads:
            k, v = _dup_kv(k, kv_heads, tp, dims.head_dim), _dup_kv(v, kv_heads, tp, dims.head_dim)
        return torch.cat([q.chunk(tp, 0)[tp_rank], k.chunk(tp, 0)[tp_rank], v.chunk(tp, 0)[tp_rank]])
    raise ValueError(f"unknown sharding rule {lt.rule!r}")


def _window_of(config, family: FamilySpec, layer: int) -> int | None:
    """The layer's native attention window (None: full causal attention)."""
    types = getattr(config, "layer_types", None)
    sw = getattr(config, "sliding_window", None)
    if types is not None:
        return sw if types[layer] == "sliding_attention" and sw else None
    return sw or None  # Mistral: one window for every layer when set


@dataclass
class CheckpointPlan:
    """What the writer decided per layer; also the manifest's per-layer table."""
    kinds: list[str]           # attention | linear | no_op | window1
    windows: list[int | None]  # per-layer attention window as written (None: full)
    native: list[int | None]   # the unpruned model's window per layer (for the cost baseline)
    alphas: dict[int, float]


def _layer_kinds(plan: Plan, target: TrtllmTarget, config, family, dims) -> CheckpointPlan:
    amap = plan.alpha_map
    kinds, windows = [], []
    native = [_window_of(config, family, i) for i in range(dims.layers)]
    for i in range(dims.layers):
        if i not in amap:
            kinds.append("attention")
            windows.append(_window_of(config, family, i))
        elif target.route == ROUTE_LINEAR:
            kinds.append("linear" if amap[i] != 0.0 else "no_op")
            windows.append(None)
        else:
            kinds.append("window1")
            windows.append(1)
    return CheckpointPlan(kinds, windows, native, amap)


def _logical_weights(model, family: FamilySpec, target: TrtllmTarget, cp: CheckpointPlan,
                     dims: ModelDims) -> dict[str, _Logical]:
    dec = family.decoder(model)
    off = target.norm_offset
    W: dict[str, _Logical] = {}
    W["transformer.vocab_embedding.weight"] = _Logical(
        "vocab_split" if target.parallel_embedding else "rep", dec.embed_tokens.weight.detach())
    W["transformer.ln_f.weight"] = _Logical("rep", _gain(off, _norm_weight(dec.norm)))
    W["lm_head.weight"] = _Logical("vocab_split" if target.parallel_embedding else "vocab_pad",
                                   model.lm_head.weight.detach())
    mlp = "ffn" if target.architecture == "DeciLMForCausalLM" else "mlp"
    for i, layer in enumerate(family.layers(model)):
        p = f"transformer.layers.{i}."
        t = _layer_tensors(family, layer, dims)
        kind, alpha = cp.kinds[i], cp.alphas.get(i, 1.0)
        if kind != "no_op":
            W[p + "input_layernorm.weight"] = _Logical("rep", _gain(off, t["input_ln"]))
        if kind == "linear":
            W[p + "attention.weight"] = _Logical("col", fold_vo(t["v"], t["o"], dims, alpha))
        elif kind in ("attention", "window1"):
            q, k = t["q"], t["k"]
            qb, kb = t["qb"], t["kb"]
            if kind == "window1":  # Q and K do not matter over a one-token window; zero them
                q = torch.zeros(dims.heads * dims.head_dim, dims.hidden)
                k = torch.zeros(dims.kv_heads * dims.head_dim, dims.hidden)
                qb = torch.zeros(dims.heads * dims.head_dim) if target.qkv_bias else None
                kb = torch.zeros(dims.kv_heads * dims.head_dim) if target.qkv_bias else None
            W[p + "attention.qkv.weight"] = _Logical("qkv", (q, k, t["v"]))
            if target.qkv_bias:
                W[p + "attention.qkv.bias"] = _Logical("qkv_bias", (qb, kb, t["vb"]))
            dense_alpha = alpha if kind == "window1" and not target.alpha_in_post_norm else 1.0
            W[p + "attention.dense.weight"] = _Logical("row", _gain(0.0, t["o"], dense_alpha))
        post_scale = alpha if kind == "window1" and target.alpha_in_post_norm else 1.0
        if target.inter_layernorms:
            # Gemma2: post_layernorm is the post-attention norm; alpha scales its gain (HARP, Gemma2)
            W[p + "post_layernorm.weight"] = _Logical("rep", _gain(off, t["post_attn_ln"], post_scale))
            W[p + "pre_feedforward_layernorm.weight"] = _Logical("rep", _gain(off, t["pre_feedforward_layernorm"]))
            W[p + "post_feedforward_layernorm.weight"] = _Logical("rep", _gain(off, t["post_feedforward_layernorm"]))
        else:
            W[p + "post_layernorm.weight"] = _Logical("rep", _gain(off, t["post_attn_ln"]))
        W[p + f"{mlp}.fc.weight"] = _Logical("col", t["gate"])
        W[p + f"{mlp}.gate.weight"] = _Logical("col", t["up"])
        W[p + f"{mlp}.proj.weight"] = _Logical("row", t["down"])
    return W


# ---- config.json ------------------------------------------------------------------------------
def _trtllm_config(config, family: FamilySpec, target: TrtllmTarget, cp: CheckpointPlan, dims: ModelDims,
                   dtype: str, tp: int, pp: int, max_seq_len: int) -> dict[str, Any]:
    theta, scaling = _rope_fields(config)
    act = getattr(config, "hidden_activation", None) or config.hidden_act
    cfg: dict[str, Any] = {
        "architecture": target.architecture, "dtype": dtype, "logits_dtype": "float32",
        "vocab_size": dims.vocab, "hidden_size": dims.hidden, "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
        "head_size": dims.head_dim, "intermediate_size": dims.intermediate, "hidden_act": act,
        "norm_epsilon": float(config.rms_norm_eps), "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": int(config.max_position_embeddings),
        "rotary_base": theta, "rotary_scaling": scaling,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "use_parallel_embedding": bool(target.parallel_embedding and tp > 1),
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        **target.extra_config,
    }
    if target.share_embedding:
        cfg["share_embedding_table"] = True
    if target.architecture == "DeciLMForCausalLM":
        cfg["layer_configs"] = [
            {"attention": {"impl": k, "num_key_value_heads": dims.kv_heads if k == "attention" else None},
             "ffn": {"impl": "mlp", "intermediate_size": dims.intermediate}} for k in cp.kinds]
    if target.inter_layernorms:  # Gemma2 config group
        cfg["query_pre_attn_scalar"] = config.query_pre_attn_scalar
        cfg["attn_logit_softcapping"] = getattr(config, "attn_logit_softcapping", None)
        cfg["final_logit_softcapping"] = getattr(config, "final_logit_softcapping", None)
    windows = _runtime_windows(cp, target, max_seq_len)
    if windows is not None:
        # Engine default for KvCacheConfig.max_attention_window (one entry per layer, cyclic)
        cfg["runtime_defaults"] = {"max_attention_window": windows, "sink_token_length": 0}
    return cfg


def _runtime_windows(cp: CheckpointPlan, target: TrtllmTarget, max_seq_len: int) -> list[int] | None:
    if target.route == ROUTE_LINEAR:
        # DeciLM layers share one window; only a sliding-window Mistral needs one (cyclic list of 1)
        ws = {w for k, w in zip(cp.kinds, cp.windows) if k == "attention" and w}
        return [min(ws.pop(), max_seq_len)] if len(ws) == 1 and min(ws) < max_seq_len else None
    per_layer = [min(w, max_seq_len) if w else max_seq_len for w in cp.windows]
    return per_layer if any(w < max_seq_len for w in per_layer) else None


# ---- the writer -------------------------------------------------------------------------------
def write_checkpoint(model, plan: Plan, out_dir: str | Path, *, dtype: str = "float16", tp_size: int = 1,
                     pp_size: int = 1, max_seq_len: int | None = None,
                     tokens_per_block: int = 32) -> dict[str, Any]:
    """Write ``config.json`` and every ``rank{N}.safetensors`` of the HARP-pruned model into
    ``out_dir`` (created). ``model`` is the Hugging Face model, unpruned or already patched by
    ``apply_harp`` with the same plan; it is not modified. Returns a summary (per-layer table, KV
    and GEMM costs) for the manifest."""
    from safetensors.torch import save_file

    family = family_of(model.config)
    target = target_for(family.name)
    dims = ModelDims.of(model.config)
    check_layout(dims, target, dtype, tp_size, pp_size)
    check_plan_matches(model, plan, family)
    if target.share_embedding and not getattr(model.config, "tie_word_embeddings", True):
        raise PreconditionError(STAGE_NAME, f"{target.architecture} in TensorRT-LLM always ties lm_head to the "
                                "embedding, but this model has a separate lm_head",
                                "only tied-embedding Gemma2 checkpoints (all released ones) can be exported")
    max_seq_len = int(max_seq_len or model.config.max_position_embeddings)
    cp = _layer_kinds(plan, target, model.config, family, dims)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _trtllm_config(model.config, family, target, cp, dims, dtype, tp_size, pp_size, max_seq_len)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    with torch.no_grad():
        logical = _logical_weights(model, family, target, cp, dims)
    torch_dtype = DTYPES[dtype]
    files = []
    for pp_rank in range(pp_size):
        local = pp_layers(dims.layers, pp_size, pp_rank)
        rename = {f"transformer.layers.{g}.": f"transformer.layers.{j}." for j, g in enumerate(local)}
        for tp_rank in range(tp_size):
            tensors = {}
            for name, lt in logical.items():
                if name.startswith("transformer.layers."):
                    prefix = ".".join(name.split(".")[:3]) + "."
                    if prefix not in rename:
                        continue
                    key = rename[prefix] + name[len(prefix):]
                elif name == "transformer.vocab_embedding.weight":
                    if pp_rank != 0:
                        continue
                    key = name
                else:  # ln_f, lm_head
                    if pp_rank != pp_size - 1:
                        continue
                    key = name
                # copy=True: a tied lm_head must not share storage with the embedding in the file
                tensors[key] = _shard(lt, tp_size, tp_rank, dims, dims.kv_heads).to(torch_dtype, copy=True).contiguous()
            fname = f"rank{rank_of(tp_rank, pp_rank, tp_size)}.safetensors"
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            files.append(fname)
    log.info("wrote %s checkpoint (%s, tp=%d, pp=%d) to %s", target.architecture, dtype, tp_size, pp_size, out)
    return {"architecture": target.architecture, "route": target.route, "files": sorted(files),
            "layers": _layer_table(cp, dims, plan), **_costs(cp, dims, target, dtype, max_seq_len, tokens_per_block)}


def _layer_table(cp: CheckpointPlan, dims: ModelDims, plan: Plan) -> list[dict[str, Any]]:
    return [{"layer": i, "kind": k, "alpha": cp.alphas.get(i),
             "kv_heads": 0 if k in ("linear", "no_op") else dims.kv_heads, "window": w}
            for i, (k, w) in enumerate(zip(cp.kinds, cp.windows))]


def _costs(cp: CheckpointPlan, dims: ModelDims, target: TrtllmTarget, dtype: str, max_seq_len: int,
           tokens_per_block: int) -> dict[str, Any]:
    """KV bytes one sequence of ``max_seq_len`` tokens holds (all ranks together; paged blocks of
    ``tokens_per_block``), and linear-layer multiply-accumulates per token, pruned vs unpruned."""
    esize = torch.finfo(DTYPES[dtype]).bits // 8
    per_token_layer = 2 * dims.kv_heads * dims.head_dim * esize
    d, hd = dims.hidden, dims.head_dim
    attn_gemm = d * (dims.heads + 2 * dims.kv_heads) * hd + dims.heads * hd * d
    mlp_gemm = 3 * d * dims.intermediate
    kv, kv_base, macs = 0, 0, 0
    for k, w, nw in zip(cp.kinds, cp.windows, cp.native):
        kv_base += pad_to_multiple(min(nw or max_seq_len, max_seq_len), tokens_per_block) * per_token_layer
        if k in ("attention", "window1"):
            kv += pad_to_multiple(min(w or max_seq_len, max_seq_len), tokens_per_block) * per_token_layer
            macs += attn_gemm
        elif k == "linear":
            macs += d * d
        macs += mlp_gemm
    base_macs = dims.layers * (attn_gemm + mlp_gemm)
    return {"kv_bytes_per_sequence": kv, "kv_bytes_per_sequence_unpruned": kv_base,
            "gemm_macs_per_token": macs, "gemm_macs_per_token_unpruned": base_macs,
            "kv_cost_note": (f"at max_seq_len={max_seq_len}, tokens_per_block={tokens_per_block}; "
                             "window-1 layers keep one block per sequence")}
