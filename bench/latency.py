"""Latency of a dense and a HARP engine measured side by side.

Both engines run in this process on the same inputs, *interleaved*: every repeat times the dense
and the HARP engine one after the other, alternating which goes first, so drift (thermal state,
other processes on a shared machine, allocator growth) hits both alike. Each shape is warmed up
before it is timed. Reported per shape: median, p90, p99, mean over the repeats.

* prefill: one forward pass over S prompt tokens (building the cache), per sequence length;
* generation at a context C: time to first token (prefill of C tokens + the greedy pick) and the
  ms of each following one-token decode step; tokens/s = 1000 / median ms per token;
* KV cache: bytes measured on the cache tensors after the generation, per token of context."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .engines import EnginePair

__all__ = ["LatencySettings", "measure_prefill", "measure_generation", "quantiles", "summarise"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatencySettings:
    seq_lens: tuple[int, ...]
    decode_context: int
    decode_tokens: int
    warmup: int
    repeats: int
    seed: int = 0


def _order(r: int) -> tuple[str, str]:
    return ("dense", "harp") if r % 2 == 0 else ("harp", "dense")


def _ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # ids from the lower half of the vocabulary: no special tokens at the top end of most vocabularies
    return torch.randint(3, max(4, vocab // 2), (1, n), generator=g)


def measure_prefill(pair: EnginePair, s: LatencySettings,
                    progress: Callable[[str], None] | None = None) -> list[dict]:
    """Raw samples: one row per (sequence length, repeat, variant) with ``ms``."""
    rows: list[dict] = []
    engines = pair.engines()
    for seq in s.seq_lens:
        ids = _ids(pair.dims.vocab, seq, s.seed + seq)
        for w in range(s.warmup):
            for v in _order(w):
                engines[v].prefill(ids)
        for r in range(s.repeats):
            for v in _order(r):
                t0 = time.perf_counter()
                engines[v].prefill(ids)
                rows.append({"measure": "prefill", "variant": v, "seq_len": seq, "repeat": r,
                             "step": 0, "ms": (time.perf_counter() - t0) * 1e3})
        if progress:
            progress(f"prefill {seq} tokens: dense {_median(rows, 'dense', seq):.1f} ms, "
                     f"harp {_median(rows, 'harp', seq):.1f} ms")
    return rows


def _median(rows, variant, seq) -> float:
    return float(np.median([r["ms"] for r in rows if r["variant"] == variant and r["seq_len"] == seq]))


def _generate(engine, ids: torch.Tensor, steps: int) -> tuple[float, list[float], int]:
    """(ms to first token, ms of each later step, cache bytes at the end). Greedy."""
    t0 = time.perf_counter()
    logits, state = engine.prefill(ids)
    tok = logits.argmax(-1, keepdim=True)
    ttft = (time.perf_counter() - t0) * 1e3
    step_ms = []
    for _ in range(steps):
        t = time.perf_counter()
        logits, state = engine.decode(tok, state)
        tok = logits.argmax(-1, keepdim=True)
        step_ms.append((time.perf_counter() - t) * 1e3)
    return ttft, step_ms, engine.cache_bytes(state)


def measure_generation(pair: EnginePair, s: LatencySettings,
                       progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Raw samples (``ttft`` and ``decode`` rows) and per-variant cache figures
    ``{variant: {"cache_bytes", "cache_tokens", "kv_bytes_per_token"}}``."""
    rows: list[dict] = []
    cache: dict[str, dict] = {}
    engines = pair.engines()
    ids = _ids(pair.dims.vocab, s.decode_context, s.seed + 7)
    for w in range(s.warmup):
        for v in _order(w):
            _generate(engines[v], ids, min(2, s.decode_tokens))
    for r in range(s.repeats):
        for v in _order(r):
            ttft, steps, nbytes = _generate(engines[v], ids, s.decode_tokens)
            rows.append({"measure": "ttft", "variant": v, "seq_len": s.decode_context, "repeat": r,
                         "step": 0, "ms": ttft})
            rows += [{"measure": "decode", "variant": v, "seq_len": s.decode_context, "repeat": r,
                      "step": i + 1, "ms": ms} for i, ms in enumerate(steps)]
            tokens = s.decode_context + s.decode_tokens
            cache[v] = {"cache_bytes": nbytes, "cache_tokens": tokens, "kv_bytes_per_token": nbytes / tokens}
    if progress:
        med = {v: np.median([x["ms"] for x in rows if x["measure"] == "decode" and x["variant"] == v])
               for v in ("dense", "harp")}
        progress(f"decode at {s.decode_context} tokens: dense {med['dense']:.2f} ms/token, "
                 f"harp {med['harp']:.2f} ms/token")
    return rows, cache


def quantiles(ms) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p90_ms": float(np.quantile(a, 0.9)),
            "p99_ms": float(np.quantile(a, 0.99)), "mean_ms": float(a.mean()),
            "min_ms": float(a.min()), "n": int(a.size)}


def summarise(samples: list[dict]) -> list[dict]:
    """One row per (measure, seq_len, variant) with the quantiles of its samples."""
    groups: dict[tuple, list[float]] = {}
    for r in samples:
        groups.setdefault((r["measure"], r["seq_len"], r["variant"]), []).append(r["ms"])
    out = []
    for (measure, seq, variant), ms in sorted(groups.items()):
        q = quantiles(ms)
        row = {"measure": measure, "seq_len": seq, "variant": variant, **q}
        row["tokens_per_s"] = (1e3 / q["median_ms"] if measure == "decode"
                               else seq / (q["median_ms"] / 1e3) if measure == "prefill" else None)
        out.append(row)
    return out
