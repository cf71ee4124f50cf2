"""Algorithm 1: cached search == naive search; tie-breaking; trace shape."""
from __future__ import annotations

import torch

from calib.search import search_alphas
from conftest import make_tiny
from harp_trt.families import family_of
from harp_trt.harp import harp_alphas
from harp_trt.ppl import perplexity


def _windows(n=3, s=24, seed=1):
    return torch.randint(0, 128, (n, s), generator=torch.Generator().manual_seed(seed))


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
    assert res.ppl_searched <= res.ppl_alpha1 + 1e-9


def test_ties_keep_the_earlier_grid_value():
    """With V zeroed, layer 3's alpha cannot change anything: every candidate ties, so the first
    grid value must win (strictly-lower rule), here 0.7 — not the smallest nor the last."""
    model = make_tiny("llama")
    with torch.no_grad():
        family_of(model.config).layers(model)[3].self_attn.v_proj.weight.zero_()
    res = search_alphas(model, family_of(model.config), _windows(), [3], (0.7, 0.2, 1.0))
    assert len({r["ppl"] for r in res.trace}) == 1
    assert res.alphas == {3: 0.7}
