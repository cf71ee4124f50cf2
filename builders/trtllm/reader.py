"""A pure-PyTorch reader for TensorRT-LLM checkpoints: loads ``config.json`` and every
``rank{N}.safetensors`` and runs the forward pass the config describes, so a written checkpoint can
be checked against the PyTorch HARP reference on a machine without TensorRT-LLM or a GPU.

The reader knows nothing about Hugging Face models or HARP plans: everything comes from the files,
plus what each architecture's TensorRT-LLM model adds to the Llama layout (the family tables'
``TrtllmTarget``, the writer's own source of those facts).
Tensors are read from disk when a layer needs them and dropped after it (embedding rows for the
tokens at hand, the LM head in row chunks), so checking a 7B checkpoint holds one layer in fp32.
It simulates the parallel execution rather than undoing it: each tensor-parallel rank computes its
heads / MLP columns from its own shard and the partial outputs are summed (the all-reduce) or
concatenated (``gather_output``); pipeline stages run their local layers in order. Full-sequence
causal prefill only (no KV cache), fp32 throughout.

Architectures: ``DeciLMForCausalLM`` (per-layer ``attention`` / ``linear`` / ``no_op``),
``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (optionally with qkv bias) and ``Gemma2ForCausalLM``.
Per-layer attention windows come from ``runtime_defaults.max_attention_window`` (cyclic, like the
runtime); a window of w lets token i see tokens i-w+1 .. i."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from harp_trt.errors import CorruptWeightsError, UnsupportedArchitectureError
from harp_trt.families import FAMILIES, TrtllmTarget

__all__ = ["TrtllmCheckpoint", "read_checkpoint", "read_hf_decilm", "SUPPORTED_ARCHITECTURES"]

@dataclass(frozen=True)
class _Arch:
    """What an architecture's TensorRT-LLM model does beyond the Llama layout (from its ``TrtllmTarget``)."""
    embedding_scale: bool = False   # hidden states start as embedding * sqrt(hidden) (Gemma)
    inter_layernorms: bool = False  # post-attention, pre/post feed-forward norms (Gemma2)
    softcapping: bool = False       # attention / final logit soft-capping, query_pre_attn_scalar (Gemma2)
    heterogeneous: bool = False     # per-layer layer_configs (DeciLM)
    mlp_prefix: str = "mlp"

    @classmethod
    def of(cls, t: TrtllmTarget) -> "_Arch":
        return cls(t.embedding_scale, t.inter_layernorms, t.softcapping, t.layer_configs, t.mlp_prefix)


def _architectures() -> dict[str, _Arch]:
    """Every architecture a family is written as (the family tables), plus the stock Llama-layout
    ones, which need nothing beyond the defaults."""
    out = {"LlamaForCausalLM": _Arch(), "MistralForCausalLM": _Arch()}
    for name in FAMILIES:
        t = FAMILIES.get(name).trtllm
        if t is not None:
            out[t.architecture] = _Arch.of(t)
    return out


ARCHITECTURES: dict[str, _Arch] = _architectures()
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
HEAD_CHUNK_BYTES = 64 << 20  # LM head rows read at once (fp32)


class _LazyRank:
    """One rank file's tensors, read on access (nothing cached)."""

    def __init__(self, reader, rename: dict[str, str | tuple[str, ...]] | None = None):
        self.reader = reader
        self.rename = rename  # our name -> name in the file, or names concatenated (HF DeciLM folders)

    def _name(self, name: str):
        if self.rename is None:
            return name if name in self.reader else None
        return self.rename.get(name)

    def __contains__(self, name: str) -> bool:
        return self._name(name) is not None

    def __getitem__(self, name: str) -> torch.Tensor:
        real = self._name(name)
        if real is None:
            raise KeyError(name)
        if isinstance(real, tuple):
            return torch.cat([self.reader.get(r) for r in real])
        return self.reader.get(real)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.reader.get(self._name(name), rows=(start, stop))

    def num_rows(self, name: str) -> int:
        return self.reader.spec(self._name(name)).shape[0]

    def keys(self) -> list[str]:
        return sorted(self.rename) if self.rename is not None else self.reader.names()

_ACTS = {
    "silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def _pp_layers(num_layers: int, pp: int, rank: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inv_freq(dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if not scaling:
        return inv.float()
    kind = scaling.get("type") or scaling.get("rope_type")
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled).float()
    raise UnsupportedArchitectureError(f"reader: rotary scaling {kind!r} is not implemented",
                                       "supported: none, linear, llama3")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX rotary embedding on (B, T, heads, dim): halves are rotated, not interleaved pairs."""
    d = cos.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2: d]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([x[..., :d] * cos + rot * sin, x[..., d:]], -1)


@dataclass
class _Layer:
    kind: str               # attention | linear | no_op
    kv_heads: int           # this layer's KV heads (0 for linear / no_op)
    window: int | None      # attention window (None: full)


class TrtllmCheckpoint:
    """A TensorRT-LLM checkpoint folder loaded into memory (all ranks)."""

    def __init__(self, config: dict[str, Any], ranks: list):
        self.config = config
        self.ranks = ranks
        arch = config["architecture"]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(f"reader: architecture {arch!r} is not supported; "
                                               f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        m = config.get("mapping", {})
        self.tp = int(m.get("tp_size", 1))
        self.pp = int(m.get("pp_size", 1))
        if len(ranks) != self.tp * self.pp:
            raise CorruptWeightsError(f"checkpoint has {len(ranks)} rank files, mapping needs {self.tp * self.pp}")
        self.arch = arch
        self.traits = ARCHITECTURES[arch]
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
        m = config.get("mapping", {})
        world = int(m.get("tp_size", 1)) * int(m.get("pp_size", 1))
        ranks = []
        for r in range(world):
            f = p / f"rank{r}.safetensors"
            if not f.is_file():
                raise CorruptWeightsError(f"{p} is missing {f.name} (mapping has {world} ranks)")
            ranks.append(_LazyRank(WeightReader(f)))
        return cls(config, ranks)

    def rank_weights(self, tp_rank: int, pp_rank: int) -> _LazyRank:
        return self.ranks[tp_rank + pp_rank * self.tp]

    # ---- structure ----------------------------------------------------------------------------
    def _layer_specs(self) -> list[_Layer]:
        c = self.config
        n = c["num_hidden_layers"]
        kv = c.get("num_key_value_heads") or c["num_attention_heads"]
        windows = (c.get("runtime_defaults") or {}).get("max_attention_window") or None
        specs, attn_idx = [], 0
        for i in range(n):
            if self.traits.heterogeneous and c.get("layer_configs"):
                a = c["layer_configs"][i]["attention"]
                kind = a.get("impl", "attention")
                heads = (a.get("num_key_value_heads") or kv) if kind == "attention" else 0
            else:
                kind, heads = "attention", kv
            w = None
            if kind == "attention" and windows:
                # the runtime indexes the list by attention-layer ordinal, cyclically
                # (TransformerBuffers: maxAttentionWindowVec[(firstLayerId + i) % len])
                w = int(windows[attn_idx % len(windows)])
            if kind == "attention":
                attn_idx += 1
            specs.append(_Layer(kind, heads, w))
        return specs

    def kv_heads_per_layer(self) -> list[int]:
        return [s.kv_heads for s in self.layers]

    def kv_cache_tokens(self, seq_len: int) -> list[int]:
        """Tokens of K/V each layer keeps for one sequence of ``seq_len`` tokens (before paging)."""
        return [0 if s.kind != "attention" else min(s.window or seq_len, seq_len) for s in self.layers]

    # ---- forward ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (fp32, ``[batch, seq, vocab]``) of a full causal prefill of ``input_ids``."""
        c = self.config
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        T = ids.shape[1]
        head = c.get("head_size") or c["hidden_size"] // c["num_attention_heads"]
        rot_dim = c.get("rotary_embedding_dim") or head
        inv = _inv_freq(rot_dim, float(c.get("rotary_base", 10000.0)), c.get("rotary_scaling"))
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None]
        h = self._embed(ids)
        for p in range(self.pp):
            for local, g in enumerate(_pp_layers(c["num_hidden_layers"], self.pp, p)):
                h = self._layer(h, p, local, self.layers[g], cos, sin)
        last = self.pp - 1
        h = _rms(h, self.rank_weights(0, last)["transformer.ln_f.weight"].float(), c["norm_epsilon"])
        parts = []
        for t in range(self.tp):
            w = self.rank_weights(t, last)
            n = w.num_rows("lm_head.weight")
            step = max(1, HEAD_CHUNK_BYTES // (4 * h.shape[-1]))
            parts += [h @ w.rows("lm_head.weight", r, min(r + step, n)).float().T for r in range(0, n, step)]
        logits = torch.cat(parts, -1)[..., : c["vocab_size"]]
        cap = c.get("final_logit_softcapping") if self.traits.softcapping else None
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits if input_ids.dim() == 2 else logits[0]

    __call__ = forward

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the (possibly vocab-split) table for the tokens at hand only."""
        c = self.config
        name = "transformer.vocab_embedding.weight"
        shards = [self.rank_weights(0, 0)]
        if c.get("use_parallel_embedding"):
            if c.get("embedding_sharding_dim", 0) != 0:
                raise UnsupportedArchitectureError("reader: only vocab-dim (0) embedding sharding is supported")
            shards = [self.rank_weights(t, 0) for t in range(self.tp)]
        per = shards[0].num_rows(name)
        uniq, local = torch.unique(ids, return_inverse=True)
        rows = torch.cat([shards[int(r) // per].rows(name, int(r) % per, int(r) % per + 1).float() for r in uniq])
        h = F.embedding(local, rows)
        if self.traits.embedding_scale:
            h = h * math.sqrt(c["hidden_size"])
        return h

    def _layer(self, h, pp_rank, local, spec: _Layer, cos, sin):
        c = self.config
        eps = c["norm_epsilon"]
        pre = f"transformer.layers.{local}."
        w0 = self.rank_weights(0, pp_rank)
        mlp = self.traits.mlp_prefix
        if spec.kind != "no_op":
            x = _rms(h, w0[pre + "input_layernorm.weight"].float(), eps)
            if spec.kind == "linear":  # ColumnLinear with gather_output: concatenate the shards
                W = torch.cat([self.rank_weights(t, pp_rank)[pre + "attention.weight"].float()
                               for t in range(self.tp)])
                a = x @ W.T
            else:
                a = sum(self._attention_shard(x, self.rank_weights(t, pp_rank), pre, spec, cos, sin)
                        for t in range(self.tp))
            if self.traits.inter_layernorms:
                a = _rms(a, w0[pre + "post_layernorm.weight"].float(), eps)
            h = h + a
        if self.traits.inter_layernorms:
            x = _rms(h, w0[pre + "pre_feedforward_layernorm.weight"].float(), eps)
            m = self._mlp(x, pp_rank, pre, mlp)
            return h + _rms(m, w0[pre + "post_feedforward_layernorm.weight"].float(), eps)
        if pre + "post_layernorm.weight" not in w0:  # DeciLM no_op FFN
            return h
        x = _rms(h, w0[pre + "post_layernorm.weight"].float(), eps)
        return h + self._mlp(x, pp_rank, pre, mlp)

    def _mlp(self, x, pp_rank, pre, mlp):
        act = _ACTS[self.config["hidden_act"]]
        out = 0
        for t in range(self.tp):
            w = self.rank_weights(t, pp_rank)
            inter = act(x @ w[pre + f"{mlp}.fc.weight"].float().T) * (x @ w[pre + f"{mlp}.gate.weight"].float().T)
            out = out + inter @ w[pre + f"{mlp}.proj.weight"].float().T
        return out

    def _attention_shard(self, x, w, pre, spec: _Layer, cos, sin):
        """One tensor-parallel rank's share of an attention layer, already through its dense slice."""
        c = self.config
        hd = c.get("head_size") or c["hidden_size"] // c["num_attention_heads"]
        nq = c["num_attention_heads"] // self.tp
        nkv = (spec.kv_heads + self.tp - 1) // self.tp
        qkv = x @ w[pre + "attention.qkv.weight"].float().T
        if pre + "attention.qkv.bias" in w:
            qkv = qkv + w[pre + "attention.qkv.bias"].float()
        if qkv.shape[-1] != (nq + 2 * nkv) * hd:
            raise CorruptWeightsError(f"{pre}attention.qkv has {qkv.shape[-1]} rows per rank, "
                                      f"expected {(nq + 2 * nkv) * hd}")
        B, T, _ = x.shape
        q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], -1)
        q, k, v = q.view(B, T, nq, hd), k.view(B, T, nkv, hd), v.view(B, T, nkv, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = nq // nkv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        q_scaling = 1.0
        cap = None
        if self.traits.softcapping:
            q_scaling = math.sqrt(c["query_pre_attn_scalar"]) / math.sqrt(hd)
            cap = c.get("attn_logit_softcapping")
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / (math.sqrt(hd) * q_scaling)
        if cap:
            s = torch.tanh(s / cap) * cap
        i = torch.arange(T)[:, None]
        j = torch.arange(T)[None]
        allowed = j <= i
        if spec.window:
            allowed = allowed & (j > i - spec.window)
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, nq * hd)
        return o @ w[pre + "attention.dense.weight"].float().T


def read_hf_decilm(path: str | Path) -> TrtllmCheckpoint:
    """Open an HF heterogeneous DeciLM folder (``block_configs``) as a single-rank checkpoint, so
    the same forward pass checks it. Names and shapes follow the HF DeciLM / Nemotron-NAS layout
    (``tensorrt_llm/models/nemotron_nas/convert.py``); tensors are read lazily."""
    from harp_trt.weights import WeightReader

    from .hf_format import decilm_name

    p = Path(path)
    hf = json.loads((p / "config.json").read_text())
    reader = WeightReader(p)
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    names: dict[str, str | tuple[str, ...]] = {
        "transformer.vocab_embedding.weight": decilm_name("embed"),
        "transformer.ln_f.weight": decilm_name("final_norm"), "lm_head.weight": decilm_name("lm_head")}
    if decilm_name("lm_head") not in reader:
        raise CorruptWeightsError(f"{p} has no {decilm_name('lm_head')}; "
                                  "TensorRT-LLM's DeciLM converter always reads it")
    layer_configs, inter = [], None
    for i, block in enumerate(hf["block_configs"]):
        a, f = block["attention"], block["ffn"]
        dst = f"transformer.layers.{i}."
        if a.get("no_op"):
            layer_configs.append({"attention": {"impl": "no_op", "num_key_value_heads": None}})
        elif a.get("replace_with_linear"):
            layer_configs.append({"attention": {"impl": "linear", "num_key_value_heads": None}})
            names[dst + "attention.weight"] = decilm_name("linear_attn", i)
        else:
            layer_configs.append({"attention": {"impl": "attention",
                                                "num_key_value_heads": heads // a["n_heads_in_group"]}})
            names[dst + "attention.qkv.weight"] = tuple(decilm_name(n, i) for n in "qkv")
            names[dst + "attention.dense.weight"] = decilm_name("o", i)
        if not a.get("no_op"):
            names[dst + "input_layernorm.weight"] = decilm_name("input_ln", i)
        n = int(2 * f["ffn_mult"] * hidden / 3)
        inter = n if n % 256 == 0 else n + 256 - n % 256
        layer_configs[-1]["ffn"] = {"impl": "mlp", "intermediate_size": inter}
        names[dst + "post_layernorm.weight"] = decilm_name("post_attn_ln", i)
        for role, trt in (("gate", "fc"), ("up", "gate"), ("down", "proj")):
            names[dst + f"ffn.{trt}.weight"] = decilm_name(role, i)
    config = {"architecture": "DeciLMForCausalLM", "vocab_size": hf["vocab_size"], "hidden_size": hidden,
              "num_hidden_layers": hf["num_hidden_layers"], "num_attention_heads": heads,
              "num_key_value_heads": hf.get("num_key_value_heads") or heads,
              "head_size": hf.get("head_dim") or hidden // heads, "intermediate_size": inter,
              "hidden_act": hf["hidden_act"], "norm_epsilon": hf["rms_norm_eps"],
              "rotary_base": hf.get("rope_theta", 10000.0), "rotary_scaling": hf.get("rope_scaling"),
              "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1}, "layer_configs": layer_configs}
    return TrtllmCheckpoint(config, [_LazyRank(reader, names)])


def read_checkpoint(path: str | Path) -> TrtllmCheckpoint:
    """Load a TensorRT-LLM checkpoint folder (``config.json`` + ``rank*.safetensors``)."""
    return TrtllmCheckpoint.load(path)
