"""``bench/serve_load.py`` at a small size: a tiny dense and HARP engine (P = 2 of 4
layers) behind one real tritonserver (2.51, the nvidia-pytriton wheel), driven by real AIPerf
(0.13.0, its pinned tool venv installed from the wheelhouse) through Triton's ``generate_stream``.

What must hold: every AIPerf request completes; a KV budget of two dense sequences admits two dense
and four HARP ones (L/(L-P) = 2) and the load never decodes more together than that; malformed
requests mixed into the load get error responses while AIPerf's requests complete; a soak ends
without a failure, with greedy answers equal to ``harp-trt generate``'s and RSS grown < 5 %; the
server SIGKILLed mid-load leaves the repository and engines unchanged and serves again. Beside it,
llama.cpp's own OpenAI-compatible server (llama-cpp-python's, the plan's deci GGUFs) under the same
AIPerf: every request completes, one at a time, where Triton streams several at once."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import _tritonserver
import wheelhouse
from conftest import make_tiny
from harp_trt.bench import serve_load
from harp_trt.onnx_io import copy_tokenizer
from test_calibrate_cli import write_corpus

pytestmark = pytest.mark.slow  # a real server or runtime behind every test

# OSL long enough that four requests overlap on a busy machine too: at ITL ~0.8 ms a 128-token request took
# ~0.1 s, and beside another job AIPerf's fourth once started after the first had ended (HARP batch 2, not
# 4); at 384 tokens one takes ~0.35 s (max_position_embeddings raised to hold ISL + OSL)
ISL, OSL = 16, 384
DENSE_KV_PER_TOKEN = 4 * 2 * 2 * 16 * 4   # tiny llama: 4 layers x K,V x 2 KV heads x head_dim 16 x fp32


@pytest.fixture(scope="module")
def result(tmp_path_factory, test_cache, smollm2):
    if (why := _tritonserver.available()) is not None:
        pytest.fail(f"tritonserver cannot run here: {why}", pytrace=False)
    wheelhouse.require("aiperf==0.13.0")
    wheelhouse.require(_tritonserver.STUB_NUMPY)
    wheelhouse.require(_tritonserver.PYTRITON)
    root = tmp_path_factory.mktemp("serve-load")
    # SmolLM2's byte-level BPE tokenizer: llama.cpp's server tokenizes text with the GGUF's own copy of it
    # (a tokenizer llama.cpp cannot read gives a GGUF of token ids only, which its server cannot serve)
    model = root / "tiny"
    make_tiny("llama", vocab_size=49152, max_position_embeddings=1024).save_pretrained(model, safe_serialization=True)
    copy_tokenizer(Path(smollm2[0].folder), model, skip=("config.json", "generation_config.json"))
    corpus = write_corpus(root / "corpus.txt")
    # AIPerf's prompts of ISL tokens are ISL give or take a few once the server tokenizes them: this budget
    # admits two dense sequences and four HARP ones at any length up to 2 ISL
    budget = 2 * (2 * ISL + OSL) * DENSE_KV_PER_TOKEN + 100
    out = root / "out"
    argv = ["--model", str(model), "--prune-layers", "2,3", "--quant", "none", "--corpus", str(corpus),
            "--calib-tokens", "256", "--isl", str(ISL), "--osl", str(OSL), "--concurrency", "1,4",
            # --request-rate 1000: the four concurrent requests start within a few ms, so they overlap on any
            # machine (at the default 20/s the fourth may start after the first has finished)
            "--requests", "8", "--request-rate", "1000", "--runs", "1", "--kv-budget", str(budget),
            "--soak-s", "10", "--kill-after", "3", "--llamacpp-concurrency", "3", "--gguf-type", "q4_0",
            # llama.cpp's server takes one request at a time (~15 ms a token here): 128 tokens each is enough to
            # see it serialise, where 384 cost ~45 s more
            "--llamacpp-osl", "128",
            "--workdir", str(root / "cache"), "--tools", str(test_cache), "--out", str(out)]
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = serve_load.main(argv)
    assert code == 0, buf.getvalue()[-2000:]
    last = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert last == json.loads((out / "serve_load.json").read_text())
    return last


def test_every_request_completes_through_aiperf(result):
    points = result["points"]
    assert {(p["model"], p["concurrency"]) for p in points} == {(m, c) for m in ("dense", "harp") for c in (1, 4)}
    for p in points:
        assert p["errors"] == 0 and p["requests"] == 8, p
        assert p["output_tokens_per_s"]["avg"] > 0 and p["itl_ms"]["p99"] > 0 and p["ttft_ms"]["p99"] > 0
        assert "--endpoint-type" in p["command"] and "generate_stream" in " ".join(p["command"])
    g = result["goodput_per_run"][0]
    assert g["slo"]["itl_ms"] > 0 and g["dense"]["saturation_tokens_per_s"] > 0
    assert result["summary"]["saturation_tokens_per_s"]["harp_over_dense"]["runs"] == 1


def test_triton_streams_several_responses_at_once(result):
    """Continuous batching, seen from AIPerf's per-request records: at concurrency 4 responses overlap."""
    for p in result["points"]:
        flight = p["streams_in_flight"]
        assert flight["requests"] == 8, p
        assert flight["max"] >= 2 if p["concurrency"] == 4 else flight["max"] == 1, (p["model"], flight)


def test_llamacpp_server_completes_every_request_one_at_a_time(result):
    lc = result["llamacpp"]
    assert {(p["model"], p["concurrency"]) for p in lc["points"]} == {(m, c) for m in ("dense", "harp") for c in (3,)}
    for p in lc["points"]:
        assert p["errors"] == 0 and p["requests"] == p["streams_in_flight"]["requests"] > 0, p
        assert p["output_tokens_per_s"]["avg"] > 0 and "completions" in p["command"]
        assert '"logit_bias"' in " ".join(p["command"])  # EOS banned: every request runs to its length
        assert p["streams_in_flight"]["max"] == 1, p  # three clients, one stream at a time
    assert lc["serialises"] is True
    # llama.cpp-quantized files are served on the plain CPU buffers (AMX repacking segfaulted the first decode)
    assert lc["gguf_type"] == "q4_0" and set(lc["gguf"]) == {"dense", "harp"} and lc["osl"] == 128
    assert all(v.endswith("-q4_0.gguf") for v in lc["gguf"].values())
    assert all("use_extra_bufts = False" in " ".join(s["command"]) for s in lc["servers"].values())
    assert lc["summary"]["saturation_tokens_per_s"]["harp_over_dense"]["runs"] == 1


def test_kv_budget_admits_l_over_l_minus_p_and_the_load_respects_it(result):
    a = result["admission"]
    assert a["dense"]["kv_bytes_per_token"] == DENSE_KV_PER_TOKEN
    assert a["harp"]["kv_bytes_per_token"] == DENSE_KV_PER_TOKEN // 2
    assert (a["dense"]["admits"], a["harp"]["admits"]) == (2, 4)
    assert a["harp_over_dense"] == a["ceiling"] == 2.0
    # at concurrency 4 the dense model never decoded more than its budget admits; HARP reached its 4
    assert a["dense"]["largest_batch_seen"] == 2 and a["harp"]["largest_batch_seen"] == 4
    for m in ("dense", "harp"):   # the in-place KV buffers stay inside the budget (BatchKV(max_bytes=))
        assert 0 < a[m]["kv_buffer_bytes_seen"] <= a[m]["kv_budget_bytes"], a[m]


def test_bad_requests_in_the_load_get_errors_and_the_load_completes(result):
    bad = result["bad_requests"]
    assert bad["all_refused"], bad["rows"]
    assert all(r["error"] for r in bad["rows"])
    assert bad["load_errors"] == 0 and bad["load_requests"] >= 4


def test_soak_loses_nothing(result):
    soak = result["soak"]
    assert soak["failures"] == 0 and soak["requests"] >= 2
    assert soak["greedy_all_equal"], soak["greedy"]
    assert soak["rss_growth"] < 0.05, soak


def test_server_killed_mid_load_serves_again_from_the_same_repository(result):
    kill = result["kill"]
    assert kill["exit_code"] == -9
    assert kill["repository_and_engines_unchanged"] and kill["first_answer_ok"], kill


@pytest.mark.parametrize("extra, match", [(["--kv-budget", "lots"], "--kv-budget"),
                                          (["--concurrency", "1,4", "--requests", "2,4,8"], "--requests"),
                                          (["--concurrency", "0"], "--concurrency"),
                                          (["--llamacpp-concurrency", "x"], "--llamacpp-concurrency")])
def test_bad_arguments_exit_2_before_anything_runs(extra, match, capsys):
    assert serve_load.main(["--model", "smollm2-135m", "--prune-layers", "28,29", *extra]) == 2
    assert match in capsys.readouterr().err


def test_engine_speedup_beside_reads_either_long_context_json(tmp_path):
    """``--engine-json``: a ``--runs N`` JSON and the single run inside it give the same figures."""
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "docs" / "results" / "long_context_smollm2_ort_4608.json"
    data = json.loads(path.read_text())
    single = tmp_path / "one.json"
    single.write_text(json.dumps(data["runs"][0]))
    args = SimpleNamespace(isl=4096, osl=1024, engine_json=str(path))
    many = serve_load.decode_speedup_beside(args)
    one = serve_load.decode_speedup_beside(SimpleNamespace(**{**vars(args), "engine_json": str(single)}))
    assert many["context"] == one["context"] == 4608 and many["batches"] == one["batches"]
    assert {b["batch"] for b in many["batches"]} == {1, 4}
    assert all(1 < b["speedup_median"] <= b["ceiling"] for b in many["batches"])
