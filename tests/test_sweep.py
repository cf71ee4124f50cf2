"""harp-trt sweep: the frontier over P, the pick at a budget, and the picked plan being the one
``calibrate -P <P>`` gives (the same cached artifact)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_calibrate_cli import calib_args, run_json, write_corpus


def test_sweep_frontier_and_the_plan_it_picks_equals_calibrate(trained_qwen2, tmp_path, capsys):
    """P = 1..3 of a trained tiny Qwen2 (4 layers): each row's ceiling is L/(L-P), the KV saved P/L and
    the byte ideal between 1 and the ceiling; the pick at a budget is the largest P within it (read
    from the rows); the plan written to --plan-out and ``calibrate -P <pick>`` (a cache hit on the same
    artifact) agree on layers, alphas and perplexities; the PNG is written."""
    corpus = write_corpus(tmp_path / "c.txt", docs=24, words=120, seed=5)
    cache = tmp_path / "cache"
    args = calib_args(trained_qwen2, corpus, cache)
    args = [a for a in args[1:] if a not in ("--layers", "2")]  # the sweep sets P
    rows, picked = None, []
    for budget in (0.0, 0.02):
        code, res, err = run_json(capsys, "sweep", *args, "--max-p", "3", "--max-ppl-increase", str(budget),
                                  "--plan-out", str(tmp_path / f"out{budget}"), "--png", str(tmp_path / "f.png"))
        assert code == 0, err
        rows = res["frontier"]
        assert [r["P"] for r in rows] == [1, 2, 3] and all(r["cached"] for r in rows) == (budget != 0.0)
        for r in rows:
            assert r["ceiling"] == pytest.approx(4 / (4 - r["P"])) and r["kv_saved"] == r["P"] / 4
            assert 1.0 < r["byte_ideal"] <= r["ceiling"]
            assert r["ppl_increase"] == pytest.approx(r["heldout"] / r["heldout_dense"] - 1)
        within = [r["P"] for r in rows if r["ppl_increase"] <= budget]
        assert (res["chosen"] or {}).get("P") == (max(within) if within else None)
        assert Path(res["png"]).is_file()
        if res["chosen"] is None:
            assert not (tmp_path / f"out{budget}" / "plan.json").exists()
            continue
        picked.append(res["chosen"]["P"])
        written = json.loads((tmp_path / f"out{budget}" / "plan.json").read_text())
        code, cal, err = run_json(capsys, *calib_args(trained_qwen2, corpus, cache), "--layers", str(res["chosen"]["P"]))
        assert code == 0, err
        assert cal["cached"] and cal["artifact"] == res["chosen"]["plan"]
        assert (written["layers"], written["alphas"], written["ppl"]) == (cal["layers"], cal["alphas"], cal["ppl"])
    assert picked, "no budget picked a plan: the plan-equals-calibrate check never ran"


@pytest.mark.parametrize("extra, needle", [
    (["--max-p", "4"], "--max-p must lie in 1..3"),
    (["--max-p", "2", "--prune-layers", "2,3"], "sweep chooses the layers"),
    (["--max-p", "2", "--max-ppl-increase", "-1"], "--max-ppl-increase must be >= 0"),
])
def test_sweep_bad_input(trained_qwen2, tmp_path, capsys, extra, needle):
    corpus = write_corpus(tmp_path / "c.txt")
    args = [a for a in calib_args(trained_qwen2, corpus, tmp_path / "cache")[1:] if a not in ("--layers", "2")]
    code, res, err = run_json(capsys, "sweep", *args, *extra)
    assert code == 2 and res is None and needle in err, err
