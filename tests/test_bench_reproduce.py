"""bench/reproduce_papers.py on a trained tiny Qwen2 (``trained_qwen2``: held-out perplexity ~16 on
this word list, a random model's ~130, so a wrong figure shows): one row per (strategy, P), alpha = 0
included, the JSON object as the last stdout line (lm-eval skipped: --tasks ''), and every reported
perplexity equal to one recomputed here from the row's own layers and alphas."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from harp_trt.bench.reproduce_papers import main
from test_calibrate_cli import write_corpus

TOKENS, SEQ_LEN = 512, 64
RTOL = 1e-4  # fp32 both sides, the same model and windows; only the order of the sums differs


def _heldout_windows(folder, corpus) -> torch.Tensor:
    """The held-out windows by the documented rule, written out here: the corpus's odd documents
    (blank-line separated), each tokenized with "\\n\\n" appended and no special tokens, the first
    TOKENS tokens cut into non-overlapping windows of SEQ_LEN."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    docs = [d.strip() for d in corpus.read_text().split("\n\n") if d.strip()]
    ids: list[int] = []
    for doc in docs[1::2]:
        ids += tok(doc + "\n\n", add_special_tokens=False)["input_ids"]
    assert len(ids) >= TOKENS, f"the held-out documents of {corpus} hold {len(ids)} tokens, fewer than {TOKENS}"
    return torch.tensor(ids[:TOKENS]).view(-1, SEQ_LEN)


@torch.inference_mode()
def _perplexity(folder, windows: torch.Tensor, alphas: dict[int, float]) -> float:
    """exp(mean next-token NLL) of the model, HARP-patched on ``alphas`` (the PyTorch reference),
    one window per forward pass, no context across windows."""
    from transformers import AutoModelForCausalLM

    from harp_trt.harp import apply_harp

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if alphas:
        apply_harp(model, alphas)
    nll = sum(F.cross_entropy(model(input_ids=w[None]).logits[0, :-1].double(), w[1:], reduction="sum").item()
              for w in windows)
    return math.exp(nll / (windows.numel() - windows.shape[0]))


@pytest.mark.slow
def test_reproduce_rows_report_the_perplexities_of_their_plans(tmp_path, capsys, trained_qwen2):
    corpus = write_corpus(tmp_path / "c.txt", docs=16)
    assert main(["--model", str(trained_qwen2), "--ps", "1,2", "--strategies", "top,bottom@1,gate-norm",
                 "--tokens", str(TOKENS), "--seq-len", str(SEQ_LEN), "--corpus", str(corpus), "--tasks", "",
                 "--workdir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["calibration"]
    got = [(r["strategy"], r["P"], r["layers"]) for r in rows]
    assert got[:2] == [("top", 1, [3]), ("bottom", 1, [0])]
    assert [g[:2] for g in got[2:]] == [("gate-norm", 1), ("top", 2), ("gate-norm", 2)]
    assert out["lm_eval"] == []

    windows = _heldout_windows(trained_qwen2, corpus)
    memo: dict[tuple, float] = {}

    def reference(alphas: dict[int, float]) -> float:
        key = tuple(sorted(alphas.items()))
        if key not in memo:
            memo[key] = _perplexity(trained_qwen2, windows, alphas)
        return memo[key]

    dense = reference({})
    assert 10 < dense < 25, dense  # trained on this word list: 16.5 measured (a random model: ~130)
    for r in rows:
        name = f"{r['strategy']} P={r['P']}"
        assert len(r["alphas"]) == r["P"] and all(0.0 <= a <= 1.0 for a in r["alphas"]), name
        assert math.isclose(r["heldout_dense"], dense, rel_tol=RTOL), (name, r["heldout_dense"], dense)
        for key, alphas in (("heldout_searched", dict(zip(r["layers"], r["alphas"]))),
                            ("heldout_alpha1", dict.fromkeys(r["layers"], 1.0)),
                            ("heldout_alpha0", dict.fromkeys(r["layers"], 0.0))):
            want = reference(alphas)
            assert math.isclose(r[key], want, rel_tol=RTOL), (name, key, r[key], want)
        # what the papers predict, where it holds on this model too: the searched alphas (Algorithm 1,
        # whose grid holds 0 and 1) do no worse than alpha = 1 (held-out text: 0.1 % slack), and
        # dropping the block (alpha = 0) costs more than HARP's V.O path (measured: 1.1-10 % more).
        # Not asserted: searched >= dense. Attention barely matters for this random-word text, and
        # HARP at alpha = 1 measured 0.1-0.6 % *below* dense here.
        assert r["heldout_searched"] <= r["heldout_alpha1"] * 1.001, (name, r)
        assert r["heldout_searched"] * 1.005 < r["heldout_alpha0"], (name, r)
        assert all(0.9 * dense < r[k] < 1.5 * dense for k in ("heldout_searched", "heldout_alpha1",
                                                               "heldout_alpha0")), (name, r)
