"""Algorithm 1: cached search == naive search; tie-breaking; trace shape."""
from __future__ import annotations

import pytest
import torch

from harp_trt.calib.search import search_alphas
from conftest import make_tiny
from harp_trt.families import family_of
from harp_trt.harp import harp_alphas
from harp_trt.ppl import perplexity


def _windows(n=3, s=24, seed=1):
    return torch.randint(0, 128, (n, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_cached_equals_naive(family):
    w = _windows()
    a, b = make_tiny(family), make_tiny(family)
    fam = family_of(a.config)
    ra = search_alphas(a, fam, w, [0, 2, 3], naive=False)
    rb = search_alphas(b, fam, w, [0, 2, 3], naive=True)
    assert ra.alphas == rb.alphas
    assert abs(ra.ppl_searched / rb.ppl_searched - 1) < 1e-5
    for x, y in zip(ra.trace, rb.trace):
        assert (x["layer"], x["alpha"]) == (y["layer"], y["alpha"])
        assert abs(x["ppl"] / y["ppl"] - 1) < 1e-5
    # the model is left as the searched HARP model
    assert harp_alphas(a, fam) == ra.alphas
    assert abs(perplexity(a, w) / ra.ppl_searched - 1) < 1e-5


def test_trace_is_top_down_over_the_grid():
    grid = (0.0, 0.5, 1.0)
    res = search_alphas(make_tiny("qwen2"), family_of(make_tiny("qwen2").config), _windows(), [1, 3], grid)
    assert [(r["layer"], r["alpha"]) for r in res.trace] == [(3, 0.0), (3, 0.5), (3, 1.0), (1, 0.0), (1, 0.5), (1, 1.0)]
    for layer in (1, 3):
        rows = [r for r in res.trace if r["layer"] == layer]
        best = min(rows, key=lambda r: r["ppl"])
        assert res.alphas[layer] == best["alpha"]
    assert res.ppl_searched <= res.ppl_alpha1 * (1 + 1e-6)  # candidates run batched: rounding differs


def test_ties_keep_the_earlier_grid_value():
    """With V zeroed, layer 3's alpha cannot change anything: every candidate ties, so the first
    grid value must win (strictly-lower rule), here 0.7 — not the smallest nor the last."""
    model = make_tiny("llama")
    with torch.no_grad():
        family_of(model.config).layers(model)[3].self_attn.v_proj.weight.zero_()
    res = search_alphas(model, family_of(model.config), _windows(), [3], (0.7, 0.2, 1.0))
    assert len({r["ppl"] for r in res.trace}) == 1
    assert res.alphas == {3: 0.7}


def _counting(f):
    calls = []

    def evaluate(alphas):
        calls.extend(alphas)
        return [f(a) for a in alphas]
    return evaluate, calls


def test_golden_finds_the_exhaustive_minimum_of_a_unimodal_curve_with_fewer_evaluations():
    from harp_trt.calib.config import DEFAULT_GRID
    from harp_trt.calib.search import golden_search

    for centre in DEFAULT_GRID:
        evaluate, calls = _counting(lambda a: 20 + (a - centre) ** 2)
        best, seen, fell_back = golden_search(DEFAULT_GRID, evaluate)
        assert best == centre and not fell_back
        assert len(calls) == len(set(calls)) <= 7 < len(DEFAULT_GRID)  # never the same alpha twice
        assert seen[best] == 20


def test_golden_falls_back_to_the_full_grid_when_a_probe_contradicts_unimodality():
    from harp_trt.calib.config import DEFAULT_GRID
    from harp_trt.calib.search import golden_search

    # probes at 0.4 < 0.5 > 0.6: a rise then a fall, so the curve is not unimodal -> full grid
    curve = {a: v for a, v in zip(DEFAULT_GRID, (3, 9, 9, 9, 8, 9, 7, 9, 9, 9, 9))}
    evaluate, calls = _counting(curve.__getitem__)
    best, seen, fell_back = golden_search(DEFAULT_GRID, evaluate)
    assert fell_back and best == 0.0 and sorted(calls) == list(DEFAULT_GRID)
    # the limit of the method: a valley that no probe lands in goes unseen (0.8 here)
    curve = {a: v for a, v in zip(DEFAULT_GRID, (5, 4, 6, 7, 8, 9, 8, 7, 3, 6, 9))}
    evaluate, calls = _counting(curve.__getitem__)
    best, seen, fell_back = golden_search(DEFAULT_GRID, evaluate)
    assert not fell_back and best == 0.1 and 0.8 not in seen
    # ties keep the lower alpha, as the exhaustive search does
    evaluate, _ = _counting(lambda a: 1.0)
    assert golden_search(DEFAULT_GRID, evaluate)[0] == 0.0


def test_golden_search_on_a_model_matches_exhaustive_or_says_it_fell_back():
    fam = family_of(make_tiny("mistral").config)
    ex = search_alphas(make_tiny("mistral"), fam, _windows(), [1, 2, 3])
    gs = search_alphas(make_tiny("mistral"), fam, _windows(), [1, 2, 3], method="golden")
    assert gs.method == "golden" and set(gs.evaluations) == {1, 2, 3}
    assert all(n < 11 for l, n in gs.evaluations.items() if l not in gs.fallbacks)
    assert gs.alphas == ex.alphas
    for row in gs.trace:  # every golden probe is a value the exhaustive search saw, same perplexity
        match = [r for r in ex.trace if (r["layer"], r["alpha"]) == (row["layer"], row["alpha"])]
        assert len(match) == 1 and abs(match[0]["ppl"] / row["ppl"] - 1) < 1e-6
