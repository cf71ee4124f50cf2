"""Faithful to the papers: the HARP paper's objective (lm-eval wikitext-style rolling windows),
given and published alphas (their bad input: tests/test_calibrate_cli.py::test_bad_calibrate_input)."""
from __future__ import annotations

import math

import pytest
import torch
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from conftest import make_tiny, save_tiny
from harp_trt.data import Corpus, prefix_token_id, rolling_windows
from harp_trt.ppl import PAD, context, model_ids, window_nll
from test_calibrate_cli import calib_args, calibrated_plan, run_json, write_corpus


class _SpaceTokenizer:
    """Integers separated by spaces; BOS 99."""

    bos_token_id, eos_token_id = 99, 98

    def __call__(self, doc, add_special_tokens=False):
        return {"input_ids": [int(x) for x in doc.split()]}


def _lm_eval_pairs(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], list[int]]]:
    """(model input, scored targets) of each window, by lm-evaluation-harness itself."""
    pairs = []
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, prefix, max_len, 1)):
        pairs.append(((ctx + cont)[:-1], cont))
    return pairs


def _our_pairs(w: torch.Tensor) -> tuple[list[int], list[int]]:
    real = w[w != PAD]
    inputs = model_ids(real[:-1]).tolist()
    targets = [int(t) for t in real[1:] if t >= 0]
    return inputs, targets


@pytest.mark.parametrize("doc_len,max_len", [(10, 4), (3, 4), (8, 4), (9, 4), (1, 4), (17, 5)])
def test_rolling_windows_are_lm_evals(doc_len, max_len):
    """Same model inputs and same scored tokens as lm-eval's loglikelihood_rolling, window by window."""
    docs = (" ".join(str(i) for i in range(doc_len)), "7 7 7")
    windows = rolling_windows(_SpaceTokenizer(), Corpus("c", "d", docs, ()), "calib", max_len, 10 ** 6)
    expect = _lm_eval_pairs(list(range(doc_len)), 99, max_len) + _lm_eval_pairs([7, 7, 7], 99, max_len)
    assert [_our_pairs(w) for w in windows] == expect
    assert windows.shape[1] <= max_len + 1


def test_rolling_windows_take_whole_documents_up_to_the_budget():
    docs = ("1 2 3 4 5 6", "1 2 3", "4 5 6")
    w = rolling_windows(_SpaceTokenizer(), Corpus("c", "d", docs, ()), "calib", 100, 7)
    assert w.shape == (2, 7)  # both first documents, whole; the third is over budget
    assert int((w[:, 1:] >= 0).sum()) == 9


def test_marked_windows_score_like_unmarked_ones():
    """window_nll skips PAD and context labels; padding after the end changes no logit."""
    torch.manual_seed(0)
    model = make_tiny("llama")
    w = torch.randint(4, 128, (1, 12))
    with torch.no_grad():
        full = model(input_ids=w).logits
    s_ref, n_ref = window_nll(full[:, 4:], w[:, 4:])  # predict tokens 5..11 from their prefix
    marked = torch.cat([w[:, :1], torch.tensor([[context(int(t)) for t in w[0, 1:5]]]), w[:, 5:],
                        torch.full((1, 3), PAD)], 1)
    with torch.no_grad():
        s, n = window_nll(model(input_ids=model_ids(marked)).logits, marked)
    assert n == n_ref == 7 and s == pytest.approx(s_ref, rel=1e-5)


def test_prefix_token_is_bos_else_eos():
    class T:
        bos_token_id, eos_token_id = None, 5

    assert prefix_token_id(_SpaceTokenizer()) == 99 and prefix_token_id(T()) == 5


@pytest.fixture
def tiny(tmp_path):
    folder = save_tiny("llama", tmp_path / "tiny-llama", max_position_embeddings=48)
    return folder, write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"


@pytest.mark.slow
def test_paper_objective_is_rolling_document_perplexity(tiny, capsys):
    """--objective paper: dense perplexity = exp(mean NLL) of lm-eval's rolling windows of the
    model's maximum length over whole BOS-prefixed documents, computed here with the model alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harp_trt.data import load_corpus

    folder, corpus, cache = tiny
    args = calib_args(folder, corpus, cache, "--objective", "paper", "--tokens", "200", "--dtype", "float32",
                      "--alpha-grid", "0,1")
    args.remove("--seq-len"), args.remove("64")
    _, plan = calibrated_plan(capsys, args)
    assert plan["extra"]["objective"] == "paper" and plan["extra"]["seq_len"] == 48
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    docs = load_corpus(str(corpus), cache).calib
    total, count = 0.0, 0
    for doc in docs:
        for inp, cont in _lm_eval_pairs(tok(doc, add_special_tokens=False)["input_ids"], tok.bos_token_id, 48):
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([inp])).logits[0].double(), -1)
            total -= float(sum(logp[len(inp) - len(cont) + j, t] for j, t in enumerate(cont)))
            count += len(cont)
        if count >= 200:
            break
    assert plan["extra"]["scored_tokens"] == count
    assert plan["ppl"]["dense"] == pytest.approx(math.exp(total / count), rel=1e-5)


@pytest.mark.slow
def test_given_alphas_top_down_make_a_plan_without_search(tiny, capsys):
    folder, corpus, cache = tiny
    res, plan = calibrated_plan(capsys, calib_args(folder, corpus, cache, "--alphas", "0.8,0.2",
                                                   "--alpha-order", "top-down"))
    assert plan["layers"] == [2, 3] and plan["alphas"] == [0.2, 0.8]  # plans: ascending layer order
    assert plan["extra"]["alphas_given"] is True and plan["grid"] == []
    assert set(plan["ppl"]) >= {"alpha1", "searched", "heldout_alpha1", "heldout_alpha0", "heldout_searched"}
    # the same alphas in ascending order give the same plan (same key: same artifact)
    code, res2, _ = run_json(capsys, *calib_args(folder, corpus, cache, "--alphas", "0.2,0.8"))
    assert code == 0 and res2["artifact"] == res["artifact"] and res2["cached"] is True


@pytest.mark.slow
def test_explicit_layers_are_searched(tiny, capsys):
    folder, corpus, cache = tiny
    _, plan = calibrated_plan(capsys, calib_args(folder, corpus, cache, "--prune-layers", "3,1", "--alpha-grid", "0,1"))
    assert plan["layers"] == [1, 3] and plan["strategy"] == "explicit" and set(plan["alphas"]) <= {0.0, 1.0}


def test_paper_alphas_of_the_presets():
    """The official HARP code's alpha lists (top-down), one per pruned layer of the preset's P."""
    import argparse

    from harp_trt.cli._common import given_layers_and_alphas
    from harp_trt.models import PRESETS

    for name in ("llama3.1-8b", "mistral-7b-v0.3", "qwen2-7b", "gemma2-9b"):
        p = PRESETS[name]
        ns = argparse.Namespace(model=name, layers=None, prune_layers=None, alphas=None, alpha_order="ascending",
                                paper_alphas=True, strategy="top")
        layers, prune, alphas = given_layers_and_alphas(ns)
        assert layers == p.default_layers == len(p.paper_alphas) and prune == ()
        assert alphas == tuple(reversed(p.paper_alphas))  # ascending layer order
    assert PRESETS["llama3.1-8b"].paper_alphas == (0.8, 0.2, 0.1, 0.1, 0.0, 0.1, 0.0, 0.0)


@pytest.mark.slow
def test_score_command_and_calibrate_agree_on_the_bos_sink(tiny, capsys):
    """`harp-trt score --strategy sink` puts the BOS first exactly as calibrate does."""
    folder, corpus, cache = tiny
    _, plan = calibrated_plan(capsys, calib_args(folder, corpus, cache, "--strategy", "sink", "--alphas", "1,1",
                                                 "--layers", "2"))
    code, sc, err = run_json(capsys, "score", "--model", str(folder), "--strategy", "sink", "--tokens", "256",
                             "--seq-len", "64", "--corpus", str(corpus), "--workdir", str(cache), "--json")
    assert code == 0, err
    assert sc["scores"] == pytest.approx(plan["scores"], rel=1e-6) and sc["selected"] == plan["layers"]
