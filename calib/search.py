"""Greedy top-down alpha search: the paper's Algorithm 1 (arXiv 2507.01900), exactly.

All selected layers start pruned with alpha = 1. From the highest selected layer down, try every
grid value, keep the one with the lowest calibration perplexity (strictly lower wins, so ties keep
the earlier grid value), fix it and move to the next layer down.

The cached search gives the same answer faster:
- the hidden states entering the lowest selected layer ``lo`` do not depend on any alpha, so they
  are computed once per window;
- while layer l is searched, the state entering l is fixed (layers below are at alpha = 1 and
  layers above are not involved), so it is computed once per layer, and so is l's own V.O term;
  each candidate only re-scales that term and re-runs the MLP half of l, layers l+1..L-1 and the head.
``naive=True`` recomputes the full model per candidate (the reference for tests and the benchmark)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from harp_trt.families import FamilySpec
from harp_trt.harp import apply_harp, set_alpha, vo_output
from harp_trt.ppl import perplexity, window_nll

__all__ = ["SearchResult", "search_alphas", "DEFAULT_GRID"]

log = logging.getLogger(__name__)

DEFAULT_GRID: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))

# progress(layer, candidate_index, n_candidates, alpha, ppl)
Progress = Callable[[int, int, int, float, float], None]


@dataclass
class SearchResult:
    alphas: dict[int, float]
    ppl_alpha1: float
    ppl_searched: float
    trace: list[dict] = field(default_factory=list)   # one row per candidate tried
    seconds: float = 0.0


class _StopForward(Exception):
    pass


@torch.inference_mode()
def _capture(model, family: FamilySpec, windows: torch.Tensor, lo: int):
    """Per-layer call kwargs (mask, rotary embeddings...) and the input of layer ``lo`` per window.
    One window per forward, so the kwargs are identical for every window."""
    layers = family.layers(model)
    kwargs_of: dict[int, dict] = {}
    h_lo: list[torch.Tensor] = []

    def make(i):
        def hook(mod, args, kwargs):
            if i not in kwargs_of:
                kwargs_of[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            if i == lo:
                h_lo.append((args[0] if args else kwargs["hidden_states"]).clone())
                if len(kwargs_of) == len(layers):
                    raise _StopForward
            return None
        return hook

    hooks = [layer.register_forward_pre_hook(make(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for w in range(windows.shape[0]):
            try:
                model(input_ids=windows[w: w + 1], use_cache=False)
            except _StopForward:
                pass
    finally:
        for h in hooks:
            h.remove()
    return kwargs_of, h_lo


def _run_layers(layers, kwargs_of, h: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    for j in range(start, stop):
        out = layers[j](h, **kwargs_of[j])
        h = out[0] if isinstance(out, tuple) else out
    return h


@torch.inference_mode()
def search_alphas(model: torch.nn.Module, family: FamilySpec, windows: torch.Tensor,
                  layers_to_prune: Sequence[int], grid: Sequence[float] = DEFAULT_GRID,
                  naive: bool = False, progress: Progress | None = None) -> SearchResult:
    """Run Algorithm 1 on ``model`` (patched in place: on return it is the searched HARP model)."""
    t0 = time.perf_counter()
    selected = sorted(set(int(l) for l in layers_to_prune))
    apply_harp(model, {l: 1.0 for l in selected}, family)
    ppl1 = perplexity(model, windows)
    trace: list[dict] = []
    alphas = {l: 1.0 for l in selected}
    layers = family.layers(model)
    n_layers = len(layers)

    if not naive:
        lo = selected[0]
        kwargs_of, h_lo = _capture(model, family, windows, lo)

    best_ppl = ppl1
    for step, l in enumerate(reversed(selected)):
        if naive:
            def ppl_of(a: float) -> float:
                set_alpha(model, l, a, family)
                return perplexity(model, windows)
        else:
            h_l = [_run_layers(layers, kwargs_of, h, lo, l) for h in h_lo]  # lower layers at alpha=1
            vo = [vo_output(family, layers[l], h) for h in h_l]

            def ppl_of(a: float) -> float:
                total, count = 0.0, 0
                for w in range(len(h_l)):
                    h = family.mlp_residual(layers[l], h_l[w] + a * vo[w])
                    h = _run_layers(layers, kwargs_of, h, l + 1, n_layers)
                    s, n = window_nll(family.logits(model, h), windows[w: w + 1])
                    total, count = total + s, count + n
                return math.exp(total / count)

        best_a, best = None, math.inf
        for ci, a in enumerate(grid):
            tc = time.perf_counter()
            p = ppl_of(float(a))
            if p < best:  # strictly lower: ties keep the earlier grid value
                best_a, best = float(a), p
            trace.append({"step": step, "layer": l, "alpha": float(a), "ppl": p,
                          "best_alpha": best_a, "best_ppl": best, "seconds": time.perf_counter() - tc})
            if progress:
                progress(l, ci, len(grid), float(a), p)
        alphas[l] = best_a
        set_alpha(model, l, best_a, family)
        best_ppl = best
        log.info("layer %d: alpha=%.2f ppl=%.4f", l, best_a, best)
    return SearchResult(alphas, ppl1, best_ppl, trace, time.perf_counter() - t0)
