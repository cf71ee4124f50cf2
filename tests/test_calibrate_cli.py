"""The calibrate stage end to end through the CLI on a tiny saved model: artifact contents,
cache hits, content addressing, and every bad-input path (typed error, exit 2, nothing left)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import polars as pl
import pytest

from conftest import save_tiny
from harp_trt.cli import main

WORDS = ("the model layer attention value output key query residual token weight pruning cache "
         "search alpha grid engine graph export runtime latency memory head norm scale").split()


def write_corpus(path: Path, docs: int = 12, words: int = 80, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(docs)))
    return path


@pytest.fixture
def tiny(tmp_path):
    folder = save_tiny("llama", tmp_path / "tiny-llama")
    corpus = write_corpus(tmp_path / "corpus.txt")
    return folder, corpus, tmp_path / "cache"


def run_json(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    return code, (json.loads(last) if last.startswith("{") else None), err


def calib_args(folder, corpus, cache, *extra):
    return ["calibrate", "--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
            "--corpus", str(corpus), "--workdir", str(cache), "--json", *extra]


def calibrated_plan(capsys, args) -> tuple[dict, dict]:
    """Run ``args`` (a calibrate command line); the JSON result and the plan.json it wrote."""
    code, res, err = run_json(capsys, *args)
    assert code == 0, err
    return res, json.loads((Path(res["artifact"]) / "plan.json").read_text())


def assert_refused(capsys, tiny, extra: list[str], needle: str) -> None:
    """calibrate with ``extra`` flags (replacing ``calib_args``'s own value of a flag it names) exits 2
    with a one- or two-line error containing ``needle`` and writes no artifact, nor leaves a temporary one."""
    folder, corpus, cache = tiny
    args = calib_args(folder, corpus, cache)
    for flag in [x for x in extra if x.startswith("--") and x in args]:
        i = args.index(flag)
        del args[i:i + 2]
    code, res, err = run_json(capsys, *args, *extra)
    assert code == 2 and res is None and needle in err, err
    assert len(err.strip().splitlines()) <= 2
    assert not list(cache.glob("calibrate-*")) if cache.exists() else True
    assert not list((cache / ".tmp").iterdir()) if (cache / ".tmp").exists() else True


def test_calibrate_writes_plan_and_is_cached(tiny, capsys):
    folder, corpus, cache = tiny
    code, res, _ = run_json(capsys, *calib_args(folder, corpus, cache))
    assert code == 0 and res["cached"] is False
    assert res["layers"] == [2, 3] and len(res["alphas"]) == 2
    assert set(res["ppl"]) >= {"dense", "alpha1", "searched", "heldout_dense", "heldout_searched"}
    assert res["ppl"]["searched"] <= res["ppl"]["alpha1"]
    art = Path(res["artifact"])
    assert art.name.startswith("calibrate-") and len(art.name) == len("calibrate-") + 16
    plan = json.loads((art / "plan.json").read_text())
    assert plan["format"] == "harp-plan/1" and plan["layers"] == [2, 3] and len(plan["scores"]) == 4
    assert plan["extra"]["versions"]["torch"] and plan["extra"]["timings"]["search"] >= 0
    trace = pl.read_parquet(art / "search_trace.parquet")
    assert trace.height == 2 * 11 and trace["layer"].to_list()[:11] == [3] * 11
    assert (art / "alpha_search.png").stat().st_size > 1000
    # identical second run: cache hit, same artifact
    code, res2, _ = run_json(capsys, *calib_args(folder, corpus, cache))
    assert code == 0 and res2["cached"] is True and res2["artifact"] == res["artifact"]
    # same weights at another path: same key (the key hashes the digest, not the path)
    import shutil

    moved = folder.parent / "elsewhere"
    shutil.copytree(folder, moved)
    code, res3, _ = run_json(capsys, *calib_args(moved, corpus, cache))
    assert res3["artifact"] == res["artifact"] and res3["cached"] is True
    # a different config is a different artifact
    code, res4, _ = run_json(capsys, *calib_args(folder, corpus, cache, "--alpha-grid", "0,1"))
    assert res4["artifact"] != res["artifact"]
    # cache ls / rm
    code, ls, _ = run_json(capsys, "cache", "ls", "--workdir", str(cache), "--json")
    assert Path(res["artifact"]).name in ls["artifacts"]
    code, _, _ = run_json(capsys, "cache", "rm", Path(res4["artifact"]).name, "--workdir", str(cache), "--json")
    assert code == 0 and not Path(res4["artifact"]).exists()


def test_score_and_eval_commands(tiny, capsys, tmp_path):
    folder, corpus, cache = tiny
    code, res, _ = run_json(capsys, "score", "--model", str(folder), "--strategy", "bi", "--layers", "2",
                            "--tokens", "128", "--seq-len", "64", "--corpus", str(corpus),
                            "--workdir", str(cache), "--save", str(tmp_path / "s.parquet"), "--json")
    assert code == 0 and res["strategy"] == "bi" and len(res["scores"]) == 4 and len(res["selected"]) == 2
    assert pl.read_parquet(tmp_path / "s.parquet")["score"].to_list() == pytest.approx(res["scores"])
    code, cal, _ = run_json(capsys, *calib_args(folder, corpus, cache))
    code, ev, _ = run_json(capsys, "eval", "--plan", cal["artifact"], "--corpus", str(corpus), "--tokens", "256",
                           "--seq-len", "64", "--workdir", str(cache), "--json")
    assert code == 0
    assert ev["dense"] == pytest.approx(cal["ppl"]["heldout_dense"], rel=1e-6)
    assert ev["searched"] == pytest.approx(cal["ppl"]["heldout_searched"], rel=1e-6)


@pytest.mark.parametrize("extra,needle", [
    (["--layers", "4"], "must be smaller than the model's 4 layers"),
    (["--layers", "0"], "positive number of layers"),
    (["--alpha-grid", "0,1.5"], "must lie in [0, 1]"),
    (["--alpha-grid", ""], "is empty"),
    (["--strategy", "sinks"], "did you mean 'sink'"),
    (["--tokens", "100000", "--seq-len", "100000"], "fewer than one window"),
    (["--seq-len", "long"], "--seq-len must be a number of tokens or 'max'"),
    # given alphas and layers (the HARP paper's options, tests/test_paper_options.py)
    (["--alphas", "0.5,0.1,0.2"], "--alphas gives 3 layers but --layers is 2"),
    (["--alphas", "0.5,1.5"], "must lie in [0, 1]"),
    (["--alphas", "0.5,x"], "--alphas must be comma-separated numbers"),
    (["--prune-layers", "1,1"], "repeats a layer"),
    (["--prune-layers", "2,7"], "out of range for a 4-layer model"),
    (["--prune-layers", "1,2", "--alphas", "0.1,0.2,0.3", "--layers", "3"], "--prune-layers gives 2 layers"),
    (["--paper-alphas"], "publishes no alphas for"),
])
def test_bad_calibrate_input(tiny, capsys, extra, needle):
    assert_refused(capsys, tiny, extra, needle)


def test_bad_models(tmp_path, capsys):
    cache = str(tmp_path / "cache")
    code, _, err = run_json(capsys, "calibrate", "--model", "smollm2-13m", "--workdir", cache)
    assert code == 2 and "did you mean 'smollm2-135m'" in err
    code, _, err = run_json(capsys, "calibrate", "--model", str(tmp_path / "missing.gguf"), "--workdir", cache)
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    code, _, err = run_json(capsys, "calibrate", "--model", str(bad), "--workdir", cache)
    assert code == 2 and "cannot read GGUF" in err
    # unsupported architecture
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    code, _, err = run_json(capsys, "score", "--model", str(gpt2), "--strategy", "gate-norm", "--workdir", cache)
    assert code == 2 and "unsupported architecture 'gpt2'" in err and "llama" in err
    # truncated safetensors
    trunc = save_tiny("llama", tmp_path / "trunc")
    plan = _fake_plan(tmp_path, trunc)
    f = trunc / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, _, err = run_json(capsys, "eval", "--plan", str(plan), "--workdir", cache, "--model", str(trunc))
    assert code == 2 and "not a complete safetensors file" in err
    # preset that needs a hub: the suite runs offline (conftest), so no 15 GB download starts
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    code, _, err = run_json(capsys, "calibrate", "--model", "qwen2-7b", "--workdir", cache)
    assert code == 2 and "preset 'qwen2-7b' (Qwen/Qwen2-7B)" in err and "--model /path/to/Qwen2-7B" in err
    assert "HF_HUB_OFFLINE is set and the local hub cache has no copy" in err


def _fake_plan(tmp_path, folder):
    from harp_trt.models import weight_digest
    from harp_trt.plan import Plan

    p = Plan("x", weight_digest(folder), "llama", 4, "top", (3,), (1.0,))
    p.save(tmp_path / "plan.json")
    return tmp_path / "plan.json"


def test_unwritable_cache(tiny, capsys, tmp_path):
    folder, corpus, _ = tiny
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_json(capsys, *calib_args(folder, corpus, blocker / "cache"))
    assert code == 2 and "not writable" in err


def test_interrupted_search_leaves_nothing(tiny, monkeypatch):
    """A run killed mid-search (KeyboardInterrupt from inside the search) leaves no artifact and
    no temp folder; the next run starts clean and succeeds."""
    import harp_trt.layerwise as search  # where the search's NLL is computed

    folder, corpus, cache = tiny
    real = search.window_nll
    calls = {"n": 0}

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] > 5:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(search, "window_nll", boom)
    assert main(calib_args(folder, corpus, cache)) == 130
    assert not list(cache.glob("calibrate-*")) and not list((cache / ".tmp").iterdir())
    monkeypatch.setattr(search, "window_nll", real)
    assert main(calib_args(folder, corpus, cache)) == 0
    assert len(list(cache.glob("calibrate-*"))) == 1
