"""bench/vs_genai.py and bench/_genai_baseline.py: the decode byte ideal read from two int4 engines; our
engines' timings, checked against a wall clock and against what the timed calls really ran (recorded
around the real calls: one forward over the whole prompt, the requested number of decode steps); the
script end to end on a tiny model, its figures checked against each other (medians of its own samples,
ratios the quotients of those medians, the targets' verdicts, the byte ideal of the engines it built);
and the staging of a config without architectures."""
from __future__ import annotations

import json
import math
import statistics
import time

import numpy as np
import pytest

from _exported import exported
from harp_trt.bench._genai_baseline import stage_hf_folder
from harp_trt.bench.vs_genai import DECODE_CONTEXT, _byte_ideal, _graph_bytes, _Ours, main
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from conftest import save_tiny

ENGINES = ("genai_int4", "dense_int4", "harp_int4")
METRICS = ("prefill_512_s", "prefill_2048_s", "decode_tokens_per_s")


@pytest.mark.slow
def test_byte_ideal_of_two_int4_engines(tmp_path, monkeypatch):
    q = OrtBuildConfig(quant="int4", intra_op_threads=2)
    dense, harp = tmp_path / "dense", tmp_path / "harp"
    OrtBuilder().build(exported("llama"), dense, q)
    OrtBuilder().build(exported("llama", harp=True), harp, q)
    # what MatMulNBits reads, from the graph: equal to the quantizer's own count
    assert _graph_bytes(dense) == json.loads((dense / "engine.json").read_text())["quant"]["weight_bytes_quantized"]
    ideal = _byte_ideal(dense, harp, context=100)
    d, h = ideal["dense"], ideal["harp"]
    assert h["weight_bytes"] < d["weight_bytes"]          # q/k of the pruned layers are gone
    assert h["kv_bytes"] * 2 == d["kv_bytes"]             # 2 of 4 layers keep KV
    assert ideal["ideal_speedup"] == round(d["bytes_per_step"] / h["bytes_per_step"], 4) > 1

    ours = _Ours(harp, threads=2)
    prompt = list(range(5, 40))
    forwards: list[tuple[tuple[int, ...], float]] = []
    real_forward = ours.lm.forward

    def recorded_forward(ids, *args, **kwargs):
        t0 = time.perf_counter()
        out = real_forward(ids, *args, **kwargs)
        forwards.append((tuple(ids.shape), time.perf_counter() - t0))
        return out

    monkeypatch.setattr(ours.lm, "forward", recorded_forward)
    t0 = time.perf_counter()
    prefill = ours.prefill_seconds(prompt)
    wall = time.perf_counter() - t0
    # one forward over the whole prompt, and the figure is that forward's time (plus the argmax),
    # inside the call's wall time
    assert [shape for shape, _ in forwards] == [(1, len(prompt))], forwards
    assert forwards[0][1] <= prefill <= wall, (forwards, prefill, wall)

    runs = []
    real_timed = ours.lm.timed_generate

    def recorded_timed(*args, **kwargs):
        seq, t = real_timed(*args, **kwargs)
        runs.append((seq, t))
        return seq, t

    monkeypatch.setattr(ours.lm, "timed_generate", recorded_timed)
    n = 4
    t0 = time.perf_counter()
    rate = ours.decode_tokens_per_s(prompt, n)
    wall = time.perf_counter() - t0
    (seq, t), = runs
    # the first token ends the prefill; n decode steps follow it, and the rate counts exactly those
    assert seq.shape == (1, len(prompt) + 1 + n) and t["new_tokens"] == 1 + n, (seq.shape, t)
    assert math.isclose(rate * t["decode_s"], n, rel_tol=1e-9), (rate, t)
    assert 0 < t["decode_s"] < t["seconds"] <= wall, (t, wall)
    # the timed run decoded the model's greedy continuation, not some other sequence
    from harp_trt.ort_session import OrtCausalLM
    assert np.array_equal(seq, OrtCausalLM(harp).generate(np.asarray([prompt]), max_new_tokens=1 + n))


@pytest.mark.slow
def test_vs_genai_figures_agree_with_each_other(tmp_path, capsys):
    """The script on a tiny Llama (vocabulary 20000 and 4096 positions, for its 2048-token prompts
    of ids < 20000) against onnxruntime-genai's int4 build of the same folder (~45 s on 2 cores)."""
    from harp_trt.bench._genai_baseline import genai_version

    assert genai_version() is not None, "onnxruntime-genai is not installed: pip install -e '.[test]'"
    folder = save_tiny("llama", tmp_path / "m", vocab_size=20000, max_position_embeddings=4096)
    repeats, decode = 3, 8
    assert main(["--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
                 "--repeats", str(repeats), "--decode-tokens", str(decode), "--threads", "2",
                 "--workdir", str(tmp_path / "cache")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["repeats"], out["decode_tokens"], out["threads"]) == (repeats, decode, 2)
    assert len(out["plan"]["layers"]) == len(out["plan"]["alphas"]) == 2
    for e in ENGINES:
        for m in METRICS:
            samples = out["samples"][e][m]
            assert len(samples) == repeats and all(s > 0 for s in samples), (e, m, samples)
            # the reported figure is the median of the samples, so it lies within them
            assert out[e][m] == round(statistics.median(samples), 4), (e, m, out[e][m], samples)
            assert min(samples) - 1e-4 <= out[e][m] <= max(samples) + 1e-4, (e, m)
        # four times the prompt is more work: a prefill that ignored its prompt would not show it
        assert out[e]["prefill_2048_s"] > out[e]["prefill_512_s"], (e, out[e])
    g, d, h = (out[e]["decode_tokens_per_s"] for e in ENGINES)
    targets = out["targets"]
    assert targets["dense_vs_genai_decode"] == round(d / g, 3)
    assert targets["harp_vs_genai_decode"] == round(h / g, 3)
    assert targets["harp_vs_dense_decode"] == round(h / d, 3)
    assert targets["dense_met"] == (d >= targets["dense_target"] * g) and targets["dense_target"] == 0.9
    assert targets["harp_target"] == out["ideal_speedup"]
    assert targets["harp_met"] == (h >= g * out["ideal_speedup"])
    # the byte ideal: dense over HARP bytes per decode step at the mid-decode context, 2 of 4 layers' KV
    b = out["bytes_per_decode_step"]
    for k in ("dense", "harp"):
        assert b[k]["bytes_per_step"] == b[k]["weight_bytes"] + b[k]["kv_bytes"]
    assert b["harp"]["kv_bytes"] * 2 == b["dense"]["kv_bytes"]
    # tiny Llama: 4 layers x (K, V) x 2 KV heads x head_dim 16 x fp32 bytes, at 512 + decode / 2 tokens
    assert b["dense"]["kv_bytes"] == 4 * 2 * 2 * 16 * 4 * (DECODE_CONTEXT + decode // 2)
    assert out["ideal_speedup"] == round(b["dense"]["bytes_per_step"] / b["harp"]["bytes_per_step"], 4) > 1
    mm = out["genai"]["graph"]["matmulnbits"]  # genai's model: the same MatMulNBits settings as ours
    assert (mm["bits"], mm["block_size"], mm["accuracy_level"]) == ([4], [32], [4]) and mm["count"] > 0, mm


def test_config_without_architectures_is_staged_with_them(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    staged, added = stage_hf_folder(folder, tmp_path / "staged")
    assert added == {"architectures": ["Qwen2ForCausalLM"]}
    assert json.loads((staged / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert (staged / "model.safetensors").resolve() == (folder / "model.safetensors").resolve()
