"""The ideal speed-up of HARP, from counting the work it removes.

A measured speed-up means little on its own: it is shown next to the ratio of the work the dense
and the HARP model must do, so a reader sees how much of the possible gain an engine realises.

Work per token, one decoder layer, counting a multiply-add as 2 FLOPs (h = hidden size,
q = heads x head_dim, kv = kv_heads x head_dim, I = MLP width, T = keys the token attends to):

    kept layer     Q proj 2hq + K,V proj 2*2h*kv + scores 2qT + softmax c*heads*T + AV 2qT
                   + O proj 2qh + MLP 3*2hI
    pruned layer   V proj 2h*kv + folded V.O 2*kv*h + MLP 3*2hI        (HARP, Eq. 4-5)
      "folded"     one h x h matrix 2h*h + MLP 3*2hI                   (llama.cpp's deci linear attention)
    alpha = 0      MLP only

``pruned_form`` says which of the two a runtime executes: ``"vo"`` (our ONNX graphs, onnxruntime-genai:
the V and the kv x h O GEMMs) or ``"folded"`` (the GGUF's one h x h matrix, ``builders/gguf/writer.py``),
so each runtime's ideal counts the work it does.

The pruned layer has no softmax, no RoPE and no scores: its attention is the per-token linear map
V.O, and O folds over the repeated KV heads into a kv x h matrix (``harp_trt.fold.fold_o_proj``), so
the O GEMM shrinks from q x h to kv x h. Norms, RoPE and residual adds are left out (a few FLOPs
per element, under 1 % of a layer); the LM head (2hV) is counted for the positions an engine
computes logits for (``logits="last"`` or ``"all"``). Sliding-window layers attend to at most
``window`` keys. A prefill of S tokens sums the per-token work over T = 1..S.

Decode on CPUs and GPUs is bound by memory traffic rather than FLOPs, so a second ideal is given
for it: bytes read per token = weights + the KV cache at that context.

Above both sits the ceiling (``speedup_ceiling``): if a layer's cost is its attention plus its MLP
and layers add up, removing the attention of P of L layers leaves at least (L-P)/L of the work, so
no step can be faster than L/(L-P), whatever the shape, context or engine. A speed-up whose interval
lies wholly above it is a measurement bug to find, never a result: rows carry ``above_ceiling``."""
from __future__ import annotations

from typing import Any, Mapping

from harp_trt.dims import ModelDims
from harp_trt.kvcache import kv_cache_bytes

__all__ = ["SOFTMAX_FLOPS_PER_SCORE", "speedup_ceiling", "above_ceiling", "layer_flops_per_token", "flops_per_token",
           "prefill_flops", "decode_flops", "PRUNED_FORMS", "decode_bytes_per_token", "ideal_speedups", "kv_bytes_per_token",
           "decode_ideal"]

# max-subtract, exp, sum and divide per score element
SOFTMAX_FLOPS_PER_SCORE = 4
PRUNED_FORMS = ("vo", "folded")   # a pruned layer as V and kv x h O, or as one h x h matrix


def _pruned_params(d: ModelDims, form: str) -> int:
    """Parameters of a pruned (alpha > 0) layer's attention as ``form`` stores them."""
    if form not in PRUNED_FORMS:
        raise ValueError(f"pruned_form must be one of {PRUNED_FORMS}, got {form!r}")
    return 2 * d.hidden * d.kv_dim if form == "vo" else d.hidden * d.hidden


def speedup_ceiling(num_layers: int, pruned: int) -> float:
    """L / (L - P): the bound on any HARP speed-up (module docstring); inf when every layer is pruned."""
    if not 0 <= pruned <= num_layers or num_layers < 1:
        raise ValueError(f"pruned layers must lie in 0..{num_layers}, got {pruned}")
    return float("inf") if pruned == num_layers else num_layers / (num_layers - pruned)


def above_ceiling(ci_low: float | None, ceiling: float) -> bool:
    """Whether an interval's lower bound lies above the ceiling (a flag, with a margin of 1e-9)."""
    return ci_low is not None and ci_low > ceiling * (1 + 1e-9)


def _keys_sum(seq: int, window: int | None) -> int:
    """sum_{t=1..seq} min(t, window): keys attended over a causal prefill of ``seq`` tokens."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def _linear_parts(d: ModelDims, layer: int, alpha: float | None, pruned_form: str = "vo") -> tuple[int, int]:
    """(FLOPs per token independent of T, FLOPs per attended key) of one layer.
    ``alpha`` None = kept layer."""
    mlp = 3 * 2 * d.hidden * d.intermediate
    if alpha is None:
        proj = 2 * d.hidden * d.q_dim + 2 * 2 * d.hidden * d.kv_dim + 2 * d.q_dim * d.hidden
        per_key = 2 * d.q_dim + SOFTMAX_FLOPS_PER_SCORE * d.heads + 2 * d.q_dim
        return proj + mlp, per_key
    if alpha == 0.0:
        return mlp, 0
    return 2 * _pruned_params(d, pruned_form) + mlp, 0


def layer_flops_per_token(d: ModelDims, layer: int, keys: int, alpha: float | None = None) -> int:
    fixed, per_key = _linear_parts(d, layer, alpha)
    w = d.window(layer)
    return fixed + per_key * (min(keys, w) if w else keys)


def flops_per_token(d: ModelDims, keys: int, pruned: Mapping[int, float] | None = None,
                    logits: bool = True) -> int:
    """FLOPs of one token attending to ``keys`` keys (itself included)."""
    pruned = pruned or {}
    total = sum(layer_flops_per_token(d, i, keys, pruned.get(i)) for i in range(d.num_layers))
    return total + (2 * d.hidden * d.vocab if logits else 0)


def prefill_flops(d: ModelDims, seq: int, pruned: Mapping[int, float] | None = None,
                  logits: str = "last", pruned_form: str = "vo") -> int:
    """FLOPs of a causal prefill of ``seq`` tokens; ``logits`` = "last" | "all" | "none"."""
    pruned = pruned or {}
    total = 0
    for i in range(d.num_layers):
        fixed, per_key = _linear_parts(d, i, pruned.get(i), pruned_form)
        total += fixed * seq + per_key * _keys_sum(seq, d.window(i))
    n_logits = {"last": 1, "all": seq, "none": 0}[logits]
    return total + n_logits * 2 * d.hidden * d.vocab


def decode_flops(d: ModelDims, context: int, pruned: Mapping[int, float] | None = None) -> int:
    """FLOPs of one decode step after ``context`` tokens (it attends to context + 1 keys)."""
    return flops_per_token(d, context + 1, pruned, logits=True)


def kv_bytes_per_token(d: ModelDims, pruned: Mapping[int, float] | None = None, dtype_bytes: int = 4) -> int:
    """K and V bytes one token adds to the cache (batch 1); pruned layers keep none."""
    kept = d.num_layers - len(pruned or {})
    return kv_cache_bytes(d.kv_heads, d.head_dim, dtype_bytes, layers=kept)


def decode_bytes_per_token(d: ModelDims, context: int, pruned: Mapping[int, float] | None = None,
                           dtype_bytes: float = 4, kv_dtype_bytes: float | None = None,
                           pruned_form: str = "vo") -> float:
    """Bytes read by one decode step: every weight once (the embedding row is negligible) plus
    the KV cache of ``context`` tokens. Pruned layers read V and the folded kv x h O only
    (``pruned_form="vo"``), or one h x h matrix (``"folded"``).
    ``kv_dtype_bytes``: the cache's element size where it differs from the weights' (llama.cpp
    keeps an f16 cache next to f32 weights)."""
    pruned = pruned or {}
    params = d.hidden * d.vocab  # LM head
    for i in range(d.num_layers):
        params += 3 * d.hidden * d.intermediate
        a = pruned.get(i)
        if a is None:
            params += d.hidden * d.q_dim + 2 * d.hidden * d.kv_dim + d.q_dim * d.hidden
        elif a != 0.0:
            params += _pruned_params(d, pruned_form)
    cache = 0
    for i in range(d.num_layers):
        if i not in pruned:
            w = d.window(i)
            cache += kv_cache_bytes(d.kv_heads, d.head_dim, kv_dtype_bytes or dtype_bytes,
                                    tokens=min(context, w) if w else context)
    return params * dtype_bytes + cache


def ideal_speedups(d: ModelDims, pruned: Mapping[int, float], seq_lens, decode_context: int,
                   prefill_logits: str = "last", dtype_bytes: int = 4,
                   kv_dtype_bytes: int | None = None) -> dict[str, Any]:
    """Dense / HARP work ratios: ``prefill`` per sequence length, ``ttft`` (the prefill of
    ``decode_context`` tokens), ``decode`` (FLOPs) and
    ``decode_bytes`` (memory traffic) at ``decode_context``, plus the raw counts, ``ceiling``
    (L / (L - P), above every ideal), and
    ``kv_bytes_per_token``: the counted cache bytes one token adds (``kv_bytes_per_token``), dense
    and HARP, to set beside what an engine's runtime allocates."""
    prefill = {}
    for s in seq_lens:
        dense, harp = prefill_flops(d, s, None, prefill_logits), prefill_flops(d, s, pruned, prefill_logits)
        prefill[int(s)] = {"dense_flops": dense, "harp_flops": harp, "ideal": dense / harp}
    td = prefill_flops(d, decode_context, None, prefill_logits)
    th = prefill_flops(d, decode_context, pruned, prefill_logits)
    dd, dh = decode_flops(d, decode_context), decode_flops(d, decode_context, pruned)
    kvb = kv_dtype_bytes or dtype_bytes
    bd = decode_bytes_per_token(d, decode_context, None, dtype_bytes, kvb)
    bh = decode_bytes_per_token(d, decode_context, pruned, dtype_bytes, kvb)
    return {"prefill": prefill, "ceiling": speedup_ceiling(d.num_layers, len(pruned)),
            "ttft": {"dense_flops": td, "harp_flops": th, "ideal": td / th},
            "decode": {"dense_flops": dd, "harp_flops": dh, "ideal": dd / dh},
            "decode_bytes": {"dense_bytes": bd, "harp_bytes": bh, "ideal": bd / bh},
            "kv_bytes_per_token": {"dense": kv_bytes_per_token(d, None, kvb),
                                   "harp": kv_bytes_per_token(d, pruned, kvb)}}


def decode_ideal(d, pruned, context: int, batch: int, wb: float, kvb: float, form: str = "vo") -> dict[str, float]:
    """Bytes one decode step reads at ``context`` for ``batch`` sequences: the weights once plus each
    sequence's KV (``decode_bytes_per_token``; batch 1 is exactly its figure), a pruned layer
    counted as the runtime stores it (``form``)."""
    def step(p):
        weights = decode_bytes_per_token(d, 0, p, wb, kvb, form)
        return weights + batch * (decode_bytes_per_token(d, context, p, wb, kvb, form) - weights)
    dense, harp = step(None), step(pruned)
    return {"dense_bytes": dense, "harp_bytes": harp, "ideal": dense / harp, "pruned_form": form}
