"""Which text chooses alpha and which reports perplexity (--search-split), and lm-eval 0.4.7's
Gemma BOS (--paper-bos), through the CLI on tiny saved models."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import _tiny_tokenizer, make_tiny, save_tiny
from harp_trt.data import Corpus, load_corpus, paper_add_special_tokens, rolling_windows
from test_calibrate_cli import calib_args, run_json, write_corpus
from test_paper_options import _SpaceTokenizer, _lm_eval_pairs, _our_pairs


@pytest.fixture
def tiny(tmp_path):
    folder = save_tiny("llama", tmp_path / "tiny-llama", max_position_embeddings=48)
    search = write_corpus(tmp_path / "search.txt", docs=7, words=25, seed=1)
    other = write_corpus(tmp_path / "other.txt", docs=5, words=25, seed=2)
    return folder, search, other, tmp_path / "cache"


def _paper_args(folder, corpus, cache, *extra):
    args = calib_args(folder, corpus, cache, "--objective", "paper", "--dtype", "float32", "--tokens", "1000000",
                      "--alphas", "0.5,0.5", *extra)
    i = args.index("--seq-len")
    del args[i:i + 2]
    return args


def _tokens(folder, corpus, cache, split) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in load_corpus(str(corpus), cache).documents(split))


def _plan(res) -> dict:
    return json.loads((Path(res["artifact"]) / "plan.json").read_text())


@pytest.mark.slow
def test_the_default_split_is_halves_and_is_recorded(tiny, capsys):
    from harp_trt.plan import Plan

    folder, search, _, cache = tiny
    code, res, err = run_json(capsys, *_paper_args(folder, search, cache))
    assert code == 0, err
    rec = _plan(res)["extra"]["search_split"]
    assert rec["name"] == "halves" and rec["search"]["documents"] == "even" and rec["heldout"]["documents"] == "odd"
    assert rec["search"]["corpus"] == rec["heldout"]["corpus"] == "search.txt"
    assert (rec["search"]["count"], rec["heldout"]["count"]) == (4, 3)
    plan = _plan(res)
    assert plan["extra"]["scored_tokens"] == _tokens(folder, search, cache, "calib")
    assert plan["extra"]["heldout_scored_tokens"] == _tokens(folder, search, cache, "heldout")
    # plans written before the split was recorded load, and say they used halves
    del plan["extra"]["search_split"]
    assert Plan.from_dict(plan).search_split == "halves"


@pytest.mark.slow
def test_the_paper_split_searches_every_document_and_holds_out_the_named_text(tiny, capsys):
    """--search-split all: the search windows cover all 7 documents; held-out perplexity comes
    from the other file, all of it; the plan says the search perplexities are on search text."""
    from harp_trt.plan import Plan

    folder, search, other, cache = tiny
    code, res, err = run_json(capsys, *_paper_args(folder, search, cache, "--search-split", "all",
                                                   "--heldout-corpus", str(other)))
    assert code == 0, err
    plan = _plan(res)
    rec = plan["extra"]["search_split"]
    assert rec["name"] == "all" and Plan.load(Path(res["artifact"])).search_split == res["search_split"] == "all"
    assert rec["search"] == {"corpus": "search.txt", "corpus_digest": load_corpus(str(search), cache).digest,
                             "documents": "all", "count": 7}
    assert rec["heldout"]["corpus"] == "other.txt" and rec["heldout"]["count"] == 5
    assert rec["ppl_on_search_text"] == ["dense", "alpha1", "searched"]
    assert plan["extra"]["scored_tokens"] == _tokens(folder, search, cache, "all")
    assert plan["extra"]["heldout_scored_tokens"] == _tokens(folder, other, cache, "all")
    # eval: the plan's corpus has no held-out half any more; the named other text is held out
    ev = ["eval", "--plan", res["artifact"], "--workdir", str(cache), "--json", "--tokens", "256", "--seq-len", "32"]
    code, out, err = run_json(capsys, *ev, "--corpus", str(search))
    assert code == 2 and out is None and "searched every document of search.txt" in err, err
    code, out, err = run_json(capsys, *ev, "--corpus", str(other), "--split", "calib")
    assert code == 0 and out["search_text"] is False, err
    code, out, err = run_json(capsys, *ev, "--corpus", str(search), "--split", "calib")
    assert code == 0 and out["search_text"] is True, err
    # the bench's held-out perplexity refuses the search text too (before measuring anything)
    code, out, err = run_json(capsys, "bench", "--plan", res["artifact"], "--corpus", str(search), "--no-latency",
                              "--tasks", "none", "--workdir", str(cache), "--json")
    assert code == 2 and "its held-out half is search text" in err and "--corpus other.txt" in err, err
    assert not list(cache.glob("bench-*"))


def test_a_heldout_text_equal_to_the_search_text_is_refused(tiny, capsys):
    folder, search, _, cache = tiny
    copy = search.parent / "copy.txt"
    copy.write_bytes(search.read_bytes())
    code, res, err = run_json(capsys, *_paper_args(folder, search, cache, "--search-split", "all",
                                                   "--heldout-corpus", str(copy)))
    assert code == 2 and res is None and "holds the same text as" in err, err
    assert not list(cache.glob("calibrate-*")) and not list((cache / ".tmp").iterdir())


class _BosTokenizer(_SpaceTokenizer):
    """Adds its BOS (99) with add_special_tokens=True, as Gemma's tokenizer does."""

    def __call__(self, doc, add_special_tokens=False):
        ids = super().__call__(doc)["input_ids"]
        return {"input_ids": ([99] if add_special_tokens else []) + ids}


@pytest.mark.parametrize("doc_len,max_len", [(10, 4), (3, 4), (1, 4)])
def test_lm_eval_047_gemma_windows_hold_bos_twice(doc_len, max_len):
    """lm-eval 0.4.7's HFLM encodes a Gemma document with the tokenizer's BOS and puts its prefix
    BOS before it: the windows are lm-eval's for [BOS, doc] with prefix BOS, the second BOS scored."""
    docs = (" ".join(str(i) for i in range(doc_len)),)
    w = rolling_windows(_BosTokenizer(), Corpus("c", "d", docs, ()), "calib", max_len, 10 ** 6, True)
    assert [_our_pairs(x) for x in w] == _lm_eval_pairs([99] + list(range(doc_len)), 99, max_len)
    once = rolling_windows(_BosTokenizer(), Corpus("c", "d", docs, ()), "calib", max_len, 10 ** 6, False)
    assert [_our_pairs(x) for x in once] == _lm_eval_pairs(list(range(doc_len)), 99, max_len)


def test_paper_bos_applies_to_gemma_only():
    assert paper_add_special_tokens("lm-eval-0.4.7", "gemma2") and paper_add_special_tokens("lm-eval-0.4.7", "gemma")
    assert not paper_add_special_tokens("lm-eval-0.4.7", "llama")
    assert not paper_add_special_tokens("once", "gemma2")


@pytest.mark.slow
def test_gemma2_paper_bos_scores_one_more_token_per_document(tmp_path, capsys):
    """A tiny Gemma2 whose tokenizer adds BOS: --paper-bos lm-eval-0.4.7 scores each document's
    second BOS (one token more per document) and records the choice; once scores the text only."""
    from tokenizers.processors import TemplateProcessing

    folder = tmp_path / "tiny-gemma2"
    make_tiny("gemma2", max_position_embeddings=48).save_pretrained(folder)
    tok = _tiny_tokenizer()
    tok._tokenizer.post_processor = TemplateProcessing(single="<0x02> $A", special_tokens=[("<0x02>", 2)])
    tok.save_pretrained(folder)
    corpus, cache = write_corpus(tmp_path / "c.txt", docs=4, words=30), tmp_path / "cache"
    runs = {}
    for mode in ("once", "lm-eval-0.4.7"):
        code, res, err = run_json(capsys, *_paper_args(folder, corpus, cache, "--paper-bos", mode))
        assert code == 0, err
        runs[mode] = _plan(res)["extra"]
    assert runs["lm-eval-0.4.7"]["search_split"]["paper_bos"] == "lm-eval-0.4.7"
    assert runs["lm-eval-0.4.7"]["scored_tokens"] == runs["once"]["scored_tokens"] + 2  # 2 search documents
    assert runs["lm-eval-0.4.7"]["heldout_scored_tokens"] == runs["once"]["heldout_scored_tokens"] + 2
