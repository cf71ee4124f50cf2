"""Layer-scoring strategies: one score per layer, selection rules, Gate-Norm formula."""
from __future__ import annotations

import pytest
import torch

from harp_trt.calib.strategies import STRATEGIES, ScoreContext, get_strategy
from harp_trt.calib.strategies.gate_norm import gate_norm_folded_scores, gate_norm_scores
from harp_trt.calib.strategies.sink import with_prefix
from conftest import make_tiny, save_tiny
from harp_trt.errors import ConfigError, UnknownNameError
from harp_trt.families import family_of
from harp_trt.layerwise import LayerStack


def _windows(name: str = "") -> torch.Tensor:
    """Random token windows; 10 tokens per hidden dimension (64) for the CCA scores, which refuse fewer."""
    shape = (4, 160) if name.startswith("cca") else (2, 16)
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(0))


def _ctx(model, name: str = "", **kw):
    return ScoreContext(family=family_of(model.config), config=model.config, stack=LayerStack.wrap(model),
                        windows=_windows(name), **kw)


@pytest.mark.parametrize("name", list(STRATEGIES.names()))
def test_one_finite_score_per_layer(family, name):
    model = make_tiny(family, num_hidden_layers=5)
    strat = get_strategy(name)
    scores = strat.score(_ctx(model, name))
    assert len(scores) == 5 and all(torch.isfinite(torch.tensor(scores)))
    sel = strat.select(scores, 2)
    assert len(sel) == 2 and sel == sorted(sel)
    if strat.protect_ends:
        assert 0 not in sel and 4 not in sel


def test_top_selects_highest_layers():
    s = get_strategy("top")
    assert s.select(s.score(_ctx(make_tiny("llama", num_hidden_layers=6))), 3) == [3, 4, 5]


def test_bottom_selects_lowest_layers():
    """The HARP paper's Bottom-P ablation."""
    s = get_strategy("bottom")
    assert s.select(s.score(_ctx(make_tiny("llama", num_hidden_layers=6))), 3) == [0, 1, 2]


def _tiny_attention(family):
    model = make_tiny(family)
    cfg = model.config
    return model, family_of(cfg), cfg, (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def test_gate_norm_is_the_papers_m_l(family):
    """m_l = ||W_q W_k^T||_F (arXiv 2512.20636) in the paper's x W convention, built explicitly
    from the attention module: q = x W_q, k = x W_k with W = weight^T, GQA by repeating each KV
    head for its query heads; no gain, no 1/sqrt(d)."""
    model, fam, cfg, (heads, kv, d) = _tiny_attention(family)
    expected = []

    def as_normed(w, norm):   # QK-norm: each head's block as its RMSNorm leaves it (gain in, scale out)
        if norm is None:
            return w
        # Gemma3RMSNorm scales by (1 + w) (modeling_gemma3.py), Qwen3RMSNorm by w (modeling_qwen3.py)
        g = norm.weight.detach().double() + (1.0 if family.startswith("gemma") else 0.0)
        blocks = [w[:, i * d:(i + 1) * d] for i in range(w.shape[1] // d)]
        return torch.cat([b * d ** 0.5 / torch.sqrt((b ** 2).sum()) * g for b in blocks], dim=1)

    for layer in fam.layers(model):
        att = layer.self_attn
        w_q = as_normed(att.q_proj.weight.detach().double().T, getattr(att, "q_norm", None))  # D x H d
        w_k = as_normed(att.k_proj.weight.detach().double().T, getattr(att, "k_norm", None))  # D x KV d
        cols = [w_k[:, (h // (heads // kv)) * d:(h // (heads // kv) + 1) * d] for h in range(heads)]
        w_k = torch.cat(cols, dim=1)                                       # D x H d
        expected.append(float(torch.sqrt(((w_q @ w_k.T) ** 2).sum())))
    got = gate_norm_scores(ScoreContext(family=fam, config=cfg, stack=LayerStack.wrap(model)))
    assert got == pytest.approx(expected, rel=1e-5)


def test_gate_norm_under_qk_norm_sees_the_gain_not_the_projection_scale():
    """Qwen3's per-head RMSNorm divides W_q's scale out of the logits and multiplies its own gain in:
    gate-norm follows the model (calib/strategies/gate_norm.py), so scaling a layer's W_q leaves its
    score alone and scaling its q_norm gain scales the score by the same factor."""
    model = make_tiny("qwen3")
    before = gate_norm_scores(_ctx(model))
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight.mul_(10.0)
        model.model.layers[2].self_attn.q_norm.weight.mul_(3.0)
    after = gate_norm_scores(_ctx(model))
    assert after[1] == pytest.approx(before[1], rel=1e-6)   # float32 weights
    assert after[2] == pytest.approx(3.0 * before[2], rel=1e-6)
    assert after[0] == before[0] and after[3] == before[3]


def test_gate_norm_ignores_the_norm_gain_the_folded_variant_uses():
    """Scaling a layer's input-norm gain changes gate-norm-folded, never the paper's score."""
    model = make_tiny("llama")
    before = (gate_norm_scores(_ctx(model)), gate_norm_folded_scores(_ctx(model)))
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(0.01)
    after = (gate_norm_scores(_ctx(model)), gate_norm_folded_scores(_ctx(model)))
    assert after[0] == pytest.approx(before[0], rel=1e-12)
    assert after[1][0] == pytest.approx(before[1][0] * 1e-4, rel=1e-4)  # gain enters q and k: squared
    assert after[1][1:] == pytest.approx(before[1][1:], rel=1e-12)


def test_gate_norm_folded_matches_brute_force(family):
    """score_l = mean_h ||diag(g) W_q^(h)T W_k^(k(h)) diag(g)||_F / sqrt(d), built explicitly."""
    model, fam, cfg, (heads, kv, d) = _tiny_attention(family)
    expected = []
    for layer in fam.layers(model):
        g = layer.input_layernorm.weight.detach() + fam.norm_weight_offset
        wq = layer.self_attn.q_proj.weight.detach() * g
        wk = layer.self_attn.k_proj.weight.detach() * g
        vals = []
        for h in range(heads):
            k = h // (heads // kv)
            m = wq[h * d:(h + 1) * d].T @ wk[k * d:(k + 1) * d]  # D x D bilinear form
            vals.append(torch.linalg.matrix_norm(m, "fro") / d ** 0.5)
        expected.append(float(torch.stack(vals).mean()))
    got = gate_norm_folded_scores(ScoreContext(family=fam, config=cfg, stack=LayerStack.wrap(model)))
    assert got == pytest.approx(expected, rel=1e-5)


def test_gate_norm_streams_from_safetensors(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    model = make_tiny("qwen2")
    from_model = gate_norm_scores(ScoreContext(family=family_of(model.config), config=model.config, stack=LayerStack.wrap(model)))
    from_disk = gate_norm_scores(ScoreContext(family=family_of(model.config), config=model.config, folder=folder))
    assert from_disk == pytest.approx(from_model, rel=1e-6)


def test_sink_scores_are_attention_mass_on_the_bos():
    """arXiv 2601.06787: attention to <BOS> at position 0. Every window gets the BOS prepended."""
    model = make_tiny("llama", attn="eager")
    bos = 1
    ctx = _ctx(model, prefix_id=bos)
    scores = get_strategy("sink").score(ctx)
    first = torch.cat([torch.tensor([[bos]]), ctx.windows[:1, :-1]], 1)
    out = model(input_ids=first, output_attentions=True)
    assert 0.0 < scores[0] < 1.0
    # one window: the score of layer 1 over the first window alone, BOS first
    one = get_strategy("sink").score(ScoreContext(family=ctx.family, config=model.config, stack=LayerStack.wrap(model),
                                                  windows=ctx.windows[:1], prefix_id=bos))
    assert one[1] == pytest.approx(float(out.attentions[1][0, :, 1:, 0].mean()), rel=1e-5)
    assert model.config._attn_implementation == "eager"


def test_with_prefix_prepends_once():
    w = torch.tensor([[5, 6, 7], [1, 8, 9]])
    assert with_prefix(w, 1).tolist() == [[1, 5, 6], [1, 8, 9]]
    assert with_prefix(w, None) is w


def test_sink_uses_only_real_queries_of_padded_windows():
    """Right padding (rolling document windows) does not change a window's sink score."""
    from harp_trt.ppl import PAD

    model = make_tiny("llama", attn="eager")
    w = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    w[0, 0] = 1  # starts with the BOS already: kept as is
    padded = torch.cat([w, torch.full((1, 6), PAD)], 1)
    a, b = (get_strategy("sink").score(ScoreContext(family=family_of(model.config), config=model.config,
                                                    stack=LayerStack.wrap(model), windows=x, prefix_id=1))
            for x in (w, padded))
    assert b == pytest.approx(a, rel=1e-5)


def test_selection_errors():
    s = get_strategy("sink")
    with pytest.raises(ConfigError, match="1..2"):
        s.select([0.1, 0.2, 0.3, 0.4], 3)
    with pytest.raises(ConfigError):
        get_strategy("top").select([0.0, 1.0], 0)
    with pytest.raises(UnknownNameError, match="did you mean 'gate-norm'"):
        STRATEGIES.get("gatenorm")


@pytest.mark.parametrize("name", [n for n in STRATEGIES.names() if get_strategy(n).needs_data and n != "top"])
def test_data_scores_equal_on_a_sequential_stack(tmp_path, family, name):
    """Layer-by-layer scoring from disk (one layer resident) gives the resident model's scores."""
    from harp_trt.device import resolve_placement

    folder = save_tiny(family, tmp_path / "m", num_hidden_layers=5)
    windows = _windows(name)
    got = {}
    for seq in (False, True):
        stack = LayerStack.open(folder, resolve_placement("cpu", "float32", sequential=seq))
        got[seq] = get_strategy(name).score(ScoreContext(family=stack.family, config=stack.model.config,
                                                         stack=stack, windows=windows))
        assert stack.sequential is seq and stack.loads == (5 if seq else 0)
    assert got[True] == pytest.approx(got[False], rel=1e-6)
