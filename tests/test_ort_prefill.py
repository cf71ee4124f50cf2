"""A generator's prefill on an ORT engine: the ``logits_to_keep`` input
(builders/ort/logits_to_keep.py) returns the same last rows as the all-position graph, and the
chunked prefill through a StaticCache (``OrtCausalLM.prefill``) gives the logits and KV cache of the
one-call prefill, for every family (gemma2 keeps eager attention: no GQA, so one call) and a HARP
engine. fp32 tolerance as tests/test_ort_engine.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from _exported import engine, exported
from harp_trt.errors import ConfigError
from harp_trt.onnx_io import LOGITS_TO_KEEP
from harp_trt.ort_session import OrtCausalLM, StaticCache

ATOL = 1e-4
S = 23          # not a multiple of the chunk: the last chunk is short


def _prompt(lm: OrtCausalLM, s: int = S, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.random.default_rng(seed).integers(3, int(lm.vocab_size), (1, s))
    return ids, np.ones_like(ids), np.arange(s)[None]


@pytest.mark.slow
def test_engine_takes_logits_to_keep(family):
    """The engine takes the input (forward feeds 0: every position); engine.json names the LM
    head it cut; an exported graph has no such input."""
    lm = OrtCausalLM(engine(family), intra_op_threads=2)
    assert lm.takes_logits_to_keep
    assert LOGITS_TO_KEEP in {i.name for i in lm.session.get_inputs()}
    ids, mask, pos = _prompt(lm)
    assert lm.forward(ids, mask, pos)[0].shape == (1, S, lm.vocab_size)
    spec = json.loads((engine(family) / "engine.json").read_text())
    assert spec["logits_to_keep"]["lm_head"], spec["logits_to_keep"]
    g = onnx.load(str(engine(family) / "model.onnx"), load_external_data=False).graph
    assert [d.dim_param or d.dim_value for d in next(o for o in g.output if o.name == "logits")
            .type.tensor_type.shape.dim][1] == "kept"
    assert not OrtCausalLM(exported(family), intra_op_threads=2).takes_logits_to_keep


@pytest.mark.slow
@pytest.mark.parametrize("keep", [1, 5])
def test_logits_to_keep_rows_equal_all_positions(family, keep):
    lm = OrtCausalLM(engine(family), intra_op_threads=2)
    ids, mask, pos = _prompt(lm)
    full, past_full = lm.forward(ids, mask, pos)
    kept, past_kept = lm.forward(ids, mask, pos, logits_to_keep=keep)
    assert kept.shape == (1, keep, lm.vocab_size)
    np.testing.assert_allclose(kept, full[:, -keep:], atol=ATOL, rtol=0)
    for i in lm.kv_layers:
        np.testing.assert_array_equal(past_kept[i][0], past_full[i][0])


def test_logits_to_keep_on_an_engine_without_the_input(family):
    """A graph without the input (the export) is sliced after the call: same contract."""
    lm = OrtCausalLM(exported(family), intra_op_threads=2)
    ids, mask, pos = _prompt(lm)
    full, _ = lm.forward(ids, mask, pos)
    np.testing.assert_array_equal(lm.forward(ids, mask, pos, logits_to_keep=1)[0], full[:, -1:])
    with pytest.raises(ConfigError, match="logits_to_keep"):
        lm.forward(ids, mask, pos, logits_to_keep=-1)


@pytest.mark.slow
@pytest.mark.parametrize("harp", [False, True])
@pytest.mark.parametrize("chunk", [1, 7])
def test_chunked_prefill_equals_one_call(family, harp, chunk):
    """Chunks of 1 and 7 tokens into a StaticCache: the last logits and every layer's cache as
    one prefill call computes them, then the same greedy continuation."""
    lm = OrtCausalLM(engine(family, harp=harp), intra_op_threads=2)
    ids, mask, pos = _prompt(lm)
    ref, ref_past = lm.forward(ids, mask, pos)
    lm.prefill_chunk = chunk
    last, cache = lm.prefill(ids, mask, pos, S + 4)
    assert last.shape == (1, 1, lm.vocab_size)
    np.testing.assert_allclose(last, ref[:, -1:], atol=ATOL, rtol=0)
    converted = json.loads((engine(family, harp=harp) / "engine.json").read_text())["attention"]["converted_layers"]
    if set(converted) != set(lm.kv_layers):   # Gemma2 (eager attention: no GQA): no static cache
        assert not lm.shares_kv_buffer and not isinstance(cache, StaticCache)
        return
    assert isinstance(cache, StaticCache) and cache.length == S and cache.capacity >= S + 4
    for i, (k, v) in cache.past().items():
        np.testing.assert_allclose(k, ref_past[i][0], atol=ATOL, rtol=0)
        np.testing.assert_allclose(v, ref_past[i][1], atol=ATOL, rtol=0)
    lm.prefill_chunk = chunk
    chunked = lm.generate(ids, max_new_tokens=6)
    lm.prefill_chunk = 0
    np.testing.assert_array_equal(chunked, lm.generate(ids, max_new_tokens=6))


def test_prefill_batch_goes_in_one_call():
    """Left-padded batch 2: one call (ORT's CPU GQA takes chunks after a past for batch 1 only),
    the last logits of the all-position forward."""
    lm = OrtCausalLM(engine("llama"), intra_op_threads=2)
    lm.prefill_chunk = 3
    ids = np.random.default_rng(1).integers(3, int(lm.vocab_size), (2, 9))
    mask = np.ones_like(ids)
    mask[0, :4] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    ref, _ = lm.forward(ids, mask, pos)
    last, cache = lm.prefill(ids, mask, pos, 12)
    np.testing.assert_allclose(last, ref[:, -1:], atol=ATOL, rtol=0)
    assert isinstance(cache, StaticCache) and cache.length == 9
    with pytest.raises(ConfigError, match="one shape"):
        lm.prefill(ids, mask[:, 1:], pos, 12)


@pytest.mark.parametrize("quant", ["none", "int4", "int8", "w8a8"])
def test_chunks_before_the_last_skip_the_lm_head(tmp_path, quant):
    """Every engine declares the keep-none value in its metadata and computes no row at it (w8a8's
    output Reshape once read the empty axis as "copy"); a chunked prefill feeding it to every chunk
    but the last gives the one-call logits. Same engine both ways, so the fp32 tolerance."""
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.onnx_io import LOGITS_KEEP_NONE

    folder = engine("llama") if quant == "none" else tmp_path / quant
    if quant != "none":
        OrtBuilder().build(exported("llama"), folder, OrtBuildConfig(quant=quant, intra_op_threads=2))
    lm = OrtCausalLM(folder, intra_op_threads=2)
    assert lm.keeps_none and lm.shares_kv_buffer
    ids, mask, pos = _prompt(lm)
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos,
            LOGITS_TO_KEEP: np.array([LOGITS_KEEP_NONE], np.int64), **{
                i.name: np.zeros((1, lm.kv_heads, 0, lm.head_dim), np.float32)
                for i in lm.session.get_inputs() if i.name.startswith("past_key_values")}}
    assert lm.session.run(["logits"], feed)[0].shape == (1, 0, lm.vocab_size)
    ref, _ = lm.forward(ids, mask, pos)
    lm.prefill_chunk = 7
    last, cache = lm.prefill(ids, mask, pos, S)
    np.testing.assert_allclose(last, ref[:, -1:], atol=ATOL, rtol=0)


def test_an_engine_without_the_keep_none_metadata_keeps_the_last_row(tmp_path):
    """An engine built before the keep-none value (no metadata key) is fed 1 for every chunk, as then."""
    import shutil

    from harp_trt.onnx_io import LOGITS_TO_KEEP_META_KEY

    folder = shutil.copytree(engine("llama"), tmp_path / "old")
    m = onnx.load(str(folder / "model.onnx"))
    kept = [p for p in m.metadata_props if p.key != LOGITS_TO_KEEP_META_KEY]
    assert len(kept) == len(m.metadata_props) - 1
    del m.metadata_props[:]
    m.metadata_props.extend(kept)
    onnx.save(m, str(folder / "model.onnx"))
    lm = OrtCausalLM(folder, intra_op_threads=2)
    assert lm.takes_logits_to_keep and not lm.keeps_none
    ids, mask, pos = _prompt(lm)
    ref, _ = lm.forward(ids, mask, pos)
    lm.prefill_chunk = 7
    np.testing.assert_allclose(lm.prefill(ids, mask, pos, S)[0], ref[:, -1:], atol=ATOL, rtol=0)


def test_prefill_profile_bench_on_a_tiny_model(tmp_path):
    """bench/prefill_profile.py end to end on a tiny llama (fp32 and int4 engines, PyTorch): its last
    stdout line is the JSON; every side is timed, our sides profiled into the four parts (their sum
    within the call's time) with a speed-up, interval and ceiling over PyTorch; FLOPs count the
    causal triangle; the renderer turns it into the table."""
    from conftest import save_tiny
    from harp_trt.bench import prefill_profile as bench
    from harp_trt.bench import render_results as render

    folder = save_tiny("llama", tmp_path / "tiny", seed=0)
    out = bench.main(["--model", str(folder), "--workdir", str(tmp_path / "cache"), "--lengths", "40",
                      "--repeats", "2", "--engines", "none,int4,w8a8", "--one-call", "none,int4", "--chunk", "16",
                      "--decode-steps", "2", "--ppl-tokens", "0"])
    row = out["lengths"]["40"]
    assert set(row["sides"]) == {"ort_none_one_call", "ort_none", "ort_int4_one_call", "ort_int4", "ort_w8a8", "torch"}
    assert row["sides"]["ort_w8a8"]["profile_s"]["gemm"] > 0           # MatMulIntegerToFloat counted as GEMM
    assert set(row["gemm_peak_flops"]) == {"none", "int4", "w8a8"}
    for name, f in row["sides"].items():
        assert len(f["samples"]) == 2 and f["seconds"] > 0
        assert set(f["profile_s"]) == set(bench.CATEGORIES) and sum(f["profile_s"].values()) > 0
        if name != "torch":
            sp = f["speedup_vs_torch"]
            assert sp["speedup_ci95_low"] <= sp["speedup"] <= sp["speedup_ci95_high"] and sp["ceiling"] > 0
    assert row["sides"]["ort_none"]["profile_s"]["lm_head"] > 0          # the head's node found by name
    cfg = {"hidden_size": 4, "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    f = bench.flop_parts(cfg, 3, 1)   # q = 4, kv = 2, keys 1+2+3 = 6
    assert f == {"lm_head": 80, "gemm": 3 * 2 * (16 + 16 + 16 + 96), "attention": 4 * 4 * 6, "other": 0}
    assert out["machine"]["cpu_features"] is not None and out["decode_ms_per_token_at_512"]["ort_none"] > 0
    table = render.prefill_profile(out)
    assert table.count("\n| 40 |") == 6 and "chunked, last logits" in table
    # the ceiling's rates: the one-GEMM probe, or a side's own profiled GEMMs where they ran faster
    assert all(row["ceiling_gemm_flops"][q] >= v for q, v in row["gemm_peak_flops"].items())
    sp = row["sides"]["ort_none"]["speedup_vs_torch"]
    sp["speedup"] = sp["ceiling"] * 1.01        # a point above its bound is a bug, never a table row
    with pytest.raises(ValueError, match="above its ceiling"):
        render.prefill_profile(out)


@pytest.mark.slow
def test_prefill_profile_on_a_random_shape_with_another_block_size(tmp_path):
    """``--shape``: a random-weight model of a real shape (bench/_shapes.py) stands in for ``--model``,
    its engines built with ``--quant-block-size``, which the GEMM peaks use too; its perplexity is
    refused (random weights)."""
    from conftest import save_tiny
    from harp_trt.bench import prefill_profile as bench

    tok = save_tiny("llama", tmp_path / "tok")   # only its tokenizer files are borrowed
    common = ["--shape", "tiny-llama", "--tokenizer", str(tok), "--workdir", str(tmp_path / "cache")]
    with pytest.raises(SystemExit):
        bench.main(common)                         # --ppl-tokens defaults to 16384
    out = bench.main([*common, "--lengths", "24", "--repeats", "1", "--engines", "none,int4", "--one-call", "none",
                      "--quant-block-size", "64", "--decode-steps", "1", "--ppl-tokens", "0"])
    assert (out["model"], out["random_weights"], out["quant_block_size"]) == ("tiny-llama", True, 64)
    spec = json.loads((Path(out["engines"]["int4"]) / "engine.json").read_text())
    assert spec["quant"]["block_size"] == 64
    assert set(out["lengths"]["24"]["sides"]) == {"ort_none_one_call", "ort_none", "ort_int4", "torch"}
