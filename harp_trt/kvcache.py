"""KV-cache size, defined once: what every count of KV bytes (the FLOP/bytes model, the ORT
session and build, the TensorRT-LLM checkpoint and launch costs, the GPU benchmarks) multiplies.

A module of its own, importing nothing, so that the stages that need only this (the ORT build, the
Triton repository through ``harp_trt.ort_session``) do not take ``harp_trt.dims`` and the family
tables into their code keys."""
from __future__ import annotations

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(kv_heads: int, head_dim: int, dtype_bytes: int, layers: int = 1, tokens: int = 1) -> int:
    """Bytes the K and V cache of one sequence holds for ``tokens`` tokens in ``layers`` layers: a
    key and a value of ``kv_heads x head_dim`` elements of ``dtype_bytes`` each, per token and layer
    (the defaults give one token in one layer). Which layers keep a cache (HARP-pruned ones keep
    none), how many tokens a windowed layer holds and the element size are the caller's to say."""
    return 2 * kv_heads * head_dim * dtype_bytes * layers * tokens
