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


def test_rrr_is_the_reduced_rank_optimum_on_noisy_anisotropic_data():
    """rrr at rank r reaches the squared error of alternating least squares run to convergence on
    ``||Y - B A X||^2`` (the reduced-rank optimum, 1e-9 relative), on inputs whose spectrum spans two
    decades and a full-rank map plus noise. Truncating the SVD of the least-squares map, the shortcut
    that ignores the input covariance, reads over 2x worse on the same data: a fit that took it fails."""
    g = torch.Generator().manual_seed(0)
    h, r, n = 24, 6, 4000
    rot, _ = torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64))
    x = torch.randn(n, h, generator=g, dtype=torch.float64) * torch.logspace(0, -2, h, dtype=torch.float64) @ rot.T
    y = x @ torch.randn(h, h, generator=g, dtype=torch.float64).T + 0.05 * torch.randn(n, h, generator=g, dtype=torch.float64)
    err = lambda w: float(((y - x @ w.T) ** 2).sum())  # noqa: E731
    fit = _solve(_moments(x, y), "rrr", r, 1e-12)
    assert fit.a.shape == (r, h) and fit.b.shape == (h, r)
    b = torch.randn(h, r, generator=g, dtype=torch.float64)
    xx_inv = torch.linalg.inv(x.T @ x)
    for _ in range(2000):  # alternating least squares: A given B, then B given A
        a = torch.linalg.solve(b.T @ b, b.T @ y.T @ x @ xx_inv)
        z = x @ a.T
        b = y.T @ z @ torch.linalg.inv(z.T @ z)
    assert err(fit.weight()) == pytest.approx(err(b @ a), rel=1e-9)
    u, sv, vh = torch.linalg.svd(torch.linalg.lstsq(x, y).solution.T)
    assert err(u[:, :r] @ torch.diag(sv[:r]) @ vh[:r]) > 2 * err(fit.weight())


def test_lmmse_recovers_an_affine_map_and_the_error_formula_is_exact():
    """lmmse recovers an affine map with its bias from inputs with a mean; the squared error
    computed from moments equals the direct sum (float64, 1e-9 relative)."""
    g = torch.Generator().manual_seed(0)
    h, n = 24, 4000
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w_true, bias = torch.randn(h, h, generator=g, dtype=torch.float64), torch.randn(h, generator=g, dtype=torch.float64)
    y = x @ w_true.T
    aff = _solve(_moments(x + 3.0, y + bias), "lmmse", h, 1e-12)
    torch.testing.assert_close(aff.apply(x + 3.0), y + bias, rtol=1e-7, atol=1e-7)
    w, b = torch.randn(h, h, generator=g, dtype=torch.float64), torch.randn(h, generator=g, dtype=torch.float64)
    direct = float(((y - (x @ w.T + b)) ** 2).sum())
    assert _moments(x, y).sq_error(w, b) == pytest.approx(direct, rel=1e-9)


def test_cost_of_each_map_where_h_squared_differs_from_twice_h_kv():
    """Multiply-adds per token at Llama-3.1-8B's and a tiny GQA model's shapes, where ``h^2 != 2 h
    kv_dim``: lmmse costs h / (2 kv_dim) times HARP's V.O (2x at 8B, 4x at one KV head of 8), rrr exactly HARP's."""
    from harp_trt.calib.fit import cost_record

    for hidden, heads, kv, ratio in ((4096, 32, 8, 2.0), (64, 8, 1, 4.0)):
        d = ModelDims(num_layers=2, hidden=hidden, heads=heads, kv_heads=kv, head_dim=hidden // heads,
                      intermediate=4 * hidden, vocab=128)
        harp = 2 * hidden * kv * (hidden // heads)
        assert cost_record("rrr", d) == {"macs_per_token": harp, "harp_macs_per_token": harp, "ratio_to_harp": 1.0}
        assert cost_record("lmmse", d) == {"macs_per_token": hidden * hidden, "harp_macs_per_token": harp,
                                           "ratio_to_harp": ratio}


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
    rrr = FittedMap("rrr", a, b, None, 0.0)
    t = hf_tensors(rrr, spec, d, 2, torch.float32)
    install_fitted(model, 2, t, spec)
    attn = spec.layers(model)[2].self_attn
    torch.testing.assert_close(attn.vo(x), rrr.apply(x).float(), rtol=1e-5, atol=2e-4)
    torch.testing.assert_close(fold_vo(t[spec.weight_name("v", 2)], t[spec.weight_name("o", 2)], d, 1.0),
                               (b @ a).float(), rtol=1e-5, atol=2e-4)
    lm = FittedMap("lmmse", torch.randn(d.hidden, d.hidden, generator=g, dtype=torch.float64), None,
                   torch.randn(d.hidden, generator=g, dtype=torch.float64), 0.0)
    install_fitted(model, 3, hf_tensors(lm, spec, d, 3, torch.float32), spec)
    torch.testing.assert_close(spec.layers(model)[3].self_attn.vo(x), lm.apply(x).float(), rtol=1e-5, atol=2e-4)


def _check_record(art: Path, method: str) -> dict:
    """The plan's record of every fitted candidate agrees with the search trace and with itself: a
    layer keeps its map exactly when the map reads lower than the layer's best alpha on the select
    text; the fit-text figures are the trace's (the grid's best, the map's row)."""
    import polars as pl

    plan = json.loads((art / "plan.json").read_text())
    rep = plan["extra"]["replacement"]
    assert rep["method"] == method and sorted(map(int, rep["candidates"])) == plan["layers"]
    trace = pl.read_parquet(art / "search_trace.parquet")
    for layer in plan["layers"]:
        c = rep["candidates"][str(layer)]
        grid = trace.filter((pl.col("layer") == layer) & (pl.col("candidate") == "harp"))["ppl"].min()
        fit = trace.filter((pl.col("layer") == layer) & (pl.col("candidate") == method))["ppl"].item()
        assert c["fit"] == {"alpha": pytest.approx(grid), "map": pytest.approx(fit)}
        assert (c["select"]["map"] < c["select"]["alpha"]) == (layer in rep["layers"]) == (c["kept"] == "map"), c
        assert set(c["heldout"]) == {"alpha", "map"}
        assert plan["alphas"][plan["layers"].index(layer)] == (1.0 if layer in rep["layers"] else c["alpha"])
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
    assert res["replacement"] == method and res["fitted_layers"] == rep["layers"] and rep["fit_inputs"] == "sequential"
    for c in rep["candidates"].values():  # the fit's error on its own text and on the select text, and HARP's
        assert 0 <= c["fit_rel_error"] <= c["select_rel_error"] * 1.5 and c["lambda"] in LAMBDAS
        assert c["select_rel_error"] <= c["harp_rel_error"] * 1.5
    assert set(plan["ppl"]) >= {"select_dense", "select_searched"}
    split = plan["extra"]["search_split"]
    assert (split["search"]["documents"], split["select"]["documents"]) == ("even of even", "odd of even")
    code, harp, err = run_json(capsys, *args)
    assert code == 0, err
    assert "replacement" not in json.loads((Path(harp["artifact"]) / "plan.json").read_text())["extra"]


@pytest.mark.slow
def test_rrr_on_smollm2_beats_the_grid_and_reads_back(smollm2, smollm2_export, test_cache, capsys):
    """On a real model (SmolLM2-135M, layer 28, 512 tokens per text in windows of 256, a 3-value grid)
    the rrr map beats the searched alpha on the select text; ``harp-trt eval`` rebuilds the plan's
    model from the artifact's safetensors one layer at a time with the resident plan's
    held-out perplexity, 1e-5 relative; and the ONNX rewrite of the real export with the map passes
    its verification against PyTorch with the map (fp32 logits within 1e-4 of their scale, greedy
    tokens equal)."""
    common = ["--tokens", "512", "--seq-len", "256", "--workdir", str(test_cache), "--json"]
    code, res, err = run_json(capsys, "calibrate", "--model", "smollm2-135m", "--prune-layers", "28", "--replacement", "rrr",
                              "--alpha-grid", "0,0.5,1", *common)
    assert code == 0, err
    art = Path(res["artifact"])
    plan = _check_record(art, "rrr")
    assert plan["extra"]["replacement"]["layers"] == [28], plan["extra"]["replacement"]
    assert plan["ppl"]["searched"] < plan["ppl"]["alpha1"]
    # one layer at a time, from the artifact's safetensors: the resident figure the plan recorded
    code, ev, err = run_json(capsys, "eval", "--plan", str(art), *common, "--sequential")
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


def test_cca_bound_is_the_canonical_correlations_of_the_data():
    """``cca_bound`` equals ``mean(1 - rho_i^2)`` with rho_i computed another way (singular values
    of ``Q_x^T Q_y``, the QR bases of the centred data) on a partly linear block, where the rho_i
    spread over (0, 1): 1e-4 absolute (the 1e-6 ridge moves it by ~1e-5). An affine block scores ~0 (below 1e-3: the ridge) and an
    output independent of the input ~1 (h = 16 over 20000 tokens: within 0.01)."""
    from harp_trt.calib.strategies.cca import cca_bound

    g = torch.Generator().manual_seed(4)
    n, h = 20000, 16
    x = torch.randn(n, h, generator=g, dtype=torch.float64)

    def bound(y):
        m = Moments(h, full_yy=True)
        m.add(x, y)
        return cca_bound(m)

    y = x * torch.linspace(0.1, 3, h, dtype=torch.float64) + torch.randn(n, h, generator=g, dtype=torch.float64)
    y = y @ torch.randn(h, h, generator=g, dtype=torch.float64)  # mixed: no rho_i reads off a column
    qx, _ = torch.linalg.qr(x - x.mean(0))
    qy, _ = torch.linalg.qr(y - y.mean(0))
    rho = torch.linalg.svdvals(qx.T @ qy)
    assert float(rho.min()) < 0.2 and float(rho.max()) > 0.9 and float(((rho > 0.3) & (rho < 0.8)).sum()) >= 3
    assert bound(y) == pytest.approx(float((1 - rho ** 2).mean()), abs=1e-4)
    assert bound(x @ torch.randn(h, h, generator=g, dtype=torch.float64) + 2.0) < 1e-3
    assert 0.99 < bound(torch.randn(n, h, generator=g, dtype=torch.float64)) <= 1.0
