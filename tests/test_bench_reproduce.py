"""bench/reproduce_papers.py on a tiny model: one row per (strategy, P), alpha = 0 included,
and the JSON object as the last stdout line (lm-eval skipped: --tasks '')."""
from __future__ import annotations

import json

from harp_trt.bench.reproduce_papers import main
from conftest import save_tiny
from test_calibrate_cli import write_corpus


def test_reproduce_rows(tmp_path, capsys):
    folder = save_tiny("llama", tmp_path / "m", num_hidden_layers=4)
    corpus = write_corpus(tmp_path / "c.txt")
    assert main(["--model", str(folder), "--ps", "1,2", "--strategies", "top,bottom@1,gate-norm",
                 "--tokens", "128", "--seq-len", "32", "--corpus", str(corpus), "--tasks", "",
                 "--workdir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = [(r["strategy"], r["P"], r["layers"]) for r in out["calibration"]]
    assert got[:2] == [("top", 1, [3]), ("bottom", 1, [0])] and [g[:2] for g in got[2:]] == [("gate-norm", 1), ("top", 2), ("gate-norm", 2)]
    for r in out["calibration"]:
        ppl = [r[k] for k in ("heldout_dense", "heldout_alpha1", "heldout_searched", "heldout_alpha0")]
        assert all(0 < v < float("inf") for v in ppl) and len(r["alphas"]) == r["P"]
    assert out["lm_eval"] == []
