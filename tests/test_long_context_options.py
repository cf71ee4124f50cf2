"""``bench/long_context.py``'s options beyond the three-runtime run of test_long_context.py:
llama.cpp's q8_0 KV cache (a tiny config whose head_dim 32 is one q8_0 block), our ORT engine with
int4 and int8 weights, and ``--shape`` (a random-weight model of bench/scale_probe.py's shapes; the
smallest, ``tiny``, here)."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from conftest import save_tiny
from test_calibrate_cli import write_corpus

import llama_cpp  # noqa: F401  (the test extra installs it: a missing runtime fails, never skips)

pytestmark = pytest.mark.slow  # a real server or runtime behind every test

SHORT = ["--contexts", "24", "--batches", "1", "--prefill-lens", "none", "--decode-steps", "2", "--repeats", "2",
         "--warmup", "1", "--capacity-step", "256", "--threads", "1", "--calib-tokens", "256", "--runs", "1",
         "--memory-cap", "none"]


def _run(argv: list[str]) -> dict:
    from harp_trt.bench.long_context import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_llamacpp_q8_0_kv(tmp_path):
    """KV bytes as llama.cpp allocates a q8_0 cache: 34 bytes per block of 32 elements
    (vendor/llama.cpp/ggml/src/ggml-common.h, block_q8_0), so 1.0625 bytes per element; one K or V
    row per layer is kv_heads x head_dim = 2 x 32 = 2 blocks. 4 layers, P = 2: dense 4 x 2 x 68 = 544
    bytes per token, HARP 272. The batch-1 context holds 4096 cells (the model's positions): 2.125 and
    1.0625 MiB, which llama.cpp logs with 2 decimals (2.12 / 1.06), hence the tolerance of 0.005 MiB
    over the smaller size. The budget is 2048 dense tokens exactly, so the fits are whole 256-token
    steps (dense 2048, HARP 4096) and the capacity ratio L/(L-P) = 2 within one step of the HARP fit."""
    model = save_tiny("llama", tmp_path / "tiny", seed=3, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    res = _run(["--model", str(model), "--corpus", str(write_corpus(tmp_path / "c.txt")), "--prune-layers", "2,3",
                "--runtime", "llamacpp", "--kv-type", "q8_0", "--kv-budget", str(544 * 2048),
                "--workdir", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *SHORT])
    r = res["runtimes"]["llamacpp"]
    assert r["kv_type"] == "q8_0" and r["kv_bytes_per_element"] == 34 / 32
    kv = r["kv_bytes_per_token"]
    assert kv["counted"] == {"dense": 544.0, "harp": 272.0}
    tol = 0.005 / 1.0625
    assert abs(kv["ratio"] - 0.5) <= tol, kv
    for v in ("dense", "harp"):
        assert abs(kv[v] / kv["counted"][v] - 1) <= tol, (v, kv)
    cap = r["kv_capacity"]
    assert cap["per_layer"] and cap["ideal"] == 2.0
    assert cap["dense"]["tokens"] == 2048 and abs(cap["ratio"] - 2.0) <= 256 / 2048, cap
    (m,) = r["decode"]
    assert m["ideal"]["ideal"] > 1 and m["per_engine"]["harp"]["tokens_per_s"] > 0


def test_llamacpp_quantized_weights_and_converter_peer(tmp_path):
    """``--gguf-type q8_0``: both GGUFs quantized by llama.cpp's quantizer and timed (the verified f16
    files dropped); the byte ideal reads the dense file's matrices as stored, 34 bytes per block of 32
    (block_q8_0; the f16 files give 2.0, test_long_context.py). ``--peer llamacpp-convert``: the dense
    model as llama.cpp's own converter writes it (architecture llama, not our deci) and its quantizer
    quantizes it, timed beside the dense engine. ``--kv-fill written``: every engine's cache written
    through llama.cpp's state reader, and llama.cpp holds what was written: its own state writer gives
    back the written bytes, for each sequence of a 2-stream context, the HARP file's fewer KV layers
    included."""
    import numpy as np

    from _llamacpp_convert import fetch_converter
    from harp_trt.bench.stage.gguf_meta import gguf_fields, matrix_bytes_per_param
    from harp_trt.llamacpp_runtime import LlamaModel, state_layout, written_state

    fetch_converter(tmp_path / "cache" / "llamacpp-converter")   # the wheelhouse's sdist, where the bench looks
    q = _run(["--shape", "tiny-llama", "--tokenizer", "smollm2-135m", "--prune-layers", "4,5",
              "--corpus", str(write_corpus(tmp_path / "c.txt")), "--runtime", "llamacpp",
              "--workdir", str(tmp_path / "cache"), *SHORT, "--gguf-type", "q8_0", "--peer", "llamacpp-convert",
              "--kv-fill", "written", "--batches", "2", "--out", str(tmp_path / "q8_0")])["runtimes"]["llamacpp"]
    assert q["weight_bytes_per_param"] == 34 / 32
    files = [Path(q["engines"][v]["gguf"]) for v in ("dense", "harp")]
    for f in files:
        assert f.name == "model-q8_0.gguf" and not (f.parent / "model.gguf").exists(), f
    peer = q["peer_files"]["llamacpp-convert"]
    assert gguf_fields(peer)["general.architecture"] == "llama" and matrix_bytes_per_param(peer) == 34 / 32
    assert gguf_fields(files[0])["general.architecture"] == "deci"
    for m in q["decode"]:
        assert m["kv_fill"] == "written" and m["prompt"] == m["context"] - 1 - 2 * 2
        for e in ("dense", "harp", "llamacpp-convert"):
            assert m["per_engine"][e]["tokens_per_s"] > 0 and m["per_engine"][e]["kv_tokens"] >= m["batch"] * m["context"]
        assert m["ideal"]["ideal"] > 1 and m["peer_ratio"]["llamacpp-convert"]["speedup"] > 0
    for f in files:
        with LlamaModel(f, stage="test") as m, m.context(n_ctx=2 * 40, n_batch=80, n_ubatch=80, n_seq=2, threads=1,
                                                          flash_attn=True, kv_type="f16") as c:
            c.write_sequences(30, np.random.default_rng(5))
            rng = np.random.default_rng(5)
            for seq in range(2):
                held = c.sequence_state(seq)
                assert held == written_state(state_layout(held, "test"), 30, seq, rng)
            assert c.decode(np.zeros((2, 1), np.int32), 30, False).shape == (2, 1, m.n_vocab)


@pytest.mark.parametrize("rt, per_seq", [("ort", 16 * 2**20), ("llamacpp", 8 * 2**20)])
def test_capacity_under_a_memory_cap_wired(tmp_path, rt, per_seq):
    """``--memory-cap auto --cap-context 4096``: the engines this run timed, measured by
    bench/_long_context_capacity.py in capped children (its own tests check the search). head_dim 64:
    one dense sequence's KV at 4096 is 16 MiB on ORT (fp32), 8 MiB on llama.cpp (f16); P = 2 of 4."""
    model = save_tiny("llama", tmp_path / "tiny", seed=3, hidden_size=128, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    common = ["--model", str(model), "--corpus", str(write_corpus(tmp_path / "c.txt")), "--prune-layers", "2,3",
              "--workdir", str(tmp_path / "cache"), *SHORT, "--memory-cap", "auto", "--cap-context", "4096"]
    res = _run([*common, "--runtime", rt, "--out", str(tmp_path / rt)])
    assert res["settings"]["memory_cap"] == "auto" and res["settings"]["cap_context"] == 4096
    c = res["runtimes"][rt]["capacity_under_cap"]
    assert c["runtime"] == rt and c["context"] == 4096 and c["ideal"] == 2.0
    assert c["kv_bytes_per_token"]["dense"] * 4096 == per_seq
    assert c["cap_bytes"] == int(c["base"]["dense"]["base_vm"] + 10.5 * per_seq)
    d, h = c["dense"]["batch"], c["harp"]["batch"]
    assert 1 <= d <= 10 and d < h and c["ratio"] == h / d, c
    for v in ("dense", "harp"):   # the timed engines, from this run's cache
        assert c[v]["tries"][0]["engine"].startswith(str(tmp_path / "cache"))
    if rt == "ort":
        assert c["fraction_of_ideal"] >= 0.9, c


def test_written_kv_decodes_at_the_same_positions(tmp_path):
    """``--kv-fill written`` (the 7B decode): our ORT engine's cache written directly, no
    prefill; the timed steps cover the same positions as a prefilled run's and the engines' caches
    hold batch x context tokens at the end (llama.cpp's written cache: the converter-peer test). An
    engine that cannot write its cache (genai's) is a typed error before any step."""
    from harp_trt.bench._long_context_measure import measure_decode
    from harp_trt.errors import ConfigError

    model = save_tiny("llama", tmp_path / "tiny", seed=3)
    common = ["--model", str(model), "--corpus", str(write_corpus(tmp_path / "c.txt")), "--prune-layers", "2,3",
              "--workdir", str(tmp_path / "cache"), *SHORT, "--batches", "1,2"]
    runs = {f: _run([*common, "--runtime", "ort", "--kv-fill", f, "--out", str(tmp_path / f)])
            for f in ("written", "prefill")}
    assert runs["written"]["settings"]["kv_fill"] == "written"
    for w, p in zip(runs["written"]["runtimes"]["ort"]["decode"], runs["prefill"]["runtimes"]["ort"]["decode"]):
        assert w["kv_fill"] == "written" and p["kv_fill"] == "prefill" and w["replicated"] == []
        assert (w["context"], w["batch"], w["prompt"], w["timed_positions"]) == \
               (p["context"], p["batch"], p["prompt"], p["timed_positions"])
        for v in ("dense", "harp"):
            e = w["per_engine"][v]
            assert e["kv_tokens"] == p["per_engine"][v]["kv_tokens"] and e["tokens_per_s"] > 0
        assert w["speedup"]["speedup"] > 0
    with pytest.raises(ConfigError, match="cannot have its KV cache written directly"):
        measure_decode({"dense": object(), "harp": object()}, 100, 24, 1, 2, 2, 1, kv_fill="written")


@pytest.fixture(scope="module")
def shape_runs(tmp_path_factory):
    """``--shape tiny`` (qwen2, 6 layers, hidden 64, vocab 49152) with int4 and then int8 ORT engines,
    one workdir: the random model, plan, export and rewrite are made once."""
    d = tmp_path_factory.mktemp("longctx-shape")
    tok = save_tiny("llama", d / "tok")   # only its tokenizer files are borrowed
    common = ["--shape", "tiny", "--tokenizer", str(tok), "--prune-layers", "4,5", "--runtime", "ort",
              "--corpus", str(write_corpus(d / "c.txt")), "--kv-budget", "1MiB", "--workdir", str(d / "cache"),
              *SHORT]
    return {q: _run([*common, "--quant", q, "--out", str(d / q)]) for q in ("int4", "int8")}


@pytest.mark.parametrize("quant, bits, wb", [("int4", 4, 0.5), ("int8", 8, 1.0)])
def test_ort_quantized_engines(shape_runs, quant, bits, wb):
    res = shape_runs[quant]
    r = res["runtimes"]["ort"]
    assert res["settings"]["quant"] == quant and r["weight_bytes_per_param"] == wb
    assert r["kv_bytes_per_element"] == 4   # weights quantized, the KV cache stays fp32
    for v in ("dense", "harp"):
        q = r["engines"][v]["engine"]["quant"]
        assert q["mode"] == quant and q["bits"] == bits and q["matmuls"] > 0
    assert r["kv_bytes_per_token"]["ratio"] == 4 / 6   # whole buffers: exact
    (m,) = r["decode"]
    assert m["ideal"]["ideal"] > 1 and m["per_engine"]["dense"]["tokens_per_s"] > 0


def test_shape_model_wires_through(shape_runs):
    """The model is scale_probe's tiny shape with random weights: its config, 6 layers, P = 2."""
    from transformers import AutoConfig

    from harp_trt.bench.scale_probe import SHAPES

    res = shape_runs["int4"]
    assert res["settings"]["shape"] == "tiny" and res["model"].rstrip("/").endswith("tiny-seed0")
    cfg = AutoConfig.from_pretrained(res["model"])
    for k in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings"):
        assert getattr(cfg, k) == SHAPES["tiny"][k], k
    assert res["plan"]["num_layers"] == 6 and res["plan"]["layers"] == [4, 5]
    assert res["model_digest"] == shape_runs["int8"]["model_digest"]   # written once


def test_shape_needs_prune_layers(capsys):
    from harp_trt.bench.long_context import main

    assert main(["--shape", "tiny"]) == 2
    assert "--prune-layers" in capsys.readouterr().err


def test_peer_plan_times_a_second_plans_engine_beside(tmp_path, capsys):
    """``--peer-plan``: the HARP engine of a second plan of the same model (an ``rrr`` plan beside
    HARP's alphas) timed in the same rounds, ``vs_harp`` its speed against the first plan's HARP engine
    with a paired interval; a plan of another model exits 2 before any work."""
    from harp_trt.bench.long_context import main
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan

    folder = save_tiny("llama", tmp_path / "tiny", seed=5, max_position_embeddings=256)
    resolved = resolve_model(str(folder), tmp_path / "cache")
    plans = []
    for name, alphas in (("harp", (0.5, 0.5)), ("other", (1.0, 0.3))):
        plans.append(tmp_path / f"{name}.json")
        Plan(model_ref=str(folder), model_digest=resolved.digest, family="llama", num_layers=4, strategy="given",
             layers=(2, 3), alphas=alphas).save(plans[-1])
    res = _run(["--plan", str(plans[0]), "--peer-plan", str(plans[1]), "--runtime", "ort", "--workdir",
                str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *SHORT])
    assert res["peer_plan"]["alphas"] == [1.0, 0.3]
    for runtime in ("ort",):   # every runtime takes the same path (load_pair); --runtime all passed too (250 s)
        (m,) = res["runtimes"][runtime]["decode"]
        v = m["vs_harp"]["peer-plan"]
        assert v["pairs"] == 2 and v["speedup_ci95_low"] <= v["speedup"] <= v["speedup_ci95_high"]
        assert m["per_engine"]["peer-plan"]["kv_bytes"] == m["per_engine"]["harp"]["kv_bytes"]   # same layers pruned
    other = save_tiny("llama", tmp_path / "other", seed=6, max_position_embeddings=256)
    Plan(model_ref=str(other), model_digest=resolve_model(str(other), tmp_path / "cache").digest, family="llama",
         num_layers=4, strategy="given", layers=(2, 3), alphas=(0.5, 0.5)).save(tmp_path / "foreign.json")
    capsys.readouterr()
    assert main(["--plan", str(plans[0]), "--peer-plan", str(tmp_path / "foreign.json"), "--workdir",
                 str(tmp_path / "cache"), "--out", str(tmp_path / "out2"), *SHORT]) == 2
    assert "plan of another model" in capsys.readouterr().err
