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
``naive=True`` recomputes the full model per candidate (the reference for tests and the benchmark).

Both paths work on a ``LayerStack``, so they run unchanged on a model that is resident, spread
over devices, or read one layer at a time from disk."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from harp_trt.families import FamilySpec
from harp_trt.harp import apply_harp, set_alpha, vo_output
from harp_trt.layerwise import LayerStack

__all__ = ["SearchResult", "search_alphas", "given_alphas", "DEFAULT_GRID"]

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


def _budget_bytes(stack: LayerStack) -> int:
    """How many bytes of candidate hidden states one pass may hold: a quarter of the free memory
    on the device, at most 4 GiB."""
    from harp_trt.device import available_memory

    return int(min(4 << 30, 0.25 * available_memory(str(stack.device))))


@torch.inference_mode()
def search_alphas(model: torch.nn.Module | LayerStack, family: FamilySpec, windows: torch.Tensor,
                  layers_to_prune: Sequence[int], grid: Sequence[float] = DEFAULT_GRID,
                  naive: bool = False, progress: Progress | None = None,
                  state_budget_bytes: int | None = None) -> SearchResult:
    """Run Algorithm 1 on ``model`` (a loaded HF model or a ``LayerStack``; patched in place: on
    return it is the searched HARP model).

    The cached path runs layer-outer: every grid candidate of layer l goes through each layer
    above l while that layer is resident, so a sequential stack reads each layer once per searched
    layer, and the numbers are those of the in-memory model exactly (same operations on the same
    inputs). Candidates are split into groups when their hidden states would exceed
    ``state_budget_bytes``."""
    t0 = time.perf_counter()
    stack = model if isinstance(model, LayerStack) else LayerStack.wrap(model, family)
    selected = sorted(set(int(l) for l in layers_to_prune))
    apply_harp(stack.model, {l: 1.0 for l in selected}, family)
    trace: list[dict] = []
    alphas = {l: 1.0 for l in selected}
    grid = [float(a) for a in grid]

    if naive:
        ppl1 = stack.perplexity(windows)
    else:
        lo = selected[0]
        cap = stack.capture(windows)
        h_lo = stack.run(cap.h0, cap, 0, lo)
        ppl1 = math.exp(_div(*stack.nll(stack.run(h_lo, cap, lo), windows)))
        per_candidate = sum(h.numel() * h.element_size() for h in h_lo)
        budget = state_budget_bytes if state_budget_bytes is not None else _budget_bytes(stack)
        group = max(1, min(len(grid), budget // max(1, per_candidate)))

    best_ppl = ppl1
    for step, l in enumerate(reversed(selected)):
        tl = time.perf_counter()
        if naive:
            ppls = []
            for a in grid:
                set_alpha(stack.model, l, a, family)
                ppls.append(stack.perplexity(windows))
        else:
            h_l = stack.run(h_lo, cap, lo, l)  # layers below l: alpha = 1 where selected
            ppls = []
            for g0 in range(0, len(grid), group):
                cands = grid[g0: g0 + group]
                with stack.layer(l) as layer:
                    vo = [vo_output(family, layer, h) for h in h_l]
                    states = [family.mlp_residual(layer, h + a * v) for a in cands for h, v in zip(h_l, vo)]
                    del vo
                states = stack.run(states, cap, l + 1)
                n_w = len(h_l)
                for c in range(len(cands)):
                    ppls.append(math.exp(_div(*stack.nll(states[c * n_w:(c + 1) * n_w], windows))))
                del states
        seconds = (time.perf_counter() - tl) / len(grid)
        best_a, best = None, math.inf
        for ci, (a, p) in enumerate(zip(grid, ppls)):
            if p < best:  # strictly lower: ties keep the earlier grid value
                best_a, best = a, p
            trace.append({"step": step, "layer": l, "alpha": a, "ppl": p,
                          "best_alpha": best_a, "best_ppl": best, "seconds": seconds})
            if progress:
                progress(l, ci, len(grid), a, p)
        alphas[l] = best_a
        set_alpha(stack.model, l, best_a, family)
        best_ppl = best
        log.info("layer %d: alpha=%.2f ppl=%.4f", l, best_a, best)
    return SearchResult(alphas, ppl1, best_ppl, trace, time.perf_counter() - t0)


@torch.inference_mode()
def given_alphas(stack: LayerStack, family: FamilySpec, windows: torch.Tensor, layers: Sequence[int],
                 alphas: Sequence[float]) -> SearchResult:
    """No search: HARP on ``layers`` with the given ``alphas`` (same order), and the calibration
    perplexity at alpha = 1 and at the given alphas (``--alphas`` / ``--paper-alphas``)."""
    t0 = time.perf_counter()
    chosen = dict(zip((int(l) for l in layers), (float(a) for a in alphas)))
    apply_harp(stack.model, {l: 1.0 for l in chosen}, family)
    ppl1 = stack.perplexity(windows)
    for l, a in chosen.items():
        set_alpha(stack.model, l, a, family)
    ppl = stack.perplexity(windows)
    trace = [{"step": 0, "layer": l, "alpha": a, "ppl": ppl, "best_alpha": a, "best_ppl": ppl, "seconds": 0.0}
             for l, a in sorted(chosen.items(), reverse=True)]
    return SearchResult(chosen, ppl1, ppl, trace, time.perf_counter() - t0)


def _div(total: float, count: int) -> float:
    return total / count
