"""The honest fit (calib/fit.py, calib/search.py): maps fitted on the fit text, chosen on the select
text, the held-out text read by neither (token provenance); the sequential fit equal to a
layer-by-layer reference built from plain forward passes; a map taken out gives HARP's V.O back;
the CCA scores refuse too few tokens."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, save_tiny
from harp_trt.dims import ModelDims
from harp_trt.families import family_of
from harp_trt.harp import apply_harp, install_fitted
from harp_trt.layerwise import LayerStack
from test_calibrate_cli import calib_args, run_json

LAYERS = [1, 3]


def _windows(seed: int, n: int = 4, s: int = 48) -> torch.Tensor:
    return torch.randint(3, 128, (n, s), generator=torch.Generator().manual_seed(seed))


def _fit_on_fit_text(stats, method: str, rank: int):
    """The map solved on the fit moments alone at the lambda with the lowest select-text error."""
    from harp_trt.calib.fit import LAMBDAS, _solve

    scale = float(torch.diagonal(stats.fit.xx).mean()) / stats.fit.n
    cands = [(stats.val.sq_error(f.weight(), f.bias), lam, f)
             for lam in LAMBDAS for f in [_solve(stats.fit, method, rank, lam * scale)]]
    e, lam, f = min(cands, key=lambda c: c[0])
    f.lam = lam
    return f


def _reference(model, fit_w, sel_w, method: str, sequential: bool) -> dict:
    """Layer by layer from plain model forwards: a hook on layer l's attention collects (normed input,
    output) on the fit and the select windows, and (``sequential``) layer l's map is installed
    before the next layer's pass; dense: every layer's moments from the dense model."""
    from harp_trt.calib.fit import LayerStats, Moments, _harp_map, hf_tensors
    from harp_trt.fold import fold_vo

    fam, dims = family_of(model.config), ModelDims.from_config(model.config)
    rank = dims.kv_heads * dims.head_dim

    def stats_of(l):
        lay = fam.layers(model)[l]
        stats = LayerStats(Moments(dims.hidden), Moments(dims.hidden), *_harp_map(lay, dims, fold_vo))
        for part, windows in ((stats.fit, fit_w), (stats.val, sel_w)):
            def hook(mod, args, kwargs, output, part=part):
                x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                part.add(x, output[0] if isinstance(output, tuple) else output)
            handle = lay.self_attn.register_forward_hook(hook, with_kwargs=True)
            with torch.no_grad():
                for w in windows:
                    model(input_ids=w[None], use_cache=False)
            handle.remove()
        return stats

    if not sequential:
        return {l: _fit_on_fit_text(s, method, rank) for l, s in [(l, stats_of(l)) for l in LAYERS]}
    maps = {}
    for l in LAYERS:
        maps[l] = _fit_on_fit_text(stats_of(l), method, rank)
        apply_harp(model, {l: 1.0}, fam)
        install_fitted(model, l, hf_tensors(maps[l], fam, dims, l, torch.float32), fam)
    return maps


@pytest.mark.parametrize("method", ["rrr", "lmmse"])
def test_sequential_fit_equals_a_layer_by_layer_reference(method):
    """``fit_candidates`` (one streamed pass, each selected layer recomputed after its map is
    installed) gives the reference's maps to 1e-6 relative, sequential and dense; the upper layer's
    sequential map differs from its dense one (its inputs came through the lower map), and on
    return every selected layer carries its map."""
    from harp_trt.calib.fit import fit_candidates

    fit_w, sel_w = _windows(1), _windows(2)
    got = {}
    for inputs in ("sequential", "dense"):
        model = make_tiny("llama", num_hidden_layers=4)
        stack = LayerStack.wrap(model)
        got[inputs] = fit_candidates(stack, fit_w, sel_w, LAYERS, method, inputs)
        ref = _reference(make_tiny("llama", num_hidden_layers=4), fit_w, sel_w, method, inputs == "sequential")
        for l in LAYERS:
            torch.testing.assert_close(got[inputs][l].map.weight(), ref[l].weight(), rtol=1e-6, atol=1e-9)
            assert got[inputs][l].map.lam == ref[l].lam
            attn = stack.family.layers(model)[l].self_attn
            x = torch.randn(1, 3, model.config.hidden_size)
            torch.testing.assert_close(attn.vo(x), got[inputs][l].map.apply(x), rtol=1e-5, atol=1e-5)
    lo, hi = LAYERS
    torch.testing.assert_close(got["sequential"][lo].map.weight(), got["dense"][lo].map.weight())
    gap = (got["sequential"][hi].map.weight() - got["dense"][hi].map.weight()).norm()
    assert gap > 1e-3 * got["dense"][hi].map.weight().norm()


@pytest.mark.parametrize("sequential", [False, True])
def test_a_removed_map_gives_harp_vo_back(tmp_path, sequential):
    """``remove_fitted`` after ``install_fitted`` restores the layer's own V/O (rrr overwrote them in
    a resident model; a sequential stack drops its overlay), and lmmse's Linear goes."""
    from harp_trt.calib.fit import FittedMap, hf_tensors
    from harp_trt.device import resolve_placement

    folder = save_tiny("qwen2", tmp_path / "m")
    stack = LayerStack.open(folder, resolve_placement("cpu", "float32", sequential=sequential))
    fam, dims = stack.family, ModelDims.from_config(stack.model.config)
    apply_harp(stack.model, {2: 1.0}, fam)
    x = torch.randn(1, 3, dims.hidden)

    def vo():
        with stack.layer(2) as layer:
            return layer.self_attn.vo(x)

    before = vo()
    g = torch.Generator().manual_seed(0)
    r = dims.kv_heads * dims.head_dim
    for fmap in (FittedMap("rrr", torch.randn(r, dims.hidden, generator=g), torch.randn(dims.hidden, r, generator=g),
                           None, 0.0),
                 FittedMap("lmmse", torch.randn(dims.hidden, dims.hidden, generator=g), None,
                           torch.randn(dims.hidden, generator=g), 0.0)):
        stack.install_fitted(2, hf_tensors(fmap, fam, dims, 2, torch.float32))
        torch.testing.assert_close(vo(), fmap.apply(x), rtol=1e-4, atol=1e-4)
        stack.remove_fitted(2)
        torch.testing.assert_close(vo(), before, rtol=0, atol=0)


def _role_corpus(path: Path) -> tuple[Path, dict[str, set[int]]]:
    """A corpus whose documents spell each text with its own letters: documents 0, 4, 8, ... (the
    calibration half's even ones: fit) use a-h, 2, 6, 10, ... (select) i-p, the odd ones (held out)
    q-x. Returns the file and each role's token ids (the tiny tokenizer maps a character to its byte)."""
    rng = random.Random(0)
    letters = {"fit": "abcdefgh", "select": "ijklmnop", "heldout": "qrstuvwx"}

    def role(i: int) -> str:
        return "heldout" if i % 2 else ("fit" if i % 4 == 0 else "select")

    docs = [" ".join("".join(rng.choice(letters[role(i)]) for _ in range(4)) for _ in range(120)) for i in range(16)]
    path.write_text("\n\n".join(docs))
    return path, {r: {ord(c) for c in s} for r, s in letters.items()}


def _roles(windows: torch.Tensor, ids: dict[str, set[int]]) -> set[str]:
    seen = set(int(t) for t in windows.reshape(-1).tolist())
    return {r for r, s in ids.items() if seen & s}


def test_the_select_and_heldout_texts_never_reach_the_fit(tmp_path, capsys, monkeypatch):
    """calibrate --replacement rrr on a corpus whose three texts use disjoint letters: the fit
    moments read fit tokens only and the lambda moments select tokens only; the alpha grid is
    evaluated on fit windows, the map-or-alpha choice on select windows, and the held-out windows
    (read for the report) reach no fit and no decision."""
    import harp_trt.calib.fit as fit_mod
    import harp_trt.calib.search as search_mod

    corpus, ids = _role_corpus(tmp_path / "roles.txt")
    moments, evaluators = [], []
    real_moments, real_eval = fit_mod.layer_moments, search_mod._cached_evaluator

    def spy_moments(stack, windows, layers, split, *a, **k):
        moments.append((_roles(windows[:split], ids), _roles(windows[split:], ids)))
        return real_moments(stack, windows, layers, split, *a, **k)

    def spy_eval(stack, family, cap, windows, *a, **k):
        evaluators.append(_roles(windows, ids))
        return real_eval(stack, family, cap, windows, *a, **k)

    monkeypatch.setattr(fit_mod, "layer_moments", spy_moments)
    monkeypatch.setattr(search_mod, "_cached_evaluator", spy_eval)
    folder = save_tiny("llama", tmp_path / "m")
    code, res, err = run_json(capsys, *calib_args(folder, corpus, tmp_path / "cache", "--replacement", "rrr"))
    assert code == 0, err
    assert moments == [({"fit"}, {"select"})]
    assert evaluators and all(len(r) == 1 for r in evaluators)
    per_layer = [r.pop() for r in evaluators]
    # per layer, top-down: the grid on fit windows, then the choice on select, then the report on held-out
    assert per_layer == ["fit", "select", "heldout"] * 2, per_layer
    plan = json.loads((Path(res["artifact"]) / "plan.json").read_text())
    split = plan["extra"]["search_split"]
    assert {k: split[k]["documents"] for k in ("search", "select", "heldout")} == {
        "search": "even of even", "select": "odd of even", "heldout": "odd"}


def test_cca_refuses_too_few_tokens_for_the_width(tmp_path, capsys):
    """--strategy cca on 8 windows of 64 tokens (512) at hidden 64 exits 2, naming the count it needs
    (10 per dimension) and --score-tokens; with --score-tokens 640 it runs, and its scores are NBL's pair."""
    folder = save_tiny("llama", tmp_path / "m")
    from test_calibrate_cli import write_corpus

    corpus = write_corpus(tmp_path / "c.txt", docs=24, words=120)
    code, res, err = run_json(capsys, *calib_args(folder, corpus, tmp_path / "cache", "--strategy", "cca"))
    assert code == 2 and "needs >= 640 tokens at hidden size 64" in err and "--score-tokens 640 or more" in err, err
    code, res, err = run_json(capsys, *calib_args(folder, corpus, tmp_path / "cache", "--strategy", "cca",
                                                   "--score-tokens", "640"))
    assert code == 0, err
    plan = json.loads((Path(res["artifact"]) / "plan.json").read_text())
    assert plan["strategy"] == "cca" and len(plan["scores"]) == 4 and all(0 <= s <= 1 for s in plan["scores"])
