"""``bench/long_context.py`` on a tiny llama, one run over the three runtimes (our ORT
engine, onnxruntime-genai, llama.cpp) at tiny contexts: every field of its JSON, KV bytes per token
as each runtime allocates them ((L-P)/L of dense), the KV capacity of a fixed budget measured by
allocating it (>= L/(L-P) x dense), and ideals equal to harp_trt/flops.py's."""
from __future__ import annotations

import json

import pytest

from conftest import save_tiny
from test_calibrate_cli import write_corpus

import llama_cpp  # noqa: F401  (the test extra installs both: a missing runtime fails, never skips)
import onnxruntime_genai  # noqa: F401

LAYERS, PRUNED = 4, (2, 3)
KEPT = (LAYERS - len(PRUNED)) / LAYERS
# KV bytes per token, HARP/dense vs (L-P)/L: ORT and genai measure whole buffers (exact); llama.cpp
# logs its KV size in MiB with 2 decimals: 1024 cells x 512 B = 0.50 MiB dense, 0.25 MiB HARP, so
# the bound is that resolution over the smaller size
KV_RATIO_TOL = {"ort": 0.0, "genai": 0.0, "llamacpp": 0.005 / 0.25}
# capacity: a fit is a multiple of --capacity-step (256) tokens; with a 1 MiB budget every runtime's
# fits are whole steps (fp32 1024 B/token: 1024 / 2048 tokens; llama.cpp f16 512 B/token: 2048 / 4096),
# so the ratio is L/(L-P) exactly; the tolerance allows one step of the HARP fit
CAPACITY_TOL = 256 / 2048
ARGS = ["--prune-layers", "2,3", "--calib-tokens", "256", "--runtime", "all", "--contexts", "24",
        "--batches", "1,2", "--prefill-lens", "32", "--prefill-repeats", "3", "--decode-steps", "2", "--repeats", "2", "--warmup", "1",
        "--kv-budget", "1MiB", "--capacity-step", "256", "--threads", "1",
        "--memory-cap", "none", "--settle", "0"]
DECODE_FIELDS = {"context", "batch", "steps_per_round", "rounds", "per_engine", "speedup", "peer_ratio", "ideal",
                 "fraction_of_ideal"}
RUNTIME_FIELDS = {"engines", "weight_bytes_per_param", "kv_bytes_per_element", "kv_type", "decode", "prefill",
                  "kv_bytes_per_token", "kv_capacity", "peak_rss_bytes", "seconds"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``--runs 2``: two independent processes of one run each, and their summary."""
    import contextlib
    import io

    from harp_trt.bench.long_context import main

    d = tmp_path_factory.mktemp("longctx")
    model = save_tiny("llama", d / "tiny", seed=7, max_position_embeddings=1024)
    corpus = write_corpus(d / "corpus.txt")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--model", str(model), "--corpus", str(corpus), "--workdir", str(d / "cache"),
                     "--out", str(d / "out"), *ARGS, "--runs", "2"])
    assert code == 0
    res = json.loads(out.getvalue().strip().splitlines()[-1])
    assert res == json.loads((d / "out" / "long_context.json").read_text())
    for k in (1, 2):
        assert res["runs"][k - 1] == json.loads((d / "out" / f"run{k}" / "long_context.json").read_text())
    return res, model


@pytest.fixture(scope="module")
def result(runs):
    """The first run's JSON."""
    return runs[0]["runs"][0], runs[1]


@pytest.mark.slow
def test_runs_are_independent_processes_and_summarised(runs):
    """Each run is its own process (its own command line, ``--runs 1``), and the summary's medians,
    spreads and every-run claims are those of the runs' rows."""
    import statistics

    res, _ = runs
    assert res["issue"] == 31 and "--runs 2" in res["provenance"]["command"]
    for r in res["runs"]:
        assert r["provenance"]["command"].endswith(f"--out {r['provenance']['command'].split('--out ')[-1]}")
        assert "--runs 1" in r["provenance"]["command"] and r["settings"]["threads"] == 1
        assert r["settings"]["threads_equal"] is True
    s = res["summary"]
    assert s["runs"] == 2 and list(s["runtimes"]) == ["ort", "genai", "llamacpp"]
    for name, rt in s["runtimes"].items():
        for i, point in enumerate(rt["decode"]):
            rows = [r["runtimes"][name]["decode"][i] for r in res["runs"]]
            sp = [m["speedup"]["speedup"] for m in rows]
            assert (point["context"], point["batch"]) == (rows[0]["context"], rows[0]["batch"])
            assert point["speedup_median"] == statistics.median(sp)
            assert (point["speedup_min"], point["speedup_max"]) == (min(sp), max(sp))
            assert point["lower_above_1_every_run"] == all(m["speedup"]["speedup_ci95_low"] > 1 for m in rows)
            assert point["fraction_ge_0_9_every_run"] == all(x / point["ideal"] >= 0.9 for x in sp)
            assert point["above_ceiling_runs"] == [k + 1 for k, m in enumerate(rows) if m["above_ceiling"]]
        (p,) = rt["prefill"]
        assert p["seq_len"] == 32 and p["runs"] == 2


def test_summary_claims_hold_in_every_run_only():
    """A claim true in one run and false in the other is false; the median is the runs' median."""
    from harp_trt.bench._long_context_runs import point_summary

    def row(s, lo, hi):
        return {"speedup": {"speedup": s, "speedup_ci95_low": lo, "speedup_ci95_high": hi},
                "ideal": {"ideal": 1.3}, "ceiling": 1.36, "above_ceiling": lo > 1.36}
    p = point_summary([row(1.29, 1.27, 1.31), row(1.10, 0.98, 1.2), row(1.40, 1.37, 1.42)])
    assert p["speedup_median"] == 1.29 and (p["speedup_min"], p["speedup_max"]) == (1.10, 1.40)
    assert p["lower_above_1_every_run"] is False and p["fraction_ge_0_9_every_run"] is False
    assert p["above_ceiling_runs"] == [3] and p["median_above_ceiling"] is False
    q = point_summary([row(1.25, 1.2, 1.3), row(1.28, 1.22, 1.31)])
    assert q["lower_above_1_every_run"] and q["fraction_ge_0_9_every_run"] and q["above_ceiling_runs"] == []


@pytest.mark.slow
def test_every_field(result):
    res, _ = result
    assert {"issue", "provenance", "note", "model", "plan", "settings", "machine", "runtimes", "plot",
            "plot_note"} <= set(res)
    assert {"commit", "date", "command", "versions"} <= set(res["provenance"])
    assert {"onnxruntime", "onnxruntime-genai", "llama_cpp_python"} <= set(res["provenance"]["versions"])
    load = res["machine"]["load_avg_start"][0]
    assert res["note"].startswith("quiet machine" if load <= 0.5 else "busy machine") and f"{load:.2f}" in res["note"]
    assert res["plan"]["layers"] == list(PRUNED) and res["plan"]["alphas"] == [0.5, 0.5]
    assert list(res["runtimes"]) == ["ort", "genai", "llamacpp"]
    for name, r in res["runtimes"].items():
        assert RUNTIME_FIELDS <= set(r), name
        assert [(m["context"], m["batch"]) for m in r["decode"]] == [(24, 1), (24, 2)]
        for m in r["decode"]:
            assert DECODE_FIELDS <= set(m)
            # a prompt of 24 - (1 warm-up + 2 x 2 timed) tokens: the last timed step attends to 24
            assert m["prompt"] == 19 and m["timed_positions"] == [21, 24]
            assert m["replicated"] == (["dense", "harp"] if name == "ort" and m["batch"] > 1 else [])
            for v in ("dense", "harp"):
                e = m["per_engine"][v]
                assert e["tokens_per_s"] > 0 and e["itl"]["n"] == 2 * 2
                assert e["itl"]["p50"] <= e["itl"]["p90"] <= e["itl"]["p99"]
            s = m["speedup"]
            assert s["pairs"] == 2 and s["speedup_ci95_low"] <= s["speedup"] <= s["speedup_ci95_high"]
            assert m["ceiling"] == pytest.approx(1 / KEPT) and m["above_ceiling"] == (s["speedup_ci95_low"] > m["ceiling"])
        (p,) = r["prefill"]
        assert p["ceiling"] == pytest.approx(1 / KEPT)
        assert p["seq_len"] == 32 and p["per_engine"]["harp"]["seconds"] > 0 and p["speedup"]["pairs"] == 3
        assert r["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_kv_bytes_per_token_as_allocated(result):
    res, _ = result
    for name, r in res["runtimes"].items():
        kv = r["kv_bytes_per_token"]
        assert kv["harp"] < kv["dense"], name
        assert abs(kv["ratio"] - KEPT) <= KV_RATIO_TOL[name], name
        for v in ("dense", "harp"):   # the runtime's figure equals the counted one within the same bound
            assert abs(kv[v] / kv["counted"][v] - 1) <= KV_RATIO_TOL[name] / KEPT, (name, v)
    assert res["runtimes"]["llamacpp"]["kv_bytes_per_element"] == 2   # llama.cpp's f16 cache


@pytest.mark.slow
def test_kv_capacity_measured(result):
    """Every runtime here allocates per layer: HARP holds >= L/(L-P) x dense's tokens in the budget."""
    res, _ = result
    ideal = LAYERS / (LAYERS - len(PRUNED))
    for name, r in res["runtimes"].items():
        cap = r["kv_capacity"]
        assert cap["per_layer"] and cap["ideal"] == ideal and cap["budget_bytes"] == 2**20, name
        assert 0 < cap["dense"]["bytes"] <= 2**20 and 0 < cap["harp"]["bytes"] <= 2**20
        assert cap["ratio"] >= ideal * (1 - CAPACITY_TOL), (name, cap)
    # genai: the fewest sequences whose max_length stays within the 1024-position context up to twice
    # the budget (2 MiB / 512 B per HARP token = 4096 tokens: 4 sequences), each growing 256 / 4 positions
    genai = res["runtimes"]["genai"]["kv_capacity"]
    assert (genai["sequences"], genai["step_tokens"]) == (4, 256)


@pytest.mark.slow
def test_ideals_match_flops(result):
    from transformers import AutoConfig

    from harp_trt import flops
    from harp_trt.dims import ModelDims

    res, model = result
    d = ModelDims.from_config(AutoConfig.from_pretrained(model))
    pruned = dict(zip(PRUNED, (0.5, 0.5)))
    for name, r in res["runtimes"].items():
        wb, kvb = r["weight_bytes_per_param"], r["kv_bytes_per_element"]
        assert (wb, kvb) == ((2, 2) if name == "llamacpp" else (4, 4))
        # llama.cpp's deci GGUF stores a pruned layer as one folded h x h matrix, the ONNX graphs V and O
        form = "folded" if name == "llamacpp" else "vo"
        for m in r["decode"]:
            c, b = m["context"], m["batch"]
            assert m["ideal"]["pruned_form"] == form
            for v, p in (("dense", None), ("harp", pruned)):
                one = flops.decode_bytes_per_token(d, c, p, wb, kvb, form)
                weights = flops.decode_bytes_per_token(d, 0, p, wb, kvb, form)
                assert m["ideal"][f"{v}_bytes"] == weights + b * (one - weights)
                if b == 1:
                    assert m["ideal"][f"{v}_bytes"] == one
            assert m["ideal"]["ideal"] == pytest.approx(m["ideal"]["dense_bytes"] / m["ideal"]["harp_bytes"], rel=1e-12)
        # our ORT engine scores text (every position); the genai folders here return the last one
        logits = "all" if name == "ort" else "last"
        assert r["prefill_logits"] == logits
        (p,) = r["prefill"]
        assert p["ideal"]["dense_flops"] == flops.prefill_flops(d, 32, None, logits, form)
        assert p["ideal"]["harp_flops"] == flops.prefill_flops(d, 32, pruned, logits, form)
        kv = r["kv_bytes_per_token"]["counted"]
        assert kv == {"dense": flops.kv_bytes_per_token(d, None, kvb), "harp": flops.kv_bytes_per_token(d, pruned, kvb)}


@pytest.mark.parametrize("argv, words", [
    (["--model", "m"], "--prune-layers"),
    (["--model", "m", "--prune-layers", "1", "--kv-budget", "2 lots"], "--kv-budget"),
    (["--model", "m", "--prune-layers", "1", "--contexts", "0"], "positive"),
])
def test_bad_input_exits_2(argv, words, capsys):
    from harp_trt.bench.long_context import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


@pytest.mark.slow
def test_ort_replicate_equals_a_batch_prefill(result):
    """The ORT engine's decode set-up (one row's prefill, its KV copied into every row) decodes as a
    batch prefill of identical rows does: same logits within 1e-5 of their scale."""
    import numpy as np
    import torch

    from harp_trt.bench.stage.engine_ort import OrtEngine
    from harp_trt.ort_session import OrtCausalLM

    res, _ = result
    folder = res["runtimes"]["ort"]["engines"]["harp"]["folder"]
    e = OrtEngine(OrtCausalLM.from_engine(folder, intra_op_threads=1), "harp", 1024)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    l1, s1 = e.prefill(ids)
    rep = e.replicate(s1, 3)
    lb, sb = e.prefill(ids.expand(3, -1))
    tok = l1.argmax(-1, keepdim=True).expand(3, -1)
    for _ in range(2):
        a, rep = e.decode(tok, rep)
        b, sb = e.decode(tok, sb)
        scale = max(1.0, float(b.abs().max()))
        assert float((a - b).abs().max()) <= 1e-5 * scale
        assert torch.equal(a[0], a[2])
        tok = b.argmax(-1, keepdim=True)
    with pytest.raises(ValueError, match="batch-1"):
        e.replicate(sb, 2)
    # the long-context bench's sessions hand a prefill's arena back (ORT run option): same logits
    e.session.shrink_after_prefill = True
    assert torch.equal(e.prefill(ids)[0], l1)


@pytest.mark.slow
def test_runs_of_one_plan_merge_into_one_plot(result, tmp_path):
    """Runs made one runtime at a time (``--runtime ort``, then ``llamacpp``) go into one figure;
    a run of another plan is refused."""
    import copy

    from harp_trt.bench._long_context_plot import merge_runs, write_plot

    res, _ = result
    a = {**copy.deepcopy(res), "runtimes": {"ort": res["runtimes"]["ort"]}}
    b = {**copy.deepcopy(res), "runtimes": {"llamacpp": res["runtimes"]["llamacpp"]}}
    merged = merge_runs([a, b])
    assert list(merged["runtimes"]) == ["ort", "llamacpp"] and merged["plan"] == res["plan"]
    path, _ = write_plot(merged, tmp_path / "merged.png")
    assert path and (tmp_path / "merged.png").stat().st_size > 0
    other = copy.deepcopy(b)
    other["plan"]["layers"] = [1]
    with pytest.raises(ValueError, match="different models or plans"):
        merge_runs([a, other])
