"""Latency of a dense and a HARP engine measured side by side, with paired confidence intervals.

Both engines run in this process on the same inputs, *interleaved*: every repeat times the dense
and the HARP engine one after the other, alternating which goes first, so drift (thermal state,
other processes on a shared machine, allocator growth) hits both alike. Each shape is warmed up
before it is timed. What is measured:

* prefill: one forward pass over S prompt tokens (building the cache), per sequence length;
* generation of ``decode_tokens + 1`` output tokens for a batch of B identical-length requests at a
  context C (no padding needed), for B = 1 and every ``batch_sizes`` entry: time to first token
  (the batched prefill + the greedy pick), the ms of each following one-token decode step (the
  inter-token latency) and the end-to-end ms of the batch (``request``), from which output
  tokens/s and requests/s follow;
* KV cache: bytes measured on the cache tensors after the batch-1 generation, per token of context
  (per allocated position where the runtime allocates ahead: ``Engine.cache_tokens``).

Names and units follow genai-perf / trtllm-bench (``serving_figures``): ``time_to_first_token`` and
``inter_token_latency`` in ms with avg/p50/p90/p99, ``output_token_throughput`` in tokens/sec and
``request_throughput`` in requests/sec. Speed-ups carry a 95 % confidence interval from the
interleaved pairs (``paired_speedup``: Student-t on the log ratios, which covers 95 % at the 3-5
pairs a bench has where a percentile bootstrap covers 76-84 %)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from harp_trt.stats import t_quantile

from .engines import EnginePair

__all__ = ["LatencySettings", "random_ids", "rotation", "measure_prefill", "measure_generation", "quantiles", "summarise",
           "latency_stats", "paired_speedup", "paired_speedups", "serving_figures", "CI_METHOD"]

log = logging.getLogger(__name__)

CI_METHOD = ("95 % Student-t interval of the mean log ratio of per-repeat dense/HARP times (the point: their "
             "geometric mean)")


@dataclass(frozen=True)
class LatencySettings:
    """``batch_sizes``: request batches whose throughput is measured (batch 1 always runs: it gives
    the time-to-first-token and inter-token-latency headline)."""

    seq_lens: tuple[int, ...]
    decode_context: int
    decode_tokens: int
    warmup: int
    repeats: int
    seed: int = 0
    batch_sizes: tuple[int, ...] = ()

    def generation_batches(self) -> list[int]:
        return sorted({1, *(int(b) for b in self.batch_sizes)})


def _order(r: int) -> tuple[str, str]:
    return ("dense", "harp") if r % 2 == 0 else ("harp", "dense")


def rotation(names: list[str], r: int) -> list[str]:
    """``names`` rotated by ``r``: in interleaved repeats each engine goes first in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


def random_ids(vocab: int, n: int, seed: int, batch: int = 1) -> torch.Tensor:
    """``[batch, n]`` token ids drawn with ``seed`` from 3 up to half the vocabulary (no special
    tokens, which sit at either end of most vocabularies): the prompts every timing here and in
    ``bench/long_context.py`` runs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(4, vocab // 2), (batch, n), generator=g)


def measure_prefill(pair: EnginePair, s: LatencySettings,
                    progress: Callable[[str], None] | None = None) -> list[dict]:
    """Raw samples: one row per (sequence length, repeat, variant) with ``ms``."""
    rows: list[dict] = []
    engines = pair.engines()
    for seq in s.seq_lens:
        ids = random_ids(pair.dims.vocab, seq, s.seed + seq)
        for w in range(s.warmup):
            for v in _order(w):
                engines[v].prefill(ids)
        for r in range(s.repeats):
            for v in _order(r):
                t0 = time.perf_counter()
                engines[v].prefill(ids)
                rows.append({"measure": "prefill", "variant": v, "seq_len": seq, "batch_size": 1, "repeat": r,
                             "step": 0, "ms": (time.perf_counter() - t0) * 1e3})
        if progress:
            progress(f"prefill {seq} tokens: dense {_median(rows, 'dense', seq):.1f} ms, "
                     f"harp {_median(rows, 'harp', seq):.1f} ms")
    return rows


def _median(rows, variant, seq) -> float:
    return float(np.median([r["ms"] for r in rows if r["variant"] == variant and r["seq_len"] == seq]))


def _generate(engine, ids: torch.Tensor, steps: int) -> tuple[float, list[float], float, int, int | None]:
    """(ms to first token, ms of each later step, end-to-end ms, cache bytes at the end, token
    positions those bytes cover or None for the tokens held: ``Engine.cache_tokens``). Greedy."""
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
    e2e = (time.perf_counter() - t0) * 1e3
    return ttft, step_ms, e2e, engine.cache_bytes(state), engine.cache_tokens(state)


def measure_generation(pair: EnginePair, s: LatencySettings,
                       progress: Callable[[str], None] | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Raw samples (``ttft``, ``decode`` and ``request`` rows, per batch size) and per-variant
    cache figures of the batch-1 run ``{variant: {"cache_bytes", "cache_tokens", "kv_bytes_per_token"}}``."""
    rows: list[dict] = []
    cache: dict[str, dict] = {}
    engines = pair.engines()
    for b in s.generation_batches():
        ids = random_ids(pair.dims.vocab, s.decode_context, s.seed + 7, batch=b)
        t_batch = time.perf_counter()
        for w in range(s.warmup):
            for v in _order(w):
                _generate(engines[v], ids, min(2, s.decode_tokens))
        for r in range(s.repeats):
            for v in _order(r):
                ttft, steps, e2e, nbytes, slots = _generate(engines[v], ids, s.decode_tokens)
                base = {"variant": v, "seq_len": s.decode_context, "batch_size": b, "repeat": r}
                rows.append({"measure": "ttft", **base, "step": 0, "ms": ttft})
                rows += [{"measure": "decode", **base, "step": i + 1, "ms": ms} for i, ms in enumerate(steps)]
                rows.append({"measure": "request", **base, "step": 0, "ms": e2e})
                if b == 1:  # a runtime that allocates ahead reports the positions it allocated
                    tokens = slots or s.decode_context + s.decode_tokens
                    cache[v] = {"cache_bytes": nbytes, "cache_tokens": tokens, "kv_bytes_per_token": nbytes / tokens}
        if progress:
            med = {v: np.median([x["ms"] for x in rows if x["measure"] == "decode" and x["variant"] == v
                                 and x["batch_size"] == b]) for v in ("dense", "harp")}
            progress(f"decode at {s.decode_context} tokens, batch {b}: dense {med['dense']:.2f} ms/step, "
                     f"harp {med['harp']:.2f} ms/step ({time.perf_counter() - t_batch:.1f} s)")
    return rows, cache


def quantiles(ms) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"median_ms": float(np.median(a)), "p90_ms": float(np.quantile(a, 0.9)),
            "p99_ms": float(np.quantile(a, 0.99)), "mean_ms": float(a.mean()),
            "min_ms": float(a.min()), "n": int(a.size)}


def _steps_per_request(samples: list[dict], seq: int, batch: int, variant: str) -> int:
    """Decode steps of one generation (repeat 0): its output tokens are this + 1."""
    return sum(1 for r in samples if r["measure"] == "decode" and r["seq_len"] == seq
               and r.get("batch_size", 1) == batch and r["variant"] == variant and r["repeat"] == 0)


def summarise(samples: list[dict]) -> list[dict]:
    """One row per (measure, seq_len, batch_size, variant) with the quantiles of its samples and
    tokens/s: prompt tokens per second (prefill), output tokens per second of the batch (decode
    steps and end-to-end requests)."""
    groups: dict[tuple, list[float]] = {}
    for r in samples:
        groups.setdefault((r["measure"], r["seq_len"], r.get("batch_size", 1), r["variant"]), []).append(r["ms"])
    out = []
    for (measure, seq, batch, variant), ms in sorted(groups.items()):
        q = quantiles(ms)
        row = {"measure": measure, "seq_len": seq, "batch_size": batch, "variant": variant, **q}
        if measure == "prefill":
            row["tokens_per_s"] = batch * seq / (q["median_ms"] / 1e3)
        elif measure == "decode":
            row["tokens_per_s"] = batch * 1e3 / q["median_ms"]
        elif measure == "request":
            tokens = batch * (_steps_per_request(samples, seq, batch, variant) + 1)
            row["tokens_per_s"] = tokens / (q["median_ms"] / 1e3)
        else:
            row["tokens_per_s"] = None
        out.append(row)
    return out


# ---- statistics -------------------------------------------------------------------------------
def latency_stats(values: Iterable[float], unit: str = "ms") -> dict[str, object]:
    """genai-perf's statistics of one metric: avg, p50/p90/p99 (numpy's linear interpolation, as
    genai-perf), min, max, std, n."""
    a = np.asarray(list(values), dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"unit": unit, "avg": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "min": float(a.min()), "max": float(a.max()), "std": float(a.std()), "n": int(a.size)}


def paired_speedup(dense_ms: Iterable[float], harp_ms: Iterable[float]) -> dict[str, float | int | str]:
    """Speed-up dense/HARP with a 95 % confidence interval from interleaved pairs.

    ``dense_ms[i]`` and ``harp_ms[i]`` are the times of pair i (one repeat, run back to back). The
    statistic is the *geometric mean of the paired ratios* ``dense_ms[i] / harp_ms[i]``; the interval
    is Student's t on the log ratios, exp(mean +- t(0.975, n-1) * sd / sqrt(n)). Why pairs: a pair
    shares the machine state of its moment, so its ratio cancels drift that a ratio of medians keeps;
    why logs: a speed-up and the matching slow-down are symmetric, and timing noise is
    multiplicative. Why t and not a percentile bootstrap: with n pairs a bootstrap's interval cannot
    be wider than the sample's spread, so it covers about 76 % at 3 pairs and 84 % at 5 instead of 95 %
    (``tests/test_bench_stats.py`` measures both by simulation); t widens with few pairs as it should.
    The interval covers repeat-to-repeat noise of this run only, not run-to-run spread; with one pair
    there is none (low = high = the point)."""
    d = np.asarray(list(dense_ms), dtype=np.float64)
    h = np.asarray(list(harp_ms), dtype=np.float64)
    if d.shape != h.shape or d.size == 0:
        raise ValueError(f"paired_speedup needs equally many dense and HARP times, got {d.size} and {h.size}")
    logs = np.log(d / h)
    point = float(np.exp(logs.mean()))
    if logs.size == 1:
        return {"speedup": point, "speedup_ci95_low": point, "speedup_ci95_high": point, "pairs": 1}
    half = t_quantile(0.975, logs.size - 1) * logs.std(ddof=1) / np.sqrt(logs.size)
    return {"speedup": point, "speedup_ci95_low": float(np.exp(logs.mean() - half)),
            "speedup_ci95_high": float(np.exp(logs.mean() + half)), "pairs": int(logs.size)}


def _per_repeat(samples: list[dict], measure: str) -> dict[tuple[int, int], dict[str, dict[int, float]]]:
    """{(seq_len, batch_size): {variant: {repeat: ms}}}; decode steps reduce to their median per
    repeat (one inter-token latency per generation)."""
    acc: dict[tuple[int, int], dict[str, dict[int, list[float]]]] = {}
    for r in samples:
        if r["measure"] == measure:
            acc.setdefault((r["seq_len"], r.get("batch_size", 1)), {}).setdefault(
                r["variant"], {}).setdefault(r["repeat"], []).append(r["ms"])
    return {k: {v: {rep: float(np.median(ms)) for rep, ms in reps.items()} for v, reps in by.items()}
            for k, by in acc.items()}


def paired_speedups(samples: list[dict]) -> dict[tuple[str, int, int], dict]:
    """``paired_speedup`` of every (measure, seq_len, batch_size) with dense and HARP samples,
    pairing the two variants' runs of the same repeat."""
    out = {}
    for measure in sorted({r["measure"] for r in samples}):
        for (seq, batch), by in sorted(_per_repeat(samples, measure).items()):
            d, h = by.get("dense", {}), by.get("harp", {})
            reps = sorted(set(d) & set(h))
            if reps:
                out[(measure, seq, batch)] = paired_speedup([d[r] for r in reps], [h[r] for r in reps])
    return out


def serving_figures(samples: list[dict], batch_sizes: Iterable[int]) -> dict[str, dict]:
    """Per-variant figures in genai-perf's names and units: ``time_to_first_token`` and
    ``inter_token_latency`` (ms) of batch 1, and per batch size B in ``batch_sizes`` its
    ``output_token_throughput`` (tokens/sec), ``request_throughput`` (requests/sec), TTFT, ITL and
    ``request_latency`` (ms). Throughput ``avg`` is total output tokens (requests) over total time,
    as genai-perf computes it; p50/min/max are over the timed runs (one batch each)."""
    def pick(measure, batch, variant):
        return [r for r in samples if r["measure"] == measure and r.get("batch_size", 1) == batch
                and r["variant"] == variant]

    out: dict[str, dict] = {"time_to_first_token": {}, "inter_token_latency": {}, "throughput": {}}
    for v in ("dense", "harp"):
        for key, measure in (("time_to_first_token", "ttft"), ("inter_token_latency", "decode")):
            ms = [r["ms"] for r in pick(measure, 1, v)]
            if ms:
                out[key][v] = latency_stats(ms)
    for b in sorted({int(x) for x in batch_sizes}):
        entry: dict[str, object] = {}
        for v in ("dense", "harp"):
            req = pick("request", b, v)
            if not req:
                continue
            seq = req[0]["seq_len"]
            tokens = b * (_steps_per_request(samples, seq, b, v) + 1)
            sec = np.asarray([r["ms"] for r in req]) / 1e3
            entry.update({"batch_size": b, "input_tokens": seq, "output_tokens": tokens // b})
            entry[v] = {
                "output_token_throughput": _throughput(tokens / sec, tokens * sec.size / sec.sum(), "tokens/sec"),
                "request_throughput": _throughput(b / sec, b * sec.size / sec.sum(), "requests/sec"),
                "time_to_first_token": latency_stats(r["ms"] for r in pick("ttft", b, v)),
                "inter_token_latency": latency_stats(r["ms"] for r in pick("decode", b, v)),
                "request_latency": latency_stats(r["ms"] for r in req),
            }
        if "dense" in entry and "harp" in entry:
            out["throughput"][str(b)] = entry
    return out


def _throughput(per_run: np.ndarray, avg: float, unit: str) -> dict[str, object]:
    return {"unit": unit, "avg": float(avg), "p50": float(np.median(per_run)), "min": float(per_run.min()),
            "max": float(per_run.max()), "n": int(per_run.size)}
