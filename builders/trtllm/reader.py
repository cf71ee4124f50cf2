"""A pure-PyTorch reader for TensorRT-LLM checkpoints: loads ``config.json`` and every
``rank{N}.safetensors`` and runs the forward pass TensorRT-LLM 1.2 builds from them, so a written
checkpoint can be checked against the PyTorch HARP reference on a machine without TensorRT-LLM or a GPU.

The reader is an oracle independent of the writer: what an architecture computes (embedding scale,
soft-capping, extra norms, biases, per-layer implementations, tensor renames) comes from its own
table, ``trtllm_models.py``, keyed by the checkpoint's ``architecture`` as TensorRT-LLM's
``MODEL_MAP`` is, each fact citing the TensorRT-LLM source that implements it; config fields are read
with TensorRT-LLM's defaults. It imports nothing from ``harp_trt.families``, whose ``FamilySpec.trtllm``
tables the writer follows, so a wrong fact there fails the golden test instead of passing both.

Tensors are read from disk when a layer needs them and dropped after it (embedding rows for the
tokens at hand, the LM head in row chunks), so checking a 7B checkpoint holds one layer in fp32.
Every tensor's per-rank shape is checked, as ``PretrainedModel.load`` does, and a missing one is an
error ("Required but not provided tensors"). The parallel execution is simulated rather than undone:
each tensor-parallel rank computes its heads / MLP columns from its own shard and the partial outputs
are summed (the all-reduce; a ``RowLinear`` bias added once after it) or concatenated
(``gather_output``); pipeline stages run their local layers in order. Which rank file holds
which shard and stage is the layout convention ``harp_trt.mapping`` (shared with the writer, not a
model fact; its split is pinned to TensorRT-LLM's by a test). Full-sequence causal prefill
only (no KV cache), fp32 throughout. Per-layer attention windows come from
``runtime_defaults.max_attention_window`` (cyclic, like the runtime); a window of w lets token i see
tokens i-w+1 .. i. QK-norm layers (Qwen3, Gemma3) normalise q and k per head before RoPE with
TensorRT-LLM's eps, and Gemma3's local layers take their own RoPE base (``trtllm_models``)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harp_trt.errors import CorruptWeightsError, UnsupportedArchitectureError
from harp_trt.mapping import ParallelMapping

from .trtllm_models import (ACTIVATIONS, HF_DECILM_NAMES, MODELS, QK_NORM_EPS, LayerConfig, ModelConfig,
                            ffn_mult_to_intermediate, pad_vocab, resolve)

__all__ = ["TrtllmCheckpoint", "read_checkpoint", "read_hf_decilm", "SUPPORTED_ARCHITECTURES"]

SUPPORTED_ARCHITECTURES = tuple(MODELS)
HEAD_CHUNK_BYTES = 64 << 20  # LM head rows read at once (fp32)


class _LazyRank:
    """One rank file's tensors, read on access (nothing cached), by the name TensorRT-LLM's model
    looks them up under; ``rename`` maps such a name to the name in the file, or to names
    concatenated (HF DeciLM folders)."""

    def __init__(self, reader, rename: dict[str, str | tuple[str, ...]] | None = None, label: str = ""):
        self.reader = reader
        self.rename = rename
        self.label = label

    def _name(self, name: str):
        if self.rename is None:
            return name if name in self.reader else None
        return self.rename.get(name)

    def __contains__(self, name: str) -> bool:
        return self._name(name) is not None

    def _real(self, name: str):
        real = self._name(name)
        if real is None:
            raise CorruptWeightsError(f"{self.label} has no {name}; TensorRT-LLM's PretrainedModel.load refuses "
                                      "the checkpoint (\"Required but not provided tensors\")")
        return real

    def __getitem__(self, name: str) -> torch.Tensor:
        real = self._real(name)
        if isinstance(real, tuple):
            return torch.cat([self.reader.get(r) for r in real])
        return self.reader.get(real)

    def weight(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor in fp32, refused unless it has the shape the model's parameter has."""
        t = self[name]
        if tuple(t.shape) != tuple(shape):
            raise CorruptWeightsError(f"{self.label}: {name} has shape {tuple(t.shape)}, the model's parameter "
                                      f"{tuple(shape)} (TensorRT-LLM's load fails on it)")
        return t.float()

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.reader.get(self._real(name), rows=(start, stop))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.reader.spec(self._real(name)).shape)

    def keys(self) -> list[str]:
        return sorted(self.rename) if self.rename is not None else self.reader.names()


def _renamed(reader, renames: tuple[tuple[str, str], ...]) -> dict[str, str] | None:
    """Model name -> file name after the load-time renames (DeciLM's preprocess hook)."""
    if not renames:
        return None
    out = {}
    for n in reader.names():
        m = n
        for old, new in renames:
            m = m.replace(old, new)
        out[m] = n
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """functional.py ``RopeEmbeddingUtils.create_sinusoidal_positions_for_attention_plugin`` (linear:
    inv / factor) and ``apply_llama3_scaling`` (with its defaults)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("type") or scaling.get("rope_type")
    if kind == "linear":
        return (inv / scaling.get("factor", 1.0)).float()
    if kind == "llama3":
        factor, lo = scaling.get("factor", 8.0), scaling.get("low_freq_factor", 1.0)
        hi, old = scaling.get("high_freq_factor", 4.0), scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled).float()
    raise UnsupportedArchitectureError(f"reader: rotary scaling {kind!r} is not implemented",
                                       "supported: none, linear, llama3")


def _rope_tables(T: int, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([ang.cos(), ang.cos()], -1)[None, :, None], torch.cat([ang.sin(), ang.sin()], -1)[None, :, None]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary embedding on (B, T, heads, dim): halves are rotated, not interleaved pairs."""
    d = cos.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2: d]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([x[..., :d] * cos + rot * sin, x[..., d:]], -1)


@dataclass
class _Layer:
    cfg: LayerConfig
    window: int | None      # attention window (None: full)
    local_rope: bool = False  # RoPE with rotary_base_local (Gemma3's is_sliding layers)


class TrtllmCheckpoint:
    """A TensorRT-LLM checkpoint folder (all ranks), read lazily, run as TensorRT-LLM runs it."""

    def __init__(self, config: dict[str, Any], ranks: list):
        self.config = config
        self.m: ModelConfig = resolve(config)
        self.arch = self.m.architecture
        self.tp, self.pp = self.m.tp, self.m.pp
        self.mapping = ParallelMapping(self.tp, self.pp)
        if len(ranks) != self.mapping.world_size:
            raise CorruptWeightsError(f"checkpoint has {len(ranks)} rank files, "
                                      f"mapping needs {self.mapping.world_size}")
        self.ranks = ranks
        self.layers = self._layer_specs()

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path) -> "TrtllmCheckpoint":
        from harp_trt.weights import WeightReader

        p = Path(path)
        try:
            config = json.loads((p / "config.json").read_text())
        except FileNotFoundError:
            raise CorruptWeightsError(f"{p} has no config.json; not a TensorRT-LLM checkpoint") from None
        facts = MODELS.get(config.get("architecture"))
        world = ParallelMapping.from_config(config.get("mapping", {})).world_size
        ranks = []
        for r in range(world):
            f = p / f"rank{r}.safetensors"
            if not f.is_file():
                raise CorruptWeightsError(f"{p} is missing {f.name} (mapping has {world} ranks)")
            reader = WeightReader(f)
            ranks.append(_LazyRank(reader, _renamed(reader, facts.renames if facts else ()), f.name))
        return cls(config, ranks)

    def rank_weights(self, tp_rank: int, pp_rank: int) -> _LazyRank:
        return self.ranks[self.mapping.rank(tp_rank, pp_rank)]

    # ---- structure ----------------------------------------------------------------------------
    def _layer_specs(self) -> list[_Layer]:
        windows = (self.config.get("runtime_defaults") or {}).get("max_attention_window") or None
        specs, attn_idx = [], 0
        local = self.m.local or (False,) * len(self.m.layers)
        for lc, is_local in zip(self.m.layers, local):
            w = None
            if lc.attention == "attention":
                # the runtime indexes the list by attention-layer ordinal, cyclically
                # (TransformerBuffers: maxAttentionWindowVec[(firstLayerId + i) % len])
                if windows:
                    w = int(windows[attn_idx % len(windows)])
                attn_idx += 1
            specs.append(_Layer(lc, w, is_local))
        return specs

    def kv_heads_per_layer(self) -> list[int]:
        return [s.cfg.kv_heads if s.cfg.attention == "attention" else 0 for s in self.layers]

    def kv_cache_tokens(self, seq_len: int) -> list[int]:
        """Tokens of K/V each layer keeps for one sequence of ``seq_len`` tokens (before paging)."""
        return [0 if s.cfg.attention != "attention" else min(s.window or seq_len, seq_len) for s in self.layers]

    # ---- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (fp32, ``[batch, seq, vocab]``) of a full causal prefill of ``input_ids``."""
        m = self.m
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        T = ids.shape[1]
        rope = {False: _rope_tables(T, _inv_freq(m.rotary_dim, m.rotary_base, m.rotary_scaling))}
        if m.rotary_base_local is not None:  # Attention(rotary_embedding_base_local=...), is_local layers
            rope[True] = _rope_tables(T, _inv_freq(m.rotary_dim, m.rotary_base_local, None))
        h = self._embed(ids) * m.embed_scale  # GemmaModel.forward: embedding * sqrt(hidden)
        for p in range(self.pp):
            for local, g in enumerate(self.mapping.pp_layers(m.num_layers, p)):
                spec = self.layers[g]
                h = self._layer(h, p, local, spec, *rope[spec.local_rope])
        last = self.pp - 1
        h = _rms(h, self.rank_weights(0, last).weight("transformer.ln_f.weight", (m.hidden,)), m.eps)
        rows = pad_vocab(m.vocab, self.tp) // self.tp  # ColumnLinear(vocab_size_padded, gather_output)
        step = max(1, HEAD_CHUNK_BYTES // (4 * m.hidden))
        parts = []
        for t in range(self.tp):
            w = self.rank_weights(t, last)
            if w.shape("lm_head.weight") != (rows, m.hidden):
                raise CorruptWeightsError(f"{w.label}: lm_head.weight has shape {w.shape('lm_head.weight')}, "
                                          f"the model's parameter {(rows, m.hidden)}")
            parts += [h @ w.rows("lm_head.weight", r, min(r + step, rows)).float().T for r in range(0, rows, step)]
        logits = torch.cat(parts, -1)[..., : m.vocab] * m.logit_scale
        if m.final_softcap:  # DecoderModelForCausalLM.forward
            logits = torch.tanh(logits / m.final_softcap) * m.final_softcap
        return logits if input_ids.dim() == 2 else logits[0]

    __call__ = forward

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the (possibly split) table for the tokens at hand only (layers/embedding.py
        ``Embedding``: vocab rows padded to a multiple of tp and split, or hidden columns split)."""
        m, name = self.m, "transformer.vocab_embedding.weight"
        uniq, local = torch.unique(ids, return_inverse=True)
        if not m.parallel_embedding or self.tp == 1:
            w = self.rank_weights(0, 0)
            if w.shape(name) != (m.vocab, m.hidden):
                raise CorruptWeightsError(f"{w.label}: {name} has shape {w.shape(name)}, the model's parameter "
                                          f"{(m.vocab, m.hidden)} (a replicated embedding)")
            rows = torch.cat([w.rows(name, int(r), int(r) + 1).float() for r in uniq])
        elif m.embedding_sharding_dim == 0:
            per = pad_vocab(m.vocab, self.tp) // self.tp
            shards = [self.rank_weights(t, 0) for t in range(self.tp)]
            for s in shards:
                if s.shape(name) != (per, m.hidden):
                    raise CorruptWeightsError(f"{s.label}: {name} has shape {s.shape(name)}, the model's "
                                              f"vocab-split parameter {(per, m.hidden)}")
            rows = torch.cat([shards[int(r) // per].rows(name, int(r) % per, int(r) % per + 1).float() for r in uniq])
        else:
            shards = [self.rank_weights(t, 0) for t in range(self.tp)]
            rows = torch.cat([torch.cat([s.rows(name, int(r), int(r) + 1).float() for s in shards], -1) for r in uniq])
        return rows[local]

    def _layer(self, h, pp_rank, local, spec: _Layer, cos, sin):
        """One decoder layer: LLaMA / QWen / Gemma ``*DecoderLayer.forward``, DeciLMDecoderLayer.forward
        (no_op attention / FFN contribute nothing and have no norm)."""
        m, lc = self.m, spec.cfg
        pre = f"transformer.layers.{local}."
        w0 = self.rank_weights(0, pp_rank)
        norm = (m.hidden,)
        if lc.attention != "no_op":
            x = _rms(h, w0.weight(pre + "input_layernorm.weight", norm), m.eps)
            if lc.attention == "linear":  # LinearAttention: ColumnLinear(hidden, hidden, gather_output)
                W = torch.cat([self.rank_weights(t, pp_rank).weight(pre + "attention.weight", (m.hidden // self.tp, m.hidden))
                               for t in range(self.tp)])
                a = x @ W.T
            else:
                a = sum(self._attention_shard(x, self.rank_weights(t, pp_rank), pre, spec, cos, sin)
                        for t in range(self.tp))
                if m.dense_bias:
                    a = a + w0.weight(pre + "attention.dense.bias", norm)
            if m.inter_layernorms:  # GemmaDecoderLayer: post_layernorm on the attention output
                a = _rms(a, w0.weight(pre + "post_layernorm.weight", norm), m.eps)
            h = h + a
        if lc.ffn == "no_op":
            return h
        if m.inter_layernorms:
            x = _rms(h, w0.weight(pre + "pre_feedforward_layernorm.weight", norm), m.eps)
            y = self._mlp(x, pp_rank, pre, lc)
            return h + _rms(y, w0.weight(pre + "post_feedforward_layernorm.weight", norm), m.eps)
        x = _rms(h, w0.weight(pre + "post_layernorm.weight", norm), m.eps)
        return h + self._mlp(x, pp_rank, pre, lc)

    def _mlp(self, x, pp_rank, pre, lc: LayerConfig):
        """layers/mlp.py ``GatedMLP``: ``proj(act(fc(x)) * gate(x))``, fc/gate column-split, proj
        row-split (bias after the all-reduce); DeciLM's LinearFFN: one gathered ColumnLinear."""
        m = self.m
        p = pre + m.facts.mlp_module + "."
        if lc.ffn == "linear":
            return x @ torch.cat([self.rank_weights(t, pp_rank).weight(p + "weight", (m.hidden // self.tp, m.hidden))
                                  for t in range(self.tp)]).T
        act, n = ACTIVATIONS[m.act], lc.intermediate // self.tp
        out = 0
        for t in range(self.tp):
            w = self.rank_weights(t, pp_rank)
            fc, gate = x @ w.weight(p + "fc.weight", (n, m.hidden)).T, x @ w.weight(p + "gate.weight", (n, m.hidden)).T
            if m.mlp_bias:
                fc, gate = fc + w.weight(p + "fc.bias", (n,)), gate + w.weight(p + "gate.bias", (n,))
            out = out + (act(fc) * gate) @ w.weight(p + "proj.weight", (m.hidden, n)).T
        if m.mlp_bias:
            out = out + self.rank_weights(0, pp_rank).weight(p + "proj.bias", (m.hidden,))
        return out

    def _attention_shard(self, x, w, pre, spec: _Layer, cos, sin):
        """One tensor-parallel rank's share of an attention layer, through its dense slice
        (layers/attention.py ``Attention``: scores / (q_scaling * sqrt(head_size)), then
        ``max_attn_value * tanh(scores / max_attn_value)`` when soft-capped)."""
        m = self.m
        hd, nq = m.head_size, m.heads // self.tp
        nkv = (spec.cfg.kv_heads + self.tp - 1) // self.tp
        rows = (nq + 2 * nkv) * hd
        qkv = x @ w.weight(pre + "attention.qkv.weight", (rows, m.hidden)).T
        if m.attn_bias:
            qkv = qkv + w.weight(pre + "attention.qkv.bias", (rows,))
        B, T, _ = x.shape
        if m.qk_norm:
            q, k, v = self._qk_norm(qkv.view(B, T, nq + 2 * nkv, hd), w, pre, nq, nkv)
        else:
            q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
            q, k, v = q.view(B, T, nq, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / (math.sqrt(hd) * m.q_scaling)
        if m.attn_softcap > 0:
            s = torch.tanh(s / m.attn_softcap) * m.attn_softcap
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None]
        allowed = j <= i
        if spec.window:
            allowed = allowed & (j > i - spec.window)
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, nq * hd)
        return o @ w.weight(pre + "attention.dense.weight", (m.hidden, nq * hd)).T

    def _qk_norm(self, qkv, w, pre, nq, nkv):
        """layers/attention.py ``Attention.forward`` with ``qk_layernorm``: before RoPE, q and k heads are
        RmsNorm-ed over head_size with one shared gain each (eps ``QK_NORM_EPS``). With more query
        than KV heads per rank the rows split as [Q | K | V]; with as many, the source views them as
        [heads, 3, head_size] (q, k, v interleaved per head) and concatenates the parts back as
        [Q | K | V] for the plugin -- reproduced here, so a [Q | K | V] checkpoint fails the check there."""
        hd = self.m.head_size
        if nq != nkv:
            q, k, v = qkv.split([nq, nkv, nkv], 2)
        else:
            q, k, v = qkv.view(*qkv.shape[:2], nq, 3, hd).unbind(3)
        q = _rms(q, w.weight(pre + "attention.q_layernorm.weight", (hd,)), QK_NORM_EPS)
        k = _rms(k, w.weight(pre + "attention.k_layernorm.weight", (hd,)), QK_NORM_EPS)
        return q, k, v


def _hf_layer(i: int, block: dict, heads: int, hidden: int, names: dict) -> dict:
    """One HF ``block_configs`` entry as a layer config, and its tensors' names
    (nemotron_nas/convert.py ``hf_block_config_to_layer_config``, ``load_model_weights``)."""
    a, f = block["attention"], block["ffn"]
    dst = f"transformer.layers.{i}."
    hf = {k: v.format(i=i) for k, v in HF_DECILM_NAMES.items()}
    if a.get("sparsify") or f.get("sparsify"):
        raise UnsupportedArchitectureError("reader: sparsified DeciLM blocks (TensorRT-LLM: NotImplementedError)")
    if a.get("no_op"):
        attn = {"impl": "no_op", "num_key_value_heads": None}
    elif a.get("replace_with_linear"):
        attn = {"impl": "linear", "num_key_value_heads": None}
        names[dst + "attention.weight"] = hf["linear_attn"]
    else:
        attn = {"impl": "attention", "num_key_value_heads": heads // a["n_heads_in_group"]}
        names[dst + "attention.qkv.weight"] = (hf["q"], hf["k"], hf["v"])
        names[dst + "attention.dense.weight"] = hf["o"]
    if not a.get("no_op"):
        names[dst + "input_layernorm.weight"] = hf["input_ln"]
    if f.get("no_op"):
        return {"attention": attn, "ffn": {"impl": "no_op", "intermediate_size": None}}
    names[dst + "post_layernorm.weight"] = hf["post_ln"]
    if f.get("replace_with_linear"):
        names[dst + "ffn.weight"] = hf["linear_mlp"]
        return {"attention": attn, "ffn": {"impl": "linear", "intermediate_size": None}}
    for role in ("fc", "gate", "proj"):
        names[dst + f"ffn.{role}.weight"] = hf[role]
    return {"attention": attn, "ffn": {"impl": "mlp", "intermediate_size": ffn_mult_to_intermediate(f["ffn_mult"], hidden)}}


def read_hf_decilm(path: str | Path) -> TrtllmCheckpoint:
    """Open an HF heterogeneous DeciLM folder (``block_configs``) as a single-rank checkpoint, as
    TensorRT-LLM's ``DeciLMForCausalLM.from_hugging_face`` converts it (``DeciConfig.from_hugging_face``,
    ``load_weights_from_hf_safetensors``), so the same forward pass checks it; tensors are read lazily."""
    from harp_trt.weights import WeightReader

    p = Path(path)
    hf = json.loads((p / "config.json").read_text())
    reader = WeightReader(p)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    names: dict[str, str | tuple[str, ...]] = {
        "transformer.vocab_embedding.weight": HF_DECILM_NAMES["embed"],
        "transformer.ln_f.weight": HF_DECILM_NAMES["final_norm"], "lm_head.weight": HF_DECILM_NAMES["lm_head"]}
    if HF_DECILM_NAMES["lm_head"] not in reader:
        raise CorruptWeightsError(f"{p} has no {HF_DECILM_NAMES['lm_head']}; "
                                  "TensorRT-LLM's DeciLM converter always reads it")
    layer_configs = [_hf_layer(i, b, heads, hidden, names) for i, b in enumerate(hf["block_configs"])]
    config = {"architecture": "DeciLMForCausalLM", "vocab_size": hf["vocab_size"], "hidden_size": hidden,
              "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": heads,
              "num_key_value_heads": hf.get("num_key_value_heads") or heads,
              "head_size": hf.get("head_dim") or hidden // heads, "intermediate_size": hf.get("intermediate_size"),
              "hidden_act": hf["hidden_act"], "norm_epsilon": hf["rms_norm_eps"],
              "rotary_base": hf.get("rope_theta", 10000.0), "rotary_scaling": hf.get("rope_scaling"),
              "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}, "layer_configs": layer_configs}
    return TrtllmCheckpoint(config, [_LazyRank(reader, names, p.name)])


def read_checkpoint(path: str | Path) -> TrtllmCheckpoint:
    """Load a TensorRT-LLM checkpoint folder (``config.json`` + ``rank*.safetensors``)."""
    return TrtllmCheckpoint.load(path)
