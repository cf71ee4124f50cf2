"""Write a HARP-pruned model as a llama.cpp ``deci`` GGUF, one tensor in memory at a time.

Why ``deci`` (Nemotron-51B's architecture in llama.cpp) runs a HARP model unchanged, from the
vendored sources (``vendor/llama.cpp`` of llama-cpp-python 0.3.36):

* per-layer head counts: ``llama_model_base::load_hparams`` (``src/llama-model.cpp``) reads
  ``deci.attention.head_count`` and ``.head_count_kv`` as per-layer arrays
  (``get_key_or_arr``); ``head_count_kv`` defaults to ``head_count``, ``rope.freq_base`` to 10000
  and the head size to ``embedding_length / head_count[0]``, so all three are written explicitly;
  ``rope.dimension_count`` must equal the head size ("invalid n_rot" otherwise);
* ``llama_model_deci::load_arch_tensors`` (``src/models/deci.cpp``): a layer with heads > 0 and KV
  heads 0 loads ``attn_norm`` and one ``attn_output`` of ``hidden x hidden``; heads 0 loads no
  attention tensors; heads and KV heads > 0 load q/k/v/o as llama does;
* ``llama_model_deci::graph``: heads > 0, KV heads 0 computes ``attn_output . attn_norm(x)`` plus
  the residual (HARP's ``alpha * W_O . repeat_kv(W_V)``, folded in fp32 by ``harp_trt.fold.fold_vo``);
  heads 0 passes ``x`` straight to the MLP (an alpha = 0 layer); kept layers use RoPE type
  ``LLAMA_ROPE_TYPE_NORM`` (``llama_model_rope_type``: pairs of consecutive values), so their Q/K rows
  are permuted from Hugging Face's half-split rotary layout (``permute_qk``); the MLP is SiLU-gated;
* the head size (``n_embd_head_k``) is read only when layer 0 has heads (``hparams.n_head()`` is
  ``n_head_arr[0]``), so an alpha = 0 layer 0 is written as a linear attention of zeros (exact);
* KV cache (``llama_kv_cache`` constructor, ``src/llama-kv-cache.cpp``): a layer's K and V rows are
  ``head size x KV heads`` wide, zero for pruned layers; without flash attention V is transposed and
  padded to the widest layer ("padding V cache"), so only K shrinks unless flash attention is on.

Tensor names and the tokenizer keys follow llama.cpp's (``src/llama-arch.cpp`` ``LLM_TENSOR_NAMES``:
``token_embd``, ``blk.N.attn_norm`` ...); a model read from a GGUF file carries that file's
``tokenizer.*`` keys unchanged (``vocab.py``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch

from harp_trt.dims import ModelDims
from harp_trt.errors import UnsupportedArchitectureError
from harp_trt.families import FamilySpec, family_of
from harp_trt.fold import RoleReader, fold_vo
from harp_trt.kvcache import kv_cache_bytes
from harp_trt.weights import WeightReader, hf_config

__all__ = ["DeciLayer", "deci_layers", "check_supported", "rope_factors", "ROPE_FREQ_TYPES", "permute_qk", "write_deci_gguf", "kv_bytes_per_token",
           "hf_config", "TORCH_DTYPES"]

log = logging.getLogger(__name__)
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
_FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}  # enum llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16


@dataclass(frozen=True)
class DeciLayer:
    """One decoder layer as written: ``attention`` (kept), ``linear`` (HARP alpha > 0: one folded
    matrix) or ``none`` (alpha = 0: heads 0, no attention tensors)."""

    layer: int
    kind: str
    heads: int
    kv_heads: int
    alpha: float | None

    def row(self) -> dict[str, Any]:
        return {"layer": self.layer, "kind": self.kind, "heads": self.heads, "kv_heads": self.kv_heads,
                "alpha": self.alpha}


def deci_layers(alphas: Mapping[int, float], dims: ModelDims) -> list[DeciLayer]:
    out = []
    for i in range(dims.num_layers):
        a = alphas.get(i)
        if a is None:
            out.append(DeciLayer(i, "attention", dims.heads, dims.kv_heads, None))
        elif a == 0.0 and i > 0:
            out.append(DeciLayer(i, "none", 0, 0, 0.0))
        else:  # alpha > 0, or alpha = 0 on layer 0 (a zero matrix: llama.cpp reads the head size from layer 0)
            out.append(DeciLayer(i, "linear", dims.heads, 0, float(a)))
    return out


def kv_bytes_per_token(layers: list[DeciLayer], head_dim: int, element_bytes: int) -> int:
    """K + V bytes one token costs with flash attention on (no V padding), by the rule of the
    ``llama_kv_cache`` constructor: ``head size x KV heads`` per layer for K and for V
    (``harp_trt.kvcache.kv_cache_bytes`` of each layer's own KV heads)."""
    return sum(kv_cache_bytes(l.kv_heads, head_dim, element_bytes) for l in layers)


def _rope_theta(config) -> tuple[float, str]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    legacy = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    return theta, rope_type


# RoPE types whose whole effect is a divisor per frequency (attention factor 1), which llama.cpp applies
# from a ``rope_freqs`` tensor (ggml rope ``freq_factors``; loaded by llama_model_deci::load_arch_tensors, used
# through llama_model::get_rope_factors)
ROPE_FREQ_TYPES = ("llama3", "linear")


def rope_factors(config, dims: ModelDims) -> torch.Tensor | None:
    """llama.cpp's ``rope_freqs`` for a scaled RoPE: the default inverse frequencies over the ones
    transformers computes for the model (``ROPE_INIT_FUNCTIONS``), so the file rotates exactly as the
    reference does; None for plain RoPE."""
    theta, rope_type = _rope_theta(config)
    if rope_type == "default":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    if attention_factor != 1.0:
        raise UnsupportedArchitectureError(f"RoPE {rope_type!r} scales attention by {attention_factor}; "
                                           "llama.cpp's rope_freqs cannot express it")
    default = 1.0 / (theta ** (torch.arange(0, dims.head_dim, 2, dtype=torch.float32) / dims.head_dim))
    return (default / scaled.float()).float()


def check_supported(family: FamilySpec, config, dims: ModelDims) -> None:
    """UnsupportedArchitectureError (with the reason) for what llama.cpp's deci graph cannot compute
    exactly: the family's own refusal (``FamilySpec.gguf``), biases, a non-SiLU MLP, RoPE scaling,
    sliding windows shorter than the context."""
    target = family.gguf
    why = None
    if target is None:
        why = "the family has no llama.cpp target"
    elif target.refusal:
        why = target.refusal
    elif getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        why = "attention/MLP biases: deci's linear attention drops the folded V bias (src/models/deci.cpp)"
    elif (getattr(config, "hidden_act", "silu") or "silu") != "silu":
        why = f"MLP activation {config.hidden_act!r}: deci's MLP is SiLU-gated (LLM_FFN_SILU)"
    elif _rope_theta(config)[1] not in ("default", *ROPE_FREQ_TYPES):
        why = f"RoPE scaling {_rope_theta(config)[1]!r}: only {', '.join(ROPE_FREQ_TYPES)} map onto llama.cpp's rope_freqs"
    elif any(w is not None and w < config.max_position_embeddings for w in dims.windows):
        why = "sliding-window attention: deci attends over the whole context"
    if why:
        raise UnsupportedArchitectureError(
            f"{family.name} models cannot be written as a llama.cpp GGUF: {why}",
            "supported: llama and mistral (no sliding window) families; use --backend ort or genai"
            + (" or trtllm" if family.trtllm is not None else "") + " for this model")


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a Hugging Face Q or K projection (per head: first halves, then second halves of the
    rotary pairs) reordered into llama.cpp's interleaved pairs, as its converter does for llama."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(src: RoleReader, layers: list[DeciLayer], dims: ModelDims, dtype: torch.dtype,
             rope: torch.Tensor | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) in file order; matrices in ``dtype``, 1-D norms in f32 (as llama.cpp's
    converter keeps them); folds in fp32 before the one cast."""
    f32 = torch.float32
    yield "token_embd.weight", src.get("embed").to(dtype)
    if rope is not None:
        yield "rope_freqs.weight", rope.to("meta") if src.meta else rope
    for l in layers:
        i, p = l.layer, f"blk.{l.layer}."
        if l.kind != "none":
            yield p + "attn_norm.weight", src.get("input_ln", i).to(f32)
        if l.kind == "attention":
            yield p + "attn_q.weight", permute_qk(src.get("q", i), dims.heads).to(dtype)
            yield p + "attn_k.weight", permute_qk(src.get("k", i), dims.kv_heads).to(dtype)
            yield p + "attn_v.weight", src.get("v", i).to(dtype)
            yield p + "attn_output.weight", src.get("o", i).to(dtype)
        elif l.kind == "linear":
            yield p + "attn_output.weight", fold_vo(src.get("v", i), src.get("o", i), dims, l.alpha).to(dtype)
        yield p + "ffn_norm.weight", src.get("post_attn_ln", i).to(f32)
        yield p + "ffn_gate.weight", src.get("gate", i).to(dtype)
        yield p + "ffn_up.weight", src.get("up", i).to(dtype)
        yield p + "ffn_down.weight", src.get("down", i).to(dtype)
    yield "output_norm.weight", src.get("final_norm").to(f32)
    if not src.tied():  # llama_model_deci::load_arch_tensors falls back to token_embd when absent
        yield "output.weight", src.get("lm_head").to(dtype)


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _add_info(writer, name: str, t: torch.Tensor) -> None:
    import gguf

    np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}[t.dtype]
    raw = gguf.GGMLQuantizationType.BF16 if t.dtype == torch.bfloat16 else None
    writer.add_tensor_info(name, tuple(t.shape), np.dtype(np_dtype), t.numel() * t.element_size(), raw_dtype=raw)


def write_arch_keys(writer, config, dims: ModelDims, layers: list[DeciLayer], dtype: str, context: int,
                    name: str) -> None:
    """The ``general.*`` and ``deci.*`` keys (``src/llama-arch.cpp`` ``LLM_KV_NAMES``)."""
    theta, _ = _rope_theta(config)
    writer.add_name(name)
    writer.add_context_length(int(context or config.max_position_embeddings))
    writer.add_embedding_length(dims.hidden)
    writer.add_block_count(dims.num_layers)
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_head_count([l.heads for l in layers])
    writer.add_head_count_kv([l.kv_heads for l in layers])
    writer.add_key_length(dims.head_dim)
    writer.add_value_length(dims.head_dim)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(dims.vocab)
    writer.add_file_type(_FILE_TYPES[dtype])


def write_deci_gguf(model_folder: str | Path, alphas: Mapping[int, float], out_path: str | Path, *,
                    dtype: str = "f16", context: int = 0, vocab: Callable[[Any], dict[str, Any]],
                    name: str = "harp", fitted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``out_path`` (a deci GGUF) from the Hugging Face folder ``model_folder`` with HARP's
    ``alphas`` ({layer: alpha}; empty: the dense model) and a plan's ``fitted`` maps (checkpoint
    names -> tensors, ``Plan.fitted_tensors``: their V/O are folded in place of the layer's own). ``vocab(writer)`` adds the ``tokenizer.*``
    keys and returns what it wrote (``vocab.py``). Tensors are planned on shape-only tensors first,
    then read, folded, cast and written one at a time. Returns the per-layer table and sizes."""
    import gguf

    config = hf_config(model_folder)
    family = family_of(config)
    dims = ModelDims.from_config(config)
    check_supported(family, config, dims)
    layers = deci_layers(dict(alphas), dims)
    tdtype = TORCH_DTYPES[dtype]
    rope = rope_factors(config, dims)
    reader = WeightReader(model_folder)
    fitted = dict(fitted or {})
    writer = gguf.GGUFWriter(str(out_path), family.gguf.architecture)
    try:
        write_arch_keys(writer, config, dims, layers, dtype, context, name)
        tokenizer = vocab(writer)
        with torch.no_grad():
            names = []
            for n, t in _tensors(RoleReader(reader, family, meta=True, overlay=fitted), layers, dims, tdtype, rope):
                _add_info(writer, n, t)
                names.append(n)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for (n, t), want in zip(_tensors(RoleReader(reader, family, meta=False, overlay=fitted), layers, dims, tdtype, rope),
                                    names):
                assert n == want, (n, want)  # the two passes yield the same order by construction
                writer.write_tensor_data(_numpy(t))
    finally:
        writer.close()
    log.info("wrote deci GGUF %s (%s, %d layers, %d pruned)", out_path, dtype, dims.num_layers, len(alphas))
    return {"architecture": family.gguf.architecture, "family": family.name, "dtype": dtype,
            "tensors": len(names), "bytes": Path(out_path).stat().st_size,
            "layers": [l.row() for l in layers], "head_dim": dims.head_dim, "num_layers": dims.num_layers,
            "kv_heads": dims.kv_heads, "tokenizer": tokenizer}
