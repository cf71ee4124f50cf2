"""Fitted replacements (calibrate --replacement rrr | lmmse, calib/fit.py): the closed forms on
data with a known answer, the checkpoint tensors that carry a map in HARP's V.O shape, and the
calibrate stage end to end (the map kept only where it beats the searched alpha, read back from
the artifact's safetensors into a fresh model with the same perplexity)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny
from harp_trt.calib.fit import LAMBDAS, FittedMap, Moments, _solve, hf_tensors
from harp_trt.dims import ModelDims
from harp_trt.families import FAMILIES
from harp_trt.fold import fold_vo
from harp_trt.harp import apply_harp, install_fitted
from test_calibrate_cli import calib_args, run_json, write_corpus


def _moments(x: torch.Tensor, y: torch.Tensor) -> Moments:
    m = Moments(x.shape[1])
    m.add(x, y)
    return m


def test_closed_forms_recover_known_maps_and_the_error_formula_is_exact():
    """rrr at rank r recovers a rank-r map; lmmse recovers an affine map with its bias; the
    squared error computed from moments equals the direct sum (float64, 1e-9 relative)."""
    g = torch.Generator().manual_seed(0)
    h, r, n = 24, 6, 4000
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w_true = torch.randn(h, r, generator=g, dtype=torch.float64) @ torch.randn(r, h, generator=g, dtype=torch.float64)
    bias = torch.randn(h, generator=g, dtype=torch.float64)
    y = x @ w_true.T
    fit = _solve(_moments(x, y), "rrr", r, 1e-12)
    assert fit.a.shape == (r, h) and fit.b.shape == (h, r)
    torch.testing.assert_close(fit.weight(), w_true, rtol=1e-8, atol=1e-8)
    aff = _solve(_moments(x + 3.0, y + bias), "lmmse", h, 1e-12)   # inputs with a mean too
    torch.testing.assert_close(aff.apply(x + 3.0), y + bias, rtol=1e-7, atol=1e-7)
    m = _moments(x, y + 0.1 * torch.randn(n, h, generator=g, dtype=torch.float64))
    w, b = torch.randn(h, h, generator=g, dtype=torch.float64), torch.randn(h, generator=g, dtype=torch.float64)
    yy = y + 0.0
    direct = float(((yy - (x @ w.T + b)) ** 2).sum())
    m2 = _moments(x, yy)
    assert m2.sq_error(w, b) == pytest.approx(direct, rel=1e-9)
    assert m.n == n


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_fitted_tensors_make_harp_attention_compute_the_map(family):
    """``hf_tensors`` in a pruned layer: HARP's attention block computes ``B A x`` (rrr, through
    the GQA repeat, a Qwen2 v bias zeroed) or ``W x + b`` (lmmse), and ``fold_vo`` of the rrr
    tensors (what the GGUF and TensorRT-LLM writers fold) is ``B A``."""
    model = make_tiny(family)
    spec = FAMILIES.get(family)()
    d = ModelDims.from_config(model.config)
    r = d.kv_heads * d.head_dim
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(r, d.hidden, generator=g, dtype=torch.float64), torch.randn(d.hidden, r, generator=g, dtype=torch.float64)
    x = torch.randn(2, 5, d.hidden, generator=g)
    apply_harp(model, {2: 1.0, 3: 1.0}, spec)
    rrr = FittedMap("rrr", a, b, None, 0.0, 0.0, 0.0)
    t = hf_tensors(rrr, spec, d, 2, torch.float32)
    install_fitted(model, 2, t, spec)
    attn = spec.layers(model)[2].self_attn
    torch.testing.assert_close(attn.vo(x), rrr.apply(x).float(), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(fold_vo(t[spec.weight_name("v", 2)], t[spec.weight_name("o", 2)], d, 1.0),
                               (b @ a).float(), rtol=1e-5, atol=2e-4)
    lm = FittedMap("lmmse", torch.randn(d.hidden, d.hidden, generator=g, dtype=torch.float64), None,
                   torch.randn(d.hidden, generator=g, dtype=torch.float64), 0.0, 0.0, 0.0)
    install_fitted(model, 3, hf_tensors(lm, spec, d, 3, torch.float32), spec)
    torch.testing.assert_close(spec.layers(model)[3].self_attn.vo(x), lm.apply(x).float(), rtol=1e-5, atol=2e-4)


def _check_record(art: Path, method: str) -> dict:
    """The plan's record of every fitted candidate agrees with the search trace: a layer keeps its
    map exactly when the map's perplexity is below the best grid value of that layer."""
    import polars as pl

    plan = json.loads((art / "plan.json").read_text())
    rep = plan["extra"]["replacement"]
    assert rep["method"] == method and sorted(map(int, rep["candidates"])) == plan["layers"]
    trace = pl.read_parquet(art / "search_trace.parquet")
    for layer in plan["layers"]:
        grid = trace.filter((pl.col("layer") == layer) & (pl.col("candidate") == "harp"))["ppl"].min()
        fit = trace.filter((pl.col("layer") == layer) & (pl.col("candidate") == method))["ppl"].item()
        assert (fit < grid) == (layer in rep["layers"]), (layer, fit, grid)
        assert rep["candidates"][str(layer)]["ppl"] == pytest.approx(fit)
        assert plan["alphas"][plan["layers"].index(layer)] == 1.0 or layer not in rep["layers"]
    assert (rep["file"] is not None) == bool(rep["layers"]) == (art / "replacement.safetensors").is_file()
    return plan


@pytest.mark.parametrize("method", ["rrr", "lmmse"])
def test_calibrate_replacement_records_every_candidate(trained_qwen2, tmp_path, capsys, method):
    """calibrate --replacement on a trained tiny Qwen2 (GQA, v bias): every layer's fitted candidate
    in the trace and the plan, kept only where it beat the grid; the cost beside HARP's; the paper's
    plan (--replacement harp) keeps the key it had before fitted maps existed (no key field)."""
    corpus = write_corpus(tmp_path / "c.txt", docs=24, words=120, seed=5)
    cache = tmp_path / "cache"
    args = calib_args(trained_qwen2, corpus, cache) + ["--tokens", "1024"]
    code, res, err = run_json(capsys, *args, "--replacement", method)
    assert code == 0, err
    plan = _check_record(Path(res["artifact"]), method)
    rep = plan["extra"]["replacement"]
    assert rep["cost"]["ratio_to_harp"] == 1.0  # h^2 = 2 h kv_dim at hidden 64, kv_dim 32
    assert res["replacement"] == method and res["fitted_layers"] == rep["layers"]
    for c in rep["candidates"].values():  # the fit's held-out error, and HARP's, on the lambda windows
        assert 0 <= c["heldout_rel_error"] <= c["harp_rel_error"] * 1.5 and c["lambda"] in LAMBDAS
    code, harp, err = run_json(capsys, *args)
    assert code == 0, err
    assert "replacement" not in json.loads((Path(harp["artifact"]) / "plan.json").read_text())["extra"]


def test_rrr_on_smollm2_beats_the_grid_and_reads_back(smollm2, smollm2_export, test_cache, capsys):
    """On a real model (SmolLM2-135M, top 2 layers, 1024 tokens per half, a 5-value grid) the rrr
    map beats the searched alpha in at least one layer; ``harp-trt eval`` rebuilds the plan's
    model from the artifact's safetensors (resident and one layer at a time) with the plan's
    held-out perplexity, 1e-5 relative; and the ONNX rewrite of the real export with the map passes
    its verification against PyTorch with the map (fp32 logits within 1e-4 of their scale, greedy
    tokens equal)."""
    common = ["--tokens", "1024", "--seq-len", "512", "--workdir", str(test_cache), "--json"]
    code, res, err = run_json(capsys, "calibrate", "--model", "smollm2-135m", "--layers", "2", "--replacement", "rrr",
                              "--alpha-grid", "0,0.25,0.5,0.75,1", *common)
    assert code == 0, err
    art = Path(res["artifact"])
    plan = _check_record(art, "rrr")
    assert plan["extra"]["replacement"]["layers"], plan["extra"]["replacement"]
    assert plan["ppl"]["searched"] < plan["ppl"]["alpha1"]
    for extra in ([], ["--sequential"]):
        code, ev, err = run_json(capsys, "eval", "--plan", str(art), *common, *extra)
        assert code == 0, err
        assert ev["fitted_layers"] == plan["extra"]["replacement"]["layers"]
        assert ev["searched"] == pytest.approx(plan["ppl"]["heldout_searched"], rel=1e-5)
    from harp_trt.plan import Plan
    from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage

    store, export = smollm2_export
    rw = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": Plan.load(art), "model": smollm2[0]})
    assert rw.manifest["max_abs_diff"] <= rw.manifest["tolerance"], rw.manifest
    modes = {r["layer"]: r["mode"] for r in json.loads((rw.path / REPORT).read_text())["layers"]}
    assert [l for l, m in modes.items() if m == "fitted-rrr"] == plan["extra"]["replacement"]["layers"]


def test_cca_bound_is_zero_for_a_linear_block_and_near_one_for_noise():
    """``cca`` (NBL's ranking): an affine block scores ~0 (below 1e-3: the ridge), an output independent of the input scores
    near 1 (finite-sample correlations of h = 16 directions over 20000 tokens: below 0.01 off)."""
    from harp_trt.calib.strategies.cca import cca_bound

    g = torch.Generator().manual_seed(4)
    x = torch.randn(20000, 16, generator=g, dtype=torch.float64)
    lin = Moments(16, full_yy=True)
    lin.add(x, x @ torch.randn(16, 16, generator=g, dtype=torch.float64) + 2.0)
    noise = Moments(16, full_yy=True)
    noise.add(x, torch.randn(20000, 16, generator=g, dtype=torch.float64))
    assert cca_bound(lin) < 1e-3 and 0.99 < cca_bound(noise) <= 1.0
