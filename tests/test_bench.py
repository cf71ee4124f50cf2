"""Bench stage on a tiny llama: tables, units, dense and HARP rows, genai-perf-named serving figures
per batch size, caching, the ORT engines, and every bad-input path (unknown task, too-long
sequence, missing eval data, weights from another model). The arithmetic without an engine (ideal
speed-up, paired intervals, gates) is in ``test_bench_stats.py``."""
from __future__ import annotations

import json
import random

import numpy as np
import polars as pl
import pytest

from conftest import save_tiny

PLAN_LAYERS = (2, 3)
PLAN_ALPHAS = (1.0, 0.5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    root = tmp_path_factory.mktemp("bench")
    folder = save_tiny("llama", root / "tiny", seed=0)
    store = ArtifactStore(root / "cache")
    resolved = resolve_model(str(folder), store.root)
    plan = Plan(model_ref=str(folder), model_digest=resolved.digest, family="llama", num_layers=4,
                strategy="top", layers=PLAN_LAYERS, alphas=PLAN_ALPHAS)
    plan.save(root / "plan.json")
    rng = random.Random(0)
    words = "the of and a to in is was for on with as by at from that it he his she they".split()
    (root / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(120)) for _ in range(8)))
    return {"root": root, "folder": folder, "store": store, "resolved": resolved, "plan": plan}


def _cli_args(setup, *extra):
    r = setup["root"]
    return ["bench", "--plan", str(r / "plan.json"), "--workdir", str(r / "cache"), "--seq-lens", "16,48",
            "--decode-context", "24", "--decode-tokens", "3", "--warmup", "1", "--repeats", "3",
            "--tasks", "none", "--corpus", str(r / "corpus.txt"), "--ppl-tokens", "384", "--ppl-seq-len", "128",
            "--json", *extra]


@pytest.fixture(scope="module")
def bench_art(setup):
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.bench.stage.stage import run_bench

    cfg = BenchConfig(seq_lens=(16, 48), decode_context=24, decode_tokens=3, warmup=1, repeats=3, tasks=(),
                      corpus=str(setup["root"] / "corpus.txt"), ppl_tokens=384, ppl_seq_len=128)
    art = run_bench(setup["root"] / "plan.json", str(setup["folder"]), cfg, setup["store"])
    return art, cfg


# ---- the stage ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_tables_columns_units_and_rows(bench_art, setup):
    art, cfg = bench_art
    for f in ("latency.parquet", "latency.csv", "speedup.parquet", "speedup.csv", "accuracy.parquet",
              "accuracy.csv", "latency_samples.parquet", "report.md", "summary.json"):
        assert (art.path / f).is_file(), f
    for png in ("latency.png", "accuracy.png"):
        assert (art.path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lat = pl.read_parquet(art.path / "latency.parquet")
    assert {"engine", "measure", "seq_len", "variant", "median_ms", "p90_ms", "p99_ms", "mean_ms", "n",
            "tokens_per_s", "kv_bytes_per_token"} <= set(lat.columns)
    assert {"batch_size"} <= set(lat.columns)
    for measure, seqs in (("prefill", {16, 48}), ("ttft", {24}), ("decode", {24}), ("request", {24})):
        sub = lat.filter(pl.col("measure") == measure)
        assert set(sub["seq_len"]) == seqs
        for s in seqs:
            assert set(sub.filter(pl.col("seq_len") == s)["variant"]) == {"dense", "harp"}
    pre = lat.filter(pl.col("measure") == "prefill")
    assert (pre["n"] == cfg.repeats).all()
    assert (lat.filter(pl.col("measure") == "decode")["n"] == cfg.repeats * cfg.decode_tokens).all()
    # batch 1 always runs (TTFT / ITL headline), then every --batch-sizes entry
    for measure in ("ttft", "decode", "request"):
        assert set(lat.filter(pl.col("measure") == measure)["batch_size"]) == {1, 4, 16}
    assert set(lat.filter(pl.col("measure") == "prefill")["batch_size"]) == {1}
    assert (lat["p90_ms"] >= lat["median_ms"]).all() and (lat["p99_ms"] >= lat["p90_ms"]).all()
    assert (lat["median_ms"] > 0).all()
    # tokens/s is tokens over the median time: prefill seq / s, decode batch * 1000 / ms, a request
    # batch * (decode_tokens + 1) output tokens / s
    for r in lat.iter_rows(named=True):
        if r["measure"] == "prefill":
            assert r["tokens_per_s"] == pytest.approx(r["seq_len"] / (r["median_ms"] / 1e3))
        if r["measure"] == "decode":
            assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * 1e3 / r["median_ms"])
        if r["measure"] == "request":
            assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * (cfg.decode_tokens + 1) / (r["median_ms"] / 1e3))
    # KV bytes measured on the cache: 4 layers (dense) vs 2 kept, K+V, 2 heads x 16, fp32
    dec = {r["variant"]: r for r in lat.filter((pl.col("measure") == "decode")
                                               & (pl.col("batch_size") == 1)).iter_rows(named=True)}
    assert dec["dense"]["kv_bytes_per_token"] == 4 * 2 * 32 * 4
    assert dec["harp"]["kv_bytes_per_token"] == 2 * 2 * 32 * 4


@pytest.mark.slow
def test_speedup_table_uses_the_flop_count(bench_art, setup):
    from harp_trt.dims import ModelDims
    from harp_trt.flops import ideal_speedups
    from harp_trt.families import FAMILIES

    art, cfg = bench_art
    spd = pl.read_parquet(art.path / "speedup.parquet")
    assert {"measure", "seq_len", "batch_size", "dense_median_ms", "harp_median_ms", "speedup", "speedup_ci95_low",
            "speedup_ci95_high", "pairs", "ideal_speedup", "ideal_speedup_bytes", "realised"} <= set(spd.columns)
    assert sorted(spd.select("measure", "seq_len", "batch_size").iter_rows()) == sorted(
        [("prefill", 16, 1), ("prefill", 48, 1), ("ttft", 24, 1), ("decode", 24, 1),
         ("throughput", 24, 1), ("throughput", 24, 4), ("throughput", 24, 16)])
    d = ModelDims.from_config(FAMILIES.get("llama")().tiny_config())
    ideal = ideal_speedups(d, dict(zip(PLAN_LAYERS, PLAN_ALPHAS)), [16, 48], 24)
    # the speed-up is the geometric mean of the per-repeat dense/HARP ratios, recomputed here from
    # the raw samples (decode: the median step of each repeat; throughput: the end-to-end request)
    samples = pl.read_parquet(art.path / "latency_samples.parquet")
    measure_of = {"throughput": "request"}
    for r in spd.iter_rows(named=True):
        per = (samples.filter((pl.col("measure") == measure_of.get(r["measure"], r["measure"]))
                              & (pl.col("seq_len") == r["seq_len"]) & (pl.col("batch_size") == r["batch_size"]))
               .group_by("variant", "repeat").agg(pl.col("ms").median()).sort("repeat"))
        dense = per.filter(pl.col("variant") == "dense")["ms"].to_numpy()
        harp = per.filter(pl.col("variant") == "harp")["ms"].to_numpy()
        assert r["pairs"] == cfg.repeats == len(dense) == len(harp)
        assert r["speedup"] == pytest.approx(float(np.exp(np.mean(np.log(dense / harp)))), rel=1e-9)
        assert r["speedup_ci95_low"] <= r["speedup"] <= r["speedup_ci95_high"]
        # the ceiling: 4 layers, 2 pruned -> 4 / 2; flagged only when the whole interval lies above it
        assert r["ceiling"] == 4 / (4 - len(PLAN_LAYERS)) == 2.0
        assert r["above_ceiling"] == (r["speedup_ci95_low"] > 2.0)
        from scipy import stats  # the interval recomputed: Student-t on the log ratios

        logs = np.log(dense / harp)
        half = stats.t.ppf(0.975, logs.size - 1) * logs.std(ddof=1) / np.sqrt(logs.size)
        assert (r["speedup_ci95_low"], r["speedup_ci95_high"]) == pytest.approx(
            (np.exp(logs.mean() - half), np.exp(logs.mean() + half)), rel=1e-9)
        if r["measure"] == "throughput":
            assert r["ideal_speedup"] is None and r["realised"] is None
            continue
        if r["measure"] == "prefill":
            assert r["ideal_speedup"] == pytest.approx(ideal["prefill"][r["seq_len"]]["ideal"])
        if r["measure"] == "decode":
            assert r["ideal_speedup"] == pytest.approx(ideal["decode"]["ideal"])
            assert r["ideal_speedup_bytes"] == pytest.approx(ideal["decode_bytes"]["ideal"])
        assert r["realised"] == pytest.approx((r["speedup"] - 1) / (r["ideal_speedup"] - 1))


def _hf_loss_perplexity(model, windows) -> float:
    """exp(mean next-token NLL) from the HF model's own loss (``labels=``), window by window: a
    reference that shares no code with ``harp_trt.ppl``, which the bench computes with."""
    import math

    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = w[None]
            n = ids.shape[1] - 1  # the loss is the mean over the S - 1 shifted positions
            total += float(model(input_ids=ids, labels=ids, use_cache=False).loss) * n
            count += n
    return math.exp(total / count)


@pytest.mark.slow
def test_heldout_perplexity_matches_reference(bench_art, setup):
    """The bench's dense/HARP perplexities equal the HF loss's on the held-out windows."""
    from harp_trt.data import load_corpus, token_windows
    from harp_trt.harp import apply_harp
    from harp_trt.models import load_model, load_tokenizer

    art, cfg = bench_art
    acc = pl.read_parquet(art.path / "accuracy.parquet")
    ppl = acc.filter(pl.col("metric") == "perplexity").row(0, named=True)
    corpus = load_corpus(cfg.corpus, setup["store"].root)
    model, fam = load_model(setup["resolved"])
    windows = token_windows(load_tokenizer(setup["folder"]), corpus, "heldout", 128, 384)
    assert (windows >= 0).all() and windows.shape == (3, 128)  # plain tokens: no padding or context marks
    assert ppl["n"] == windows.shape[0] * 127
    assert ppl["dense"] == pytest.approx(_hf_loss_perplexity(model, windows), rel=1e-5)
    apply_harp(model, dict(zip(PLAN_LAYERS, PLAN_ALPHAS)), fam)
    assert ppl["harp"] == pytest.approx(_hf_loss_perplexity(model, windows), rel=1e-5)
    assert ppl["harp"] != ppl["dense"]
    agree = acc.filter(pl.col("metric") == "top1_agreement").row(0, named=True)
    assert 0.0 <= agree["harp"] <= 1.0
    s = json.loads((art.path / "summary.json").read_text())
    assert s["ppl"]["increase"] == pytest.approx(ppl["harp"] / ppl["dense"] - 1)
    assert s["kv_reduction"] == pytest.approx(2.0)


@pytest.mark.slow
def test_stage_is_cached(bench_art, setup):
    from harp_trt.bench.stage.stage import run_bench

    art, cfg = bench_art
    again = run_bench(setup["root"] / "plan.json", str(setup["folder"]), cfg, setup["store"])
    assert again.cached and again.key == art.key


# ---- CLI and gates ------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_json_and_gates(bench_art, setup, capsys):
    from harp_trt.cli import main

    assert main(_cli_args(setup)) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["cached"] is True  # same config as the fixture: the artifact is reused
    assert set(out["prefill_speedup"]) == {"16", "48"} and out["kv_reduction"] == pytest.approx(2.0)
    assert out["ppl"]["dense"] > 0 and "harp" in out["ppl"]

    # a threshold above the cached run's interval (3 noisy pairs of a tiny model can make a t interval
    # reach far: the bound is read from the run, not guessed)
    pre = out["speedups"]["prefill_48"]
    above = 10 ** (len(str(int(pre["speedup_ci95_high"]))) + 1)
    assert main(_cli_args(setup, "--min-speedup", str(above))) == 1
    err = capsys.readouterr().err
    assert (f"prefill_48 {pre['speedup']:.3f}x (95% CI {pre['speedup_ci95_low']:.3f}-{pre['speedup_ci95_high']:.3f}): "
            f"upper bound {pre['speedup_ci95_high']:.3f} below --min-speedup {above:g} (3 interleaved pairs)") in err

    assert main(_cli_args(setup, "--max-ppl-increase", "-0.99")) == 1
    err = capsys.readouterr().err
    assert "held-out perplexity increase" in err and "--max-ppl-increase -0.99" in err

    assert main(_cli_args(setup, "--min-speedup", str(pre["speedup_ci95_low"] / 10), "--max-ppl-increase", "1000")) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["gates"]) == 2 and "resolved: the whole interval is at or above it" in out["gates"][1]


# ---- serving figures of a real run ---------------------------------------------------------------
@pytest.mark.slow
def test_summary_serving_figures(bench_art):
    """genai-perf names and units for TTFT / ITL (batch 1) and throughput at batch 1, 4, 16."""
    art, cfg = bench_art
    s = json.loads((art.path / "summary.json").read_text())
    assert s == art.manifest["summary"]
    assert s["batch_sizes"] == [1, 4, 16] and set(s["throughput"]) == {"1", "4", "16"}
    from harp_trt.machine import CPU_FEATURES, cpu_features

    # which kernels the figures could use: this x86-64 machine's flags, AVX2 at least
    assert s["cpu_features"] == cpu_features() and "avx2" in s["cpu_features"]
    assert set(s["cpu_features"]) <= set(CPU_FEATURES)
    assert {"prefill_16", "prefill_48", "time_to_first_token", "inter_token_latency", "throughput_bs1",
            "throughput_bs4", "throughput_bs16"} == set(s["speedups"])
    for ci in s["speedups"].values():
        assert ci["pairs"] == cfg.repeats and 0 < ci["speedup_ci95_low"] <= ci["speedup"] <= ci["speedup_ci95_high"]
    assert s["prefill_speedup"]["48"] == s["speedups"]["prefill_48"]["speedup"]
    assert s["decode_speedup"] == s["speedups"]["inter_token_latency"]["speedup"]

    def ordered(st, n, unit="ms"):
        assert st["unit"] == unit and st["n"] == n
        assert 0 < st["min"] <= st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
        assert st["min"] <= st["avg"] <= st["max"]

    for v in ("dense", "harp"):
        ordered(s["time_to_first_token"][v], cfg.repeats)
        ordered(s["inter_token_latency"][v], cfg.repeats * cfg.decode_tokens)
        for b in (1, 4, 16):
            e = s["throughput"][str(b)]
            assert (e["batch_size"], e["input_tokens"], e["output_tokens"]) == (b, 24, cfg.decode_tokens + 1)
            f = e[v]
            ordered(f["time_to_first_token"], cfg.repeats)
            ordered(f["inter_token_latency"], cfg.repeats * cfg.decode_tokens)
            ordered(f["request_latency"], cfg.repeats)
            tok, req = f["output_token_throughput"], f["request_throughput"]
            assert tok["unit"] == "tokens/sec" and req["unit"] == "requests/sec"
            # avg = total over total time (genai-perf): tokens = requests x output tokens per request
            total_s = f["request_latency"]["avg"] * cfg.repeats / 1e3
            assert req["avg"] == pytest.approx(b * cfg.repeats / total_s, rel=1e-9)
            assert tok["avg"] == pytest.approx(req["avg"] * (cfg.decode_tokens + 1), rel=1e-9)
            assert 0 < tok["min"] <= tok["p50"] <= tok["max"]
    report = (art.path / "report.md").read_text()
    for name in ("time_to_first_token", "inter_token_latency", "output tokens/sec", "requests/sec", "speedup_ci95_low",
                 "not resolved"):
        assert name in report, name


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_unknown_task_lists_valid_ones(setup, capsys):
    from harp_trt.cli import main

    args = _cli_args(setup)
    args[args.index("--tasks") + 1] = "hellaswg"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "unknown lm-eval task 'hellaswg'" in err and "arc_easy" in err and "did you mean 'hellaswag'" in err


@pytest.mark.slow
def test_sequence_beyond_context(setup, capsys):
    from harp_trt.cli import main

    args = _cli_args(setup)
    args[args.index("--seq-lens") + 1] = "16,512"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "[512] exceed the model's context of 256 tokens" in err and "max_position_embeddings" in err


@pytest.mark.slow
def test_missing_eval_data(setup, tmp_path, capsys):
    from harp_trt.cli import main

    args = _cli_args(setup, "--eval-data", str(tmp_path / "nowhere"))
    args[args.index("--tasks") + 1] = "piqa"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "eval data folder" in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    args[args.index("--eval-data") + 1] = str(tmp_path / "empty")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "eval data for 'piqa' is missing" in err and "data-00000-of-00001.arrow" in err


@pytest.mark.slow
def test_model_from_another_plan(setup, tmp_path, capsys):
    from harp_trt.cli import main

    other = save_tiny("llama", tmp_path / "other", seed=1)
    assert main(_cli_args(setup, "--model", str(other))) == 2
    err = capsys.readouterr().err
    assert "is not the model the plan was calibrated on" in err


@pytest.mark.slow
def test_bad_config_values(setup, capsys):
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.errors import ConfigError, UnknownNameError

    with pytest.raises(UnknownNameError, match="did you mean 'torch'"):
        BenchConfig(engine="troch").validate()
    with pytest.raises(ConfigError, match="unknown key"):
        BenchConfig.from_dict({"seq_len": 3})
    with pytest.raises(ConfigError, match="repeats must be >= 1"):
        BenchConfig.from_dict({"repeats": 0})
    from harp_trt.cli import main

    args = _cli_args(setup)
    args[args.index("--seq-lens") + 1] = "16,abc"
    assert main(args) == 2
    assert "--seq-lens must be comma-separated integers" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--batch-sizes must be positive request counts, got \[4, 0\]"):
        BenchConfig.from_dict({"batch_sizes": [4, 0]})


@pytest.mark.slow
@pytest.mark.parametrize("value, message", [
    ("0", "--batch-sizes must be positive request counts, got '0'"),
    ("1,-4", "--batch-sizes must be positive request counts, got '1,-4'"),
    ("1,4.5", "--batch-sizes must be comma-separated integers, got '1,4.5'"),
    ("four", "--batch-sizes must be comma-separated integers, got 'four'"),
])
def test_bad_batch_sizes_exit_2(setup, capsys, value, message):
    from harp_trt.cli import main

    assert main(_cli_args(setup, "--batch-sizes", value)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# ---- the ORT engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort_engines(setup):
    import shutil

    from harp_trt.models import load_model
    from harp_trt.export.export import export_dense
    from harp_trt.rewrite.stage import rewrite_onnx

    root = setup["root"]
    dense, harp = root / "ort_dense", root / "ort_harp"
    model, _ = load_model(setup["resolved"])
    export_dense(model, dense)
    harp.mkdir()
    rewrite_onnx(dense / "model.onnx", setup["plan"], harp / "model.onnx")
    for f in setup["folder"].glob("*.json"):
        shutil.copy(f, dense)
        shutil.copy(f, harp)
    return dense, harp


@pytest.mark.slow
def test_ort_engine_matches_torch(setup, bench_art, ort_engines):
    """Same plan in ONNX Runtime (dense export vs rewritten graph): same perplexities as the
    PyTorch reference, same measured KV bytes, every table filled."""
    from harp_trt.bench.stage.stage import run_bench

    art_t, cfg = bench_art
    cfg = cfg.replace(engine="ort", repeats=2, seq_lens=(16,), batch_sizes=(4,))
    art = run_bench(setup["plan"], {"dense": ort_engines[0], "harp": ort_engines[1]}, cfg, setup["store"])
    s, st = art.manifest["summary"], art_t.manifest["summary"]
    assert s["engine"] == "ort"
    assert s["ppl"]["dense"] == pytest.approx(st["ppl"]["dense"], rel=1e-4)
    assert s["ppl"]["harp"] == pytest.approx(st["ppl"]["harp"], rel=1e-4)
    assert s["kv_bytes_per_token"] == st["kv_bytes_per_token"]
    # the ORT engine batches too: 4 requests of 24 prompt tokens, decode_tokens + 1 output tokens each
    assert set(s["throughput"]) == {"4"} and s["speedups"]["throughput_bs4"]["pairs"] == 2
    assert s["throughput"]["4"]["output_tokens"] == cfg.decode_tokens + 1
    assert s["throughput"]["4"]["harp"]["output_token_throughput"]["avg"] > 0
    spd = pl.read_parquet(art.path / "speedup.parquet")
    # the ORT graph computes logits for every prompt position: the ideal counts them
    from harp_trt.dims import ModelDims
    from harp_trt.flops import prefill_flops
    from harp_trt.families import FAMILIES

    d = ModelDims.from_config(FAMILIES.get("llama")().tiny_config())
    pr = spd.filter(pl.col("measure") == "prefill").row(0, named=True)
    pruned = dict(zip(PLAN_LAYERS, PLAN_ALPHAS))
    assert pr["ideal_speedup"] == pytest.approx(prefill_flops(d, 16, None, "all") / prefill_flops(d, 16, pruned, "all"))


@pytest.mark.slow
def test_ort_engines_swapped_or_foreign(setup, ort_engines, capsys):
    from harp_trt.cli import main

    dense, harp = ort_engines
    args = _cli_args(setup, "--engine", "ort", "--dense-engine", str(harp), "--harp-engine", str(dense))
    assert main(args) == 2
    assert "dense engine" in capsys.readouterr().err
    assert main(_cli_args(setup, "--engine", "ort")) == 2
    assert "--engine ort needs --dense-engine DIR and --harp-engine DIR" in capsys.readouterr().err
