"""Greedy top-down alpha search: the paper's Algorithm 1 (arXiv 2507.01900).

All selected layers start pruned with alpha = 1. From the highest selected layer down, try the
grid values, keep the one with the lowest calibration perplexity (strictly lower wins, so ties keep
the earlier grid value), fix it and move to the next layer down.

``method="exhaustive"`` (the paper) tries every grid value. ``method="golden"`` is a golden-section
search over the sorted grid that assumes perplexity is unimodal in alpha; whenever the values it has
seen contradict that (an interior probe above both of its neighbours), it evaluates the rest of the
grid and answers as the exhaustive search would. A second valley that no probe lands in goes
unseen, so golden can differ from exhaustive on a curve that is not unimodal. It needs about
half the evaluations on an 11-value grid; the trace says how many it used and whether it fell back.

The cached evaluation gives the naive answer faster:
- the hidden states entering the lowest selected layer ``lo`` do not depend on any alpha, so they
  are computed once per window;
- while layer l is searched, the state entering l is fixed (layers below are at alpha = 1 and
  layers above are not involved), so it is computed once per layer, and so is l's own V.O term;
  each candidate only re-scales that term and re-runs the MLP half of l, layers l+1..L-1 and the head;
- the candidates of one window go through the layers above and the LM head as one batch, so the
  GEMMs (the head's above all: on small models it is most of the time) run at a larger M.
``naive=True`` recomputes the full model per candidate (the reference for tests and the benchmark).

Both paths work on a ``LayerStack``, so they run unchanged on a model that is resident, spread
over devices, or read one layer at a time from disk.

With fitted maps (``calib.fit``) the search starts from the state the maps were fitted under (every
selected layer carrying its map) instead of alpha = 1 everywhere, a state no final plan has. Each
layer, top-down, gets its grid searched on the fit text with HARP's V.O back in place; then its best
alpha and its map are compared on the select text, which neither was fitted on, and the lower of
the two is installed. The held-out text is evaluated beside (reported, never read by a decision)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from harp_trt.errors import ConfigError

from .config import DEFAULT_GRID, METHODS
from harp_trt.families import FamilySpec
from harp_trt.harp import apply_harp, set_alpha, vo_output
from harp_trt.layerwise import LayerStack

__all__ = ["SearchResult", "Fitted", "FIT", "search_alphas", "given_alphas", "golden_search", "fitted_output"]

log = logging.getLogger(__name__)


FIT = "fit"  # the fitted-map candidate of a layer (beside its alphas)


@dataclass(frozen=True)
class Fitted:
    """A layer's fitted candidate: the map (``calib.fit.FittedMap``) and the checkpoint tensors
    that carry it (``calib.fit.hf_tensors``)."""

    map: Any
    tensors: Mapping[str, torch.Tensor]


# progress(layer, candidate_index, n_candidates, alpha, ppl)
Progress = Callable[[int, int, int, float, float], None]
# evaluate(alphas) -> perplexities, in the same order
Evaluate = Callable[[Sequence[float]], list[float]]


@dataclass
class SearchResult:
    alphas: dict[int, float]
    ppl_alpha1: float
    ppl_searched: float
    trace: list[dict] = field(default_factory=list)   # one row per candidate evaluated
    seconds: float = 0.0
    method: str = "exhaustive"
    evaluations: dict[int, int] = field(default_factory=dict)   # layer -> candidates evaluated
    fallbacks: list[int] = field(default_factory=list)          # layers where golden fell back to the grid
    fitted: list[int] = field(default_factory=list)             # layers where the fitted map beat the grid
    decisions: dict[int, dict] = field(default_factory=dict)    # layer -> map-or-alpha figures per text
    ppl_select: float = math.nan                                # the final state on the select text


def _budget_bytes(stack: LayerStack) -> int:
    """How many bytes of candidate hidden states one pass may hold: a quarter of the free memory
    on the device, at most 4 GiB."""
    from harp_trt.device import available_memory

    return int(min(4 << 30, 0.25 * available_memory(str(stack.device))))


def _first_min(values: dict[int, float]) -> int:
    """Index of the lowest value; ties go to the lowest index (the earlier grid value)."""
    best_i, best = -1, math.inf
    for i in sorted(values):
        if values[i] < best:
            best_i, best = i, values[i]
    return best_i


def _unimodal(values: dict[int, float]) -> bool:
    """True when the values seen, in index order, never rise and then fall again (no interior
    probe above both of its neighbours among the probes)."""
    seq = [values[i] for i in sorted(values)]
    rising = False
    for a, b in zip(seq, seq[1:]):
        if b > a:
            rising = True
        elif b < a and rising:
            return False
    return True


def golden_search(grid: Sequence[float], evaluate: Evaluate) -> tuple[float, dict[float, float], bool]:
    """Golden-section search for the grid value with the lowest perplexity, assuming unimodality;
    falls back to every grid value when the probes contradict it. Returns (best alpha, every
    value evaluated -> perplexity, fell back)."""
    xs = sorted(set(float(a) for a in grid))
    seen: dict[int, float] = {}

    def f(*idx: int) -> None:
        todo = [i for i in dict.fromkeys(idx) if i not in seen]
        if todo:
            seen.update(zip(todo, evaluate([xs[i] for i in todo])))

    lo, hi = 0, len(xs) - 1
    r = (3 - math.sqrt(5)) / 2  # 0.382: the golden section
    while hi - lo > 2:
        a = lo + max(1, round(r * (hi - lo)))
        b = hi - max(1, round(r * (hi - lo)))
        if b <= a:
            b = a + 1
        f(a, b)  # a first round probes both at once; later rounds reuse one of them
        if seen[a] <= seen[b]:  # ties keep the lower alpha, as the exhaustive search does
            hi = b
        else:
            lo = a
    f(*range(lo, hi + 1))
    fell_back = not _unimodal(seen)
    if fell_back:
        f(*range(len(xs)))
    best = _first_min(seen)
    return xs[best], {xs[i]: p for i, p in seen.items()}, fell_back


@torch.inference_mode()
def search_alphas(model: torch.nn.Module | LayerStack, family: FamilySpec, windows: torch.Tensor,
                  layers_to_prune: Sequence[int], grid: Sequence[float] = DEFAULT_GRID,
                  naive: bool = False, progress: Progress | None = None,
                  state_budget_bytes: int | None = None, method: str = "exhaustive",
                  fitted: Mapping[int, Fitted] | None = None, select: torch.Tensor | None = None,
                  report: torch.Tensor | None = None) -> SearchResult:
    """Run Algorithm 1 on ``model`` (a loaded HF model or a ``LayerStack``; patched in place: on
    return it is the searched HARP model).

    The cached path runs layer-outer: the candidates of layer l go through each layer above l
    while that layer is resident, so a sequential stack reads each layer once per evaluation
    round, and the numbers are those of the in-memory model to float rounding (batched GEMMs
    may round differently; tests hold them to 1e-5 relative). Candidates are split into groups
    when their states would exceed ``state_budget_bytes``.

    ``fitted`` (layer -> ``Fitted``: a map and the checkpoint tensors that carry it, ``calib.fit``,
    installed in the model by ``fit_candidates``) adds one candidate to those layers: the fitted
    map, unscaled. It is kept only where its perplexity on ``select`` (windows of a text neither
    the map nor the alphas were fitted on) is strictly lower than the best grid value's there;
    ``report`` (held-out windows) is evaluated beside, for the record only."""
    fitted = _checked(method, naive, dict(fitted or {}), select)
    t0 = time.perf_counter()
    stack = model if isinstance(model, LayerStack) else LayerStack.wrap(model, family)
    selected = sorted(set(int(l) for l in layers_to_prune))
    apply_harp(stack.model, {l: 1.0 for l in selected}, family)
    grid = [float(a) for a in grid]
    res = SearchResult({l: 1.0 for l in selected}, math.nan, math.nan, method=method)
    budget = state_budget_bytes if state_budget_bytes is not None else _budget_bytes(stack)

    if naive:
        res.ppl_alpha1 = stack.perplexity(windows)
    else:
        lo = selected[0]
        cap = stack.capture(windows)
        h_lo = stack.run(cap.h0, cap, 0, lo)
        res.ppl_alpha1 = math.exp(_div(*stack.nll(stack.run(h_lo, cap, lo), windows)))
        texts = {name: _entering(stack, w, lo) for name, w in (("select", select), ("heldout", report))
                 if fitted and w is not None}

    for step, l in enumerate(reversed(selected)):
        tl = time.perf_counter()
        if naive:
            def evaluate(cands: Sequence[float], l: int = l) -> list[float]:
                out = []
                for a in cands:
                    set_alpha(stack.model, l, a, family)
                    out.append(stack.perplexity(windows))
                return out
        else:
            if l in fitted:
                stack.remove_fitted(l)  # the grid scales HARP's own V.O
            h_l = stack.run(h_lo, cap, lo, l)  # layers below l: alpha = 1, or their maps, where selected
            evaluate = _cached_evaluator(stack, family, cap, windows, l, h_l, budget, fitted.get(l))
        if method == "golden":
            best_a, seen, fell_back = golden_search(grid, evaluate)
            tried = [a for a in grid if a in seen]
            ppls = [seen[a] for a in tried]
            if fell_back:
                res.fallbacks.append(l)
        else:
            tried, ppls = grid, evaluate(grid)
        seconds = (time.perf_counter() - tl) / len(tried)
        best_a, best = _record_grid(res, step, l, tried, ppls, seconds, progress)
        res.alphas[l] = best_a
        res.evaluations[l] = len(tried)
        set_alpha(stack.model, l, best_a, family)
        if l in fitted:
            best = _choose_fitted(stack, res, l, step, fitted[l], evaluate, best, seconds, texts, lo, budget)
        res.ppl_searched = best
        log.info("layer %d: alpha=%.2f ppl=%.4f (%d evaluations)", l, best_a, best, len(tried))
    if not selected:
        res.ppl_searched = res.ppl_alpha1
    res.seconds = time.perf_counter() - t0
    return res


def _checked(method: str, naive: bool, fitted: dict, select) -> dict:
    if method not in METHODS:
        raise ConfigError(f"search method must be one of {', '.join(METHODS)}, got {method!r}")
    if fitted and naive:
        raise ConfigError("the naive search has no fitted candidate; drop --replacement or the naive reference")
    if fitted and select is None:
        raise ConfigError("a fitted candidate is chosen on the select text; pass its windows (select=)")
    return fitted


def _entering(stack: LayerStack, windows: torch.Tensor, lo: int) -> tuple:
    """(captured prelude, states entering layer ``lo``, windows) of one more text."""
    cap = stack.capture(windows)
    return cap, stack.run(cap.h0, cap, 0, lo), windows


def _record_grid(res: SearchResult, step: int, l: int, tried, ppls, seconds: float,
                 progress: Progress | None) -> tuple[float, float]:
    """The trace rows of layer ``l``'s grid and its best (alpha, perplexity): strictly lower wins,
    so ties keep the earlier grid value."""
    best_a, best = None, math.inf
    for ci, (a, p) in enumerate(zip(tried, ppls)):
        if p < best:
            best_a, best = a, p
        res.trace.append({"step": step, "layer": l, "candidate": "harp", "alpha": a, "ppl": p,
                          "best_alpha": best_a, "best_ppl": best, "seconds": seconds})
        if progress:
            progress(l, ci, len(tried), a, p)
    return best_a, best


def _choose_fitted(stack: LayerStack, res: SearchResult, l: int, step: int, fitted: Fitted, evaluate: Evaluate,
                   best: float, seconds: float, texts: dict, lo: int, budget: int) -> float:
    """Layer ``l``'s map or its best alpha: both evaluated on the fit text (in-sample, recorded),
    on the select text (the decision: the map only where strictly lower) and on the held-out text
    (recorded, never read here). Installs the winner; returns the layer's fit-text perplexity."""
    a = res.alphas[l]
    figures = {"fit": {"alpha": best, "map": evaluate([FIT])[0]}}
    for name, (cap, h_lo, windows) in texts.items():
        h_l = stack.run(h_lo, cap, lo, l)
        ev = _cached_evaluator(stack, stack.family, cap, windows, l, h_l, budget, fitted)
        p_alpha, p_map = ev([a, FIT])
        figures[name] = {"alpha": p_alpha, "map": p_map}
    won = figures["select"]["map"] < figures["select"]["alpha"]
    res.decisions[l] = {"alpha": a, "kept": "map" if won else "alpha", **figures}
    res.ppl_select = figures["select"]["map" if won else "alpha"]
    p_fit = figures["fit"]["map"]
    res.trace.append({"step": step, "layer": l, "candidate": fitted.map.method, "alpha": 1.0, "ppl": p_fit,
                      "best_alpha": 1.0 if won else a, "best_ppl": p_fit if won else best, "seconds": seconds})
    log.info("layer %d: fitted %s select ppl %.4f vs alpha %.2f %.4f (%s)", l, fitted.map.method,
             figures["select"]["map"], a, figures["select"]["alpha"], "kept" if won else "not kept")
    if not won:
        return best
    res.alphas[l] = 1.0
    res.fitted.append(l)
    set_alpha(stack.model, l, 1.0, stack.family)
    stack.install_fitted(l, fitted.tensors)
    return p_fit


def _cached_evaluator(stack: LayerStack, family: FamilySpec, cap, windows: torch.Tensor, l: int,
                      h_l: list[torch.Tensor], budget: int, fitted: "Fitted | None" = None) -> Evaluate:
    """Perplexity of each candidate of layer ``l`` (an alpha, or ``FIT``: the fitted map), from the
    fixed state ``h_l`` entering it."""
    per_candidate = sum(h.numel() * h.element_size() for h in h_l)
    group = max(1, budget // max(1, per_candidate))
    with stack.layer(l) as layer:
        vo = [vo_output(family, layer, h) for h in h_l]
        fit = [fitted_output(family, layer, h, fitted.map) for h in h_l] if fitted is not None else None

    def term(w: int, h: torch.Tensor, a) -> torch.Tensor:
        return h + fit[w] if a is FIT else h + a * vo[w]

    def evaluate(cands: Sequence[float]) -> list[float]:
        ppls: list[float] = []
        for g0 in range(0, len(cands), group):
            part = list(cands[g0: g0 + group])
            # one batch per window: [candidates, S, D]
            with stack.layer(l) as layer:
                states = [family.mlp_residual(layer, torch.cat([term(w, h, a) for a in part]))
                          for w, h in enumerate(h_l)]
            states = stack.run(states, cap, l + 1)
            totals = torch.zeros(len(part), dtype=torch.float64)
            count = 0
            for w, x in enumerate(states):
                s, n = stack.nll_each(x, windows[w: w + 1], budget)
                totals += s
                count += n
            del states
            ppls.extend(math.exp(float(t) / count) for t in totals)
        return ppls

    return evaluate


def fitted_output(family: FamilySpec, layer: torch.nn.Module, h: torch.Tensor, fmap) -> torch.Tensor:
    """The fitted map's contribution to the residual stream, where HARP's V.O term goes (after
    Gemma2's post-attention norm, which follows the fitted pre-norm output as it follows V.O)."""
    x = layer.input_layernorm(h)
    out = fmap.apply(x).to(h.dtype)
    if family.alpha_after_post_attn_norm:
        norm = layer.post_attention_layernorm
        out = getattr(norm, "norm", norm)(out)
    return out


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
    return SearchResult(chosen, ppl1, ppl, trace, time.perf_counter() - t0, method="given",
                        evaluations={l: 0 for l in chosen})


def _div(total: float, count: int) -> float:
    return total / count
