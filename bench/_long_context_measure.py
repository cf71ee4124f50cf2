"""Measurements of ``bench/long_context.py``: interleaved decode and prefill timings of a dense and a
HARP engine (and optional peers) of one runtime, and the KV capacity of a fixed budget measured by
allocating it. The statistics are ``harp_trt.bench.stage.latency``'s (``paired_speedup``, ``latency_stats``).

Decode at a context C and batch B: every engine prefills a prompt of C - (warmup + repeats x steps)
tokens per sequence once (untimed), runs ``warmup`` untimed steps, then ``repeats`` rounds in which
each engine, in an order that rotates every round, times ``steps`` one-token decode steps, so the
last timed step attends to exactly C positions (a model of C positions is timed at C). A round's
median step time is one inter-token latency per engine; the rounds pair dense and HARP for the
speed-up's 95 % interval. An engine with ``replicate(state, batch)`` (our ORT engine) prefills one
row and copies its KV cache into every row: a step's cost depends on the cache's length, not on
what it holds, and a B x C prefill is the costliest part of a long-context run. ``kv_fill="written"``
goes further (an engine with ``written_state``: our ORT and llama.cpp engines): no prefill at all, the cache of
C - (warmup + repeats x steps) positions written directly with random values; the first token is 0."""
from __future__ import annotations

import gc
import time
from typing import Any, Callable

import numpy as np
import torch

from harp_trt.bench.stage.latency import latency_stats, paired_speedup, random_ids, rotation

__all__ = ["prompt_length", "measure_decode", "measure_prefill", "largest_fit", "KV_FILLS"]


def _step(engine, tok: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any, float]:
    t = time.perf_counter()
    logits, state = engine.decode(tok, state)
    ms = (time.perf_counter() - t) * 1e3
    return logits.argmax(-1, keepdim=True), state, ms


def prompt_length(context: int, warmup: int, repeats: int, steps: int) -> int:
    """The prompt that leaves ``context`` positions at the last timed step (ConfigError if none)."""
    prompt = context - warmup - repeats * steps
    if prompt < 1:
        from harp_trt.errors import ConfigError

        raise ConfigError(f"context {context} holds no prompt before {warmup} warm-up and {repeats} x {steps} "
                          "timed steps", "give a longer --contexts or fewer --repeats / --decode-steps")
    return prompt


KV_FILLS = ("prefill", "written")   # how a decode point's cache is filled before its timed steps


def measure_decode(engines: dict[str, Any], vocab: int, context: int, batch: int, steps: int, repeats: int,
                   warmup: int, seed: int = 0, kv_fill: str = "prefill") -> dict[str, Any]:
    """Decode figures of every engine at ``context`` x ``batch`` (see the module docstring):
    ``{"per_engine": {name: {"tokens_per_s", "itl": latency_stats, "kv_bytes", "kv_tokens"}},
    "speedup": paired_speedup (dense/HARP), "peer_ratio": {peer: dense-ms / peer-ms},
    "vs_harp": {peer: harp-ms / peer-ms}}``."""
    if kv_fill not in KV_FILLS:
        raise ValueError(f"kv_fill must be one of {KV_FILLS}, got {kv_fill!r}")
    prompt = prompt_length(context, warmup, repeats, steps)
    ids = random_ids(vocab, prompt, seed + context, batch=batch)
    names = list(engines)
    replicated = sorted(n for n in names if batch > 1 and hasattr(engines[n], "replicate"))
    live: dict[str, tuple[torch.Tensor, Any]] = {}
    if kv_fill == "written":
        missing = [n for n in names if not hasattr(engines[n], "written_state")]
        if missing:
            from harp_trt.errors import ConfigError

            raise ConfigError(f"--kv-fill written: {', '.join(missing)} cannot have its KV cache written directly "
                              "(our ORT and llama.cpp engines can)", "use --kv-fill prefill for this runtime")
    for n in names:
        e = engines[n]
        if kv_fill == "written":
            state = e.written_state(batch, prompt, seed + context)
            logits = torch.zeros((batch, vocab))
        elif n in replicated:
            logits, state = e.prefill(ids[:1])
            logits, state = logits.expand(batch, -1), e.replicate(state, batch)
        else:
            logits, state = e.prefill(ids)
        live[n] = (logits.argmax(-1, keepdim=True), state)
    for n in names:
        tok, state = live[n]
        for _ in range(warmup):
            tok, state, _ = _step(engines[n], tok, state)
        live[n] = (tok, state)
    rounds: dict[str, list[float]] = {n: [] for n in names}
    every: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in rotation(names, r):
            tok, state = live[n]
            ms = []
            for _ in range(steps):
                tok, state, m = _step(engines[n], tok, state)
                ms.append(m)
            live[n] = (tok, state)
            rounds[n].append(float(np.median(ms)))
            every[n] += ms
    out: dict[str, Any] = {"context": context, "batch": batch, "steps_per_round": steps, "rounds": repeats,
                           "prompt": prompt, "timed_positions": [prompt + warmup + 1, context],
                           "replicated": replicated if kv_fill == "prefill" else [], "kv_fill": kv_fill,
                           "per_engine": {}}
    for n in names:
        state = live[n][1]
        nbytes, slots = engines[n].cache_bytes(state), engines[n].cache_tokens(state)
        out["per_engine"][n] = {"tokens_per_s": batch * 1e3 / float(np.median(every[n])),
                                "itl": latency_stats(every[n]), "kv_bytes": int(nbytes),
                                "kv_tokens": int(slots) if slots else batch * context}
    out["speedup"] = paired_speedup(rounds["dense"], rounds["harp"])
    out["peer_ratio"] = {n: paired_speedup(rounds["dense"], rounds[n])
                         for n in names if n not in ("dense", "harp")}
    # each peer against the HARP engine (harp-ms / peer-ms): 1 = as fast (--peer-plan: another plan's engine)
    out["vs_harp"] = {n: paired_speedup(rounds["harp"], rounds[n]) for n in names if n not in ("dense", "harp")}
    del live
    gc.collect()
    return out


def measure_prefill(engines: dict[str, Any], vocab: int, seq: int, repeats: int, warmup: int,
                    seed: int = 0) -> dict[str, Any]:
    """Seconds of one batch-1 prefill of ``seq`` tokens per engine, interleaved with a rotating
    order; the speed-up pairs each round's dense and HARP times."""
    ids = random_ids(vocab, seq, seed + seq)
    names = list(engines)
    for w in range(warmup):
        for n in rotation(names, w):
            engines[n].prefill(ids)
    ms: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in rotation(names, r):
            t = time.perf_counter()
            _, state = engines[n].prefill(ids)
            ms[n].append((time.perf_counter() - t) * 1e3)
            del state
    return {"seq_len": seq, "per_engine": {n: {"seconds": float(np.median(v)) / 1e3, "ms": latency_stats(v)}
                                           for n, v in ms.items()},
            "speedup": paired_speedup(ms["dense"], ms["harp"])}


def largest_fit(alloc: Callable[[int], int], budget: int, step: int) -> dict[str, int]:
    """The most tokens (a multiple of ``step``) whose allocation fits ``budget`` bytes.
    ``alloc(n)`` allocates a KV cache for ``n`` tokens in the runtime, frees it and returns the
    bytes the runtime reported; sizes are probed doubling, then by bisection (the runtime's size
    must grow with n, which every per-token cache does)."""
    if alloc(step) > budget:
        return {"tokens": 0, "bytes": 0, "probes": 1}
    lo, probes = 1, 1
    hi = 2
    while True:
        probes += 1
        if alloc(hi * step) > budget:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        probes += 1
        if alloc(mid * step) <= budget:
            lo = mid
        else:
            hi = mid
    return {"tokens": lo * step, "bytes": alloc(lo * step), "probes": probes + 1}
