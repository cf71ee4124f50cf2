"""Write a HARP-pruned model as a TensorRT-LLM checkpoint: ``config.json`` plus one
``rank{N}.safetensors`` per rank (``N = tp_rank + pp_rank * tp_size``), without importing
``tensorrt_llm`` and without loading the model: tensors are read one at a time from the Hugging
Face safetensors files, folded, cast and sharded, and written into their rank files layer by layer
(``harp_trt.weights``). A dry run over shape-only (meta) tensors plans every file first.

Layout facts follow TensorRT-LLM 1.2's own converters (``models/{nemotron_nas,qwen,gemma}/convert.py``;
every requirement with its source is a row of ``docs/trtllm-contract.md``):

* tensor names: ``transformer.vocab_embedding.weight``, ``transformer.layers.{i}.input_layernorm``,
  ``.attention.qkv`` (q, k, v rows concatenated *per rank*), ``.attention.dense``, ``.post_layernorm``,
  ``.mlp.fc`` (= HF gate_proj, the activated branch), ``.mlp.gate`` (= up_proj), ``.mlp.proj``,
  ``transformer.ln_f.weight``, ``lm_head.weight``; DeciLM uses ``.ffn.*`` for the MLP and
  ``.attention.weight`` for a linear attention; Gemma2 adds ``pre_/post_feedforward_layernorm``.
* ``i`` is the *local* layer index inside a pipeline stage; which stage owns which layers, and which
  rank file holds which shard, is ``harp_trt.mapping.ParallelMapping`` (shared with the reader).
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
from typing import Any, Iterator

import torch

from harp_trt.dims import ModelDims
from harp_trt.errors import ConfigError, PreconditionError
from harp_trt.families import FamilySpec, family_of
from harp_trt.kvcache import kv_cache_bytes
from harp_trt.mapping import ParallelMapping
from harp_trt.fold import RoleReader as _Source
from harp_trt.fold import fold_vo
from harp_trt.plan import Plan
from harp_trt.weights import SafetensorsWriter, TensorSpec, WeightReader, hf_config

from .config import CLI, STAGE
from .config_json import trtllm_config
from .targets import ROUTE_LINEAR, TrtllmTarget, target_for

__all__ = ["DTYPES", "write_checkpoint", "valid_tp_sizes", "check_layout",
           "STAGE_NAME", "fold_vo", "LayerKinds", "layer_kinds", "hf_config"]

log = logging.getLogger(__name__)
STAGE_NAME = STAGE.name
DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16,
                                  "float32": torch.float32}


# ---- layout arithmetic ------------------------------------------------------------------------
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
    if target.qk_layernorm and dims.heads // tp == -(-dims.kv_heads // tp) > 1:
        # layers/attention.py Attention.forward: with as many query as KV heads per rank, the QK-norm
        # branch views qkv as [heads, 3, head_size] (q, k, v interleaved per head), not the [Q | K | V]
        # rows every converter writes (the same thing for one head); docs/trtllm-contract.md row qk-norm-mha
        out.append(f"{dims.heads} heads over {dims.kv_heads} KV heads (a QK-norm layer needs more query than "
                   "KV heads per rank, or one of each)")
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
    if pp_size > dims.num_layers:
        raise ConfigError(
            f"pp_size={pp_size} exceeds the model's {dims.num_layers} decoder layers; "
            f"valid pp_size values: 1..{dims.num_layers}",
            "each pipeline stage needs at least one layer")


def check_pipeline(kinds: "LayerKinds", target: TrtllmTarget, pp_size: int) -> None:
    """Pipeline layouts the 1.2 runtime cannot run (``docs/trtllm-contract.md``, rows pp-*).

    * every stage needs an attention layer: ``BaseKVCacheManager::calculateMaxNumBlocks``
      (``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``) stops with "Asymmetrical pipeline
      parallelism detected" when ranks see different sets of window sizes, and a stage without
      attention sees none;
    * per-layer windows with pp > 1: the KV cache manager (``groupLayersByWindowSize``) reads the
      window list by *local* layer index, the attention plugin (``TransformerBuffers``) by *global*
      index; unless every stage's slice equals the list's prefix, layers get the wrong window."""
    if pp_size == 1:
        return
    n, mapping = len(kinds.kinds), ParallelMapping(pp_size=pp_size)
    for p in range(pp_size):
        local = mapping.pp_layers(n, p)
        if not any(kinds.kinds[g] in ("attention", "window1") for g in local):
            raise ConfigError(
                f"pp_size={pp_size}: pipeline stage {p} (layers {local[0]}-{local[-1]}) has no attention layer left "
                "after pruning; TensorRT-LLM 1.2 refuses it (\"Asymmetrical pipeline parallelism detected\")",
                "use a pp_size whose stages each keep an attention layer, or pp_size=1")
    windows = kinds.window_list()
    if windows is not None and len(set(windows)) > 1:
        for p in range(1, pp_size):
            local = mapping.pp_layers(n, p)
            first_attn = sum(1 for g in range(local[0]) if kinds.kinds[g] != "linear" and kinds.kinds[g] != "no_op")
            mine = [windows[(first_attn + j) % len(windows)] for j in range(len(local))]
            theirs = [windows[j % len(windows)] for j in range(len(local))]
            if mine != theirs:
                raise ConfigError(
                    f"pp_size={pp_size} with per-layer attention windows ({target.route} route): TensorRT-LLM 1.2's KV "
                    f"cache manager would give stage {p}'s layers the windows of the first stage's layers",
                    "build this checkpoint with pp_size=1 (tensor parallelism is unaffected)")


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


def _shard(lt: _Logical, tp: int, tp_rank: int, dims: ModelDims) -> torch.Tensor:
    if lt.rule == "rep" or tp == 1 and lt.rule not in ("qkv", "qkv_bias"):
        return lt.tensor
    if lt.rule == "col" or lt.rule == "vocab_split":
        return lt.tensor.chunk(tp, 0)[tp_rank]
    if lt.rule == "row":
        return lt.tensor.chunk(tp, 1)[tp_rank]
    if lt.rule == "vocab_pad":
        t = lt.tensor
        padded = pad_to_multiple(t.shape[0], tp)
        rows = padded // tp
        part = t[tp_rank * rows: (tp_rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's zero padding
            part = torch.cat([part, part.new_zeros(rows - part.shape[0], *t.shape[1:])])
        return part
    if lt.rule in ("qkv", "qkv_bias"):
        q, k, v = lt.tensor
        if tp > dims.kv_heads:
            k, v = _dup_kv(k, dims.kv_heads, tp, dims.head_dim), _dup_kv(v, dims.kv_heads, tp, dims.head_dim)
        return torch.cat([q.chunk(tp, 0)[tp_rank], k.chunk(tp, 0)[tp_rank], v.chunk(tp, 0)[tp_rank]])
    raise ValueError(f"unknown sharding rule {lt.rule!r}")


@dataclass
class LayerKinds:
    """What the writer decided per layer; also the manifest's per-layer table."""
    kinds: list[str]           # attention | linear | no_op | window1
    windows: list[int | None]  # per-layer attention window as written (None: full)
    native: list[int | None]   # the unpruned model's window per layer (for the cost baseline)
    alphas: dict[int, float]
    route: str
    max_seq_len: int

    def window_list(self) -> list[int] | None:
        """``max_attention_window`` for the runtime: one entry per *attention* layer (TensorRT-LLM
        indexes the list by attention-layer ordinal, cyclically), None when one window fits all."""
        attn = [min(w or self.max_seq_len, self.max_seq_len) for k, w in zip(self.kinds, self.windows)
                if k in ("attention", "window1")]
        if not attn or all(w == self.max_seq_len for w in attn):
            return None
        if len(set(attn)) == 1:
            return [attn[0]]
        return attn


def layer_kinds(plan: Plan, target: TrtllmTarget, dims: ModelDims, max_seq_len: int) -> LayerKinds:
    amap = plan.alpha_map
    kinds, windows = [], []
    for i in range(dims.num_layers):
        if i not in amap:
            kinds.append("attention")
            windows.append(dims.window(i))
        elif target.route == ROUTE_LINEAR:
            kinds.append("linear" if amap[i] != 0.0 else "no_op")
            windows.append(None)
        else:
            kinds.append("window1")
            windows.append(1)
    return LayerKinds(kinds, windows, list(dims.windows), amap, target.route, max_seq_len)


def _global_tensors(src: _Source, target: TrtllmTarget) -> Iterator[tuple[str, int, _Logical]]:
    """(name, owning pp stage: 0 first / -1 last, tensor), read one at a time (embedding tables
    are the largest tensors of a model; a tied head is read again rather than held)."""
    off = src.family.norm_weight_offset  # TensorRT-LLM stores the folded gain
    split = "vocab_split" if target.parallel_embedding else None
    yield "transformer.vocab_embedding.weight", 0, _Logical(split or "rep", src.get("embed"))
    yield "transformer.ln_f.weight", -1, _Logical("rep", _gain(off, src.get("final_norm")))
    yield "lm_head.weight", -1, _Logical(split or "vocab_pad", src.get("lm_head"))


def _layer_tensors(src: _Source, target: TrtllmTarget, lk: LayerKinds, dims: ModelDims, i: int) -> dict[str, _Logical]:
    """The logical tensors of decoder layer ``i`` (global names), read from ``src`` on demand."""
    fam = src.family
    off = fam.norm_weight_offset  # TensorRT-LLM stores the folded gain
    p = f"transformer.layers.{i}."
    kind, alpha = lk.kinds[i], lk.alphas.get(i, 1.0)
    W: dict[str, _Logical] = {}
    mlp = target.mlp_prefix
    if kind != "no_op":
        W[p + "input_layernorm.weight"] = _Logical("rep", _gain(off, src.get("input_ln", i)))
    if kind == "linear":
        W[p + "attention.weight"] = _Logical("col", fold_vo(src.get("v", i), src.get("o", i), dims, alpha))
    elif kind in ("attention", "window1"):
        q_rows, kv_rows = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
        if kind == "window1":  # Q and K do not matter over a one-token window; zero them
            q, k = src.zeros(q_rows, dims.hidden), src.zeros(kv_rows, dims.hidden)
            qb, kb = src.zeros(q_rows), src.zeros(kv_rows)
        else:
            q, k = src.get("q", i), src.get("k", i)
            qb = src.get("qb", i) if fam.qkv_bias else None
            kb = src.get("kb", i) if fam.qkv_bias else None
        v = src.get("v", i)
        W[p + "attention.qkv.weight"] = _Logical("qkv", (q, k.to(q.dtype), v.to(q.dtype)))
        if fam.qkv_bias:
            vb = src.get("vb", i) if src.has("vb", i) else src.zeros(kv_rows)
            W[p + "attention.qkv.bias"] = _Logical("qkv_bias", (qb.to(vb.dtype), kb.to(vb.dtype), vb))
        dense_alpha = alpha if kind == "window1" and not fam.alpha_after_post_attn_norm else 1.0
        W[p + "attention.dense.weight"] = _Logical("row", _gain(0.0, src.get("o", i), dense_alpha))
    # post_layernorm is HF's post_attention_layernorm; with inter_layernorms (Gemma2) it is the
    # post-attention norm and alpha scales its gain (HARP, Gemma2)
    post_scale = alpha if kind == "window1" and fam.alpha_after_post_attn_norm else 1.0
    W[p + "post_layernorm.weight"] = _Logical("rep", _gain(off, src.get("post_attn_ln", i), post_scale))
    if target.inter_layernorms:  # Gemma2's pre/post feed-forward norms keep their HF names
        for n in fam.extra_layer_norms:
            W[p + f"{n}.weight"] = _Logical("rep", _gain(off, src.get(n, i)))
    if target.qk_layernorm and kind in ("attention", "window1"):
        # Attention(qk_layernorm=True): one [head_size] gain per layer, shared by every head and replicated
        # over tp (layers/attention.py Attention.__init__, layernorm_share); Gemma's stored as 1 + w
        for n in ("q", "k"):
            W[p + f"attention.{n}_layernorm.weight"] = _Logical("rep", _gain(off, src.get(f"{n}_norm", i)))
    W[p + f"{mlp}.fc.weight"] = _Logical("col", src.get("gate", i))
    W[p + f"{mlp}.gate.weight"] = _Logical("col", src.get("up", i))
    W[p + f"{mlp}.proj.weight"] = _Logical("row", src.get("down", i))
    return W


def _rank_tensors(src: _Source, target: TrtllmTarget, lk: LayerKinds, dims: ModelDims, dtype: torch.dtype,
                  tp: int, pp: int) -> Iterator[tuple[int, str, torch.Tensor]]:
    """(rank, name, tensor) for every tensor of every rank file, one layer resident at a time."""
    mapping = ParallelMapping(tp, pp)
    for name, stage, lt in _global_tensors(src, target):
        for t in range(tp):
            yield mapping.rank(t, stage % pp), name, _shard(lt, tp, t, dims).to(dtype)
        del lt
    for p in range(pp):
        for j, g in enumerate(mapping.pp_layers(dims.num_layers, p)):
            tensors = _layer_tensors(src, target, lk, dims, g)
            for name, lt in tensors.items():
                local = f"transformer.layers.{j}." + name.split(".", 3)[3]
                for t in range(tp):
                    yield mapping.rank(t, p), local, _shard(lt, tp, t, dims).to(dtype)
            del tensors


# ---- the writer -------------------------------------------------------------------------------
def check_plan_family(plan: Plan, family: FamilySpec, num_layers: int) -> None:
    """The plan's family and depth are the model's (its weights digest is checked by the stage,
    ``harp_trt.onnx_io.check_plan_weights``)."""
    plan.check_model(family.name, num_layers, STAGE_NAME)
    plan.refuse_fitted(STAGE_NAME, CLI.refuses_fitted)


def write_checkpoint(model_folder: str | Path, plan: Plan, out_dir: str | Path, *, dtype: str = "float16",
                     tp_size: int = 1, pp_size: int = 1, max_seq_len: int | None = None,
                     tokens_per_block: int = 32) -> dict[str, Any]:
    """Write ``config.json`` and every ``rank{N}.safetensors`` of the HARP-pruned model in
    ``model_folder`` (a Hugging Face folder, never loaded whole) into ``out_dir`` (created).
    Returns a summary (per-layer table, KV and GEMM costs) for the manifest."""
    from harp_trt.memory import tune_allocator

    tune_allocator()
    config = hf_config(model_folder)
    family = family_of(config)
    target = target_for(family.name)
    dims = ModelDims.from_config(config)
    check_layout(dims, target, dtype, tp_size, pp_size)
    check_plan_family(plan, family, dims.num_layers)
    reader = WeightReader(model_folder)
    fitted = plan.fitted_tensors()  # calibrate --replacement rrr: the fitted V/O of those layers
    if target.share_embedding and family.weight_name("lm_head") in reader:
        raise PreconditionError(STAGE_NAME, f"{target.architecture} in TensorRT-LLM always ties lm_head to the "
                                "embedding, but this model has a separate lm_head",
                                "only tied-embedding Gemma2 checkpoints (all released ones) can be exported")
    max_seq_len = int(max_seq_len or config.max_position_embeddings)
    lk = layer_kinds(plan, target, dims, max_seq_len)
    check_pipeline(lk, target, pp_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = trtllm_config(config, target, lk, dims, dtype, tp_size, pp_size)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    torch_dtype = DTYPES[dtype]
    world = ParallelMapping(tp_size, pp_size).world_size
    plans: list[list[TensorSpec]] = [[] for _ in range(world)]
    with torch.no_grad():
        for r, name, t in _rank_tensors(_Source(reader, family, meta=True, overlay=fitted), target, lk, dims, torch_dtype,
                                        tp_size, pp_size):
            plans[r].append(TensorSpec(name, t.dtype, tuple(t.shape)))
        files = [f"rank{r}.safetensors" for r in range(world)]
        writers = [SafetensorsWriter(out / f, plans[r]) for r, f in enumerate(files)]
        try:
            for r, name, t in _rank_tensors(_Source(reader, family, meta=False, overlay=fitted), target, lk, dims, torch_dtype,
                                            tp_size, pp_size):
                writers[r].write(name, t)
        finally:
            for w in writers:
                w.close()
    log.info("wrote %s checkpoint (%s, tp=%d, pp=%d) to %s", target.architecture, dtype, tp_size, pp_size, out)
    return {"architecture": target.architecture, "route": target.route, "files": sorted(files),
            "layers": _layer_table(lk, dims), "window_list": lk.window_list(),
            **kv_costs(lk, dims, dtype, tokens_per_block)}


def _layer_table(lk: LayerKinds, dims: ModelDims) -> list[dict[str, Any]]:
    return [{"layer": i, "kind": k, "alpha": lk.alphas.get(i),
             "kv_heads": 0 if k in ("linear", "no_op") else dims.kv_heads, "window": w}
            for i, (k, w) in enumerate(zip(lk.kinds, lk.windows))]


def kv_costs(lk: LayerKinds, dims: ModelDims, dtype: str, tokens_per_block: int) -> dict[str, Any]:
    """KV-cache cost as TensorRT-LLM 1.2 allocates it, and GEMM work per token.

    ``kv_bytes_per_token``: bytes one more token of context costs in the pool that bounds capacity
    (layers holding the whole sequence). DeciLM ``linear`` / ``no_op`` layers have no KV heads, so
    the engine allocates nothing for them (``num_kv_heads_per_layer`` lists attention layers only).
    Window-1 layers (Qwen2, Gemma2 route) sit in a pool of their own whose blocks are freed as
    generation goes, but hold the whole prompt while it is prefilled
    (``KVCacheManager::addSequence``; ``WindowBlockManager::adjustBlocksIfNeeded``); their pool size
    is set by the window-size shares written into every launch file (``launch.window_size_shares``)."""
    esize = torch.finfo(DTYPES[dtype]).bits // 8
    per_layer = kv_cache_bytes(dims.kv_heads, dims.head_dim, esize)
    full = sum(1 for k, w in zip(lk.kinds, lk.windows) if k == "attention" and (w is None or w >= lk.max_seq_len))
    windowed = {i: w for i, (k, w) in enumerate(zip(lk.kinds, lk.windows))
                if k in ("attention", "window1") and w is not None and w < lk.max_seq_len}
    native_full = sum(1 for w in lk.native if w is None or w >= lk.max_seq_len)
    d, hd = dims.hidden, dims.head_dim
    attn_gemm = d * (dims.heads + 2 * dims.kv_heads) * hd + dims.heads * hd * d
    mlp_gemm = 3 * d * dims.intermediate
    macs = 0
    for k in lk.kinds:
        macs += mlp_gemm + (attn_gemm if k in ("attention", "window1") else d * d if k == "linear" else 0)
    return {
        "kv_bytes_per_token": full * per_layer,
        "kv_bytes_per_token_unpruned": native_full * per_layer,
        "kv_layers_full": full, "kv_layers_windowed": {str(i): w for i, w in windowed.items()},
        "kv_bytes_per_sequence": full * per_layer * lk.max_seq_len + sum(
            pad_to_multiple(w + tokens_per_block, tokens_per_block) * per_layer for w in windowed.values()),
        "kv_bytes_per_sequence_unpruned": sum(
            pad_to_multiple(min(w or lk.max_seq_len, lk.max_seq_len), tokens_per_block) * per_layer for w in lk.native),
        "gemm_macs_per_token": macs, "gemm_macs_per_token_unpruned": dims.num_layers * (attn_gemm + mlp_gemm),
        "kv_cost_note": (f"max_seq_len={lk.max_seq_len}, tokens_per_block={tokens_per_block}; a windowed layer keeps "
                         "window + one block per sequence after its prompt is prefilled"),
    }
