"""OrtCausalLM and the ORT engine builder: logits and greedy generation against Hugging Face for
every family (dense graph and GroupQueryAttention engine), HARP engines, engine.json, sampling,
the generate CLI and typed errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from _exported import HARP_ALPHAS, engine, exported, head_dim, tiny
from conftest import make_tiny
from harp_trt.builders.ort.builder import OrtBuilder
from harp_trt.builders.ort.config import OrtBuildConfig
from harp_trt.errors import ConfigError, GraphError
from harp_trt.ort_session import OrtCausalLM, sample_next

ATOL = 1e-4  # fp32: observed max |diff| ~3e-7 on tiny models

IDS = np.array([[1, 1, 1, 40, 41, 42, 43, 44], [50, 51, 52, 53, 54, 55, 56, 57]])
MASK = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])


def _hf_generate(model, n: int) -> np.ndarray:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return model.generate(input_ids=torch.from_numpy(IDS), attention_mask=torch.from_numpy(MASK),
                              max_new_tokens=n, do_sample=False).numpy()


def _decode_against_hf(model, lm, ids: np.ndarray, mask: np.ndarray, steps: int):
    """Prefill ``ids`` (left padding in ``mask``) then ``steps`` - 1 decode steps through ``lm``'s cache,
    each step's logits within ATOL of HF's forward with its own cache; returns ``lm``'s past."""
    from transformers.cache_utils import DynamicCache

    mask, cur = mask.copy(), ids.copy()
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    cache, past = DynamicCache(config=model.config), None
    for step in range(steps):
        with torch.no_grad():
            ref = model(input_ids=torch.from_numpy(cur), attention_mask=torch.from_numpy(mask),
                        position_ids=torch.from_numpy(pos), cache=cache, use_cache=True).logits.numpy()
        got, past = lm.forward(cur, mask, pos, past)
        valid = mask[:, -cur.shape[1]:].astype(bool)
        assert got.shape == ref.shape
        assert np.abs(got - ref)[valid].max() <= ATOL, f"step {step}"
        cur = ref[:, -1].argmax(-1)[:, None]
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], 1)
        pos = pos[:, -1:] + 1
    return past


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["onnx", "engine"])
def test_left_padded_prefill_and_decode_logits(family, kind):
    """Prefill (left padding, batch 2) then 3 decode steps with the cache, vs HF forward."""
    lm = OrtCausalLM(exported(family) if kind == "onnx" else engine(family), intra_op_threads=2)
    past = _decode_against_hf(tiny(family), lm, IDS, MASK, 4)
    assert past[0][0].shape == (2, 2, IDS.shape[1] + 3, head_dim(family))


@pytest.mark.parametrize("kind", ["onnx", "engine"])
def test_greedy_generate_equals_hf(family, kind):
    ref = _hf_generate(tiny(family), 16)
    lm = OrtCausalLM(exported(family) if kind == "onnx" else engine(family), intra_op_threads=2)
    got = lm.generate(IDS, MASK, max_new_tokens=16)
    assert got.shape == (2, IDS.shape[1] + 16)
    np.testing.assert_array_equal(got, ref)


def test_gqa_engine_converts_every_layer_and_records_layout():
    spec = json.loads((engine("mistral") / "engine.json").read_text())
    assert spec["format"] == "harp-engine/1" and spec["backend"] == "ort"
    assert spec["attention"]["converted_layers"] == [0, 1, 2, 3] and spec["attention"]["skipped"] == {}
    assert spec["kv"] == {**spec["kv"], "layers": [0, 1, 2, 3], "num_layers": 4, "kv_heads": 2,
                          "head_dim": 16, "dtype": "float32", "bytes_per_token": 4 * 2 * 2 * 16 * 4}
    assert spec["verify"]["logits_max_abs_diff"] <= spec["verify"]["tolerance"]
    import onnx

    ops = {n.op_type for n in onnx.load(str(engine("mistral") / "model.onnx")).graph.node}
    assert "GroupQueryAttention" in ops and "Attention" not in ops
    # gemma2 is exported with eager attention (soft-capping): nothing to convert, reported
    g = json.loads((engine("gemma2") / "engine.json").read_text())
    assert g["attention"]["converted_layers"] == [] and "no opset-23 Attention" in g["attention"]["skipped"]["*"]


def test_gqa_engine_runs_batched_chunks_after_a_past():
    """ORT's CPU GQA refuses batch>1 multi-token chunks with a past; OrtCausalLM runs those by row."""
    a = OrtCausalLM(exported("llama"), intra_op_threads=2)
    b = OrtCausalLM(engine("llama"), intra_op_threads=2)
    _, past = a.forward(IDS[:, :5], MASK[:, :5], np.clip(np.cumsum(MASK[:, :5], 1) - 1, 0, None))
    pos = np.clip(np.cumsum(MASK, 1) - 1, 0, None)[:, 5:]
    la, pa = a.forward(IDS[:, 5:], MASK, pos, past)
    lb, pb = b.forward(IDS[:, 5:], MASK, pos, past)
    assert np.abs(la - lb).max() <= ATOL and np.abs(pa[3][1] - pb[3][1]).max() <= ATOL


@pytest.mark.slow
def test_harp_engine_has_kv_only_for_kept_layers():
    dense = json.loads((engine("qwen2") / "engine.json").read_text())["kv"]
    harp = json.loads((engine("qwen2", harp=True) / "engine.json").read_text())["kv"]
    L, P = 4, len(HARP_ALPHAS)
    assert harp["layers"] == [0, 2] and harp["num_layers"] == L
    assert harp["bytes_per_token"] * L == dense["bytes_per_token"] * (L - P)
    assert harp["dense_bytes_per_token"] == dense["bytes_per_token"]
    assert [r["kv"] for r in harp["per_layer"]] == [True, False, True, False]

    lm = OrtCausalLM(engine("qwen2", harp=True), intra_op_threads=2)
    assert lm.kv_layers == [0, 2] and lm.kv_bytes_per_token() == harp["bytes_per_token"]
    assert set(lm.empty_past(2)) == {0, 2}
    np.testing.assert_array_equal(lm.generate(IDS, MASK, max_new_tokens=16),
                                  _hf_generate(tiny("qwen2", harp=True), 16))


def test_sampling_is_seeded_and_filters():
    lm = OrtCausalLM(engine("llama"), intra_op_threads=2)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_p=0.9)
    a = lm.generate(IDS, MASK, seed=3, **kw)
    assert np.array_equal(a, lm.generate(IDS, MASK, seed=3, **kw))
    assert not np.array_equal(a, lm.generate(IDS, MASK, seed=4, **kw))
    # top_k=1 and a tiny top_p both reduce sampling to argmax
    greedy = lm.generate(IDS, MASK, max_new_tokens=8)
    np.testing.assert_array_equal(lm.generate(IDS, MASK, max_new_tokens=8, do_sample=True, top_k=1, seed=0), greedy)
    np.testing.assert_array_equal(lm.generate(IDS, MASK, max_new_tokens=8, do_sample=True, top_p=1e-6, seed=0), greedy)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    rng = np.random.default_rng(0)
    draws = {int(sample_next(logits, True, top_p=0.7, rng=rng)[0]) for _ in range(200)}
    assert draws == {0, 1}


def test_stop_tokens_and_streamer():
    lm = OrtCausalLM(engine("llama"), intra_op_threads=2)
    greedy = lm.generate(IDS, MASK, max_new_tokens=10)
    stop = int(greedy[0, IDS.shape[1] + 2])  # row 0's third new token
    seen = []
    out = lm.generate(IDS, MASK, max_new_tokens=10, stop_token_ids=[stop], pad_token_id=7, streamer=seen.append)
    assert len(seen) == out.shape[1] - IDS.shape[1]
    first = int(np.argmax(out[0, IDS.shape[1]:] == stop))
    assert (out[0, IDS.shape[1] + first + 1:] == 7).all()
    np.testing.assert_array_equal(np.stack(seen, 1), out[:, IDS.shape[1]:])


def test_bad_inputs_raise_typed_errors(tmp_path):
    with pytest.raises(GraphError, match=r"\[ort\] no ONNX model at"):
        OrtCausalLM(tmp_path / "missing.onnx")
    trunc = tmp_path / "model.onnx"
    trunc.write_bytes(exported("llama").read_bytes()[:20000])
    with pytest.raises(GraphError, match="cannot load"):
        OrtCausalLM(trunc)
    with pytest.raises(GraphError, match="no ONNX model"):
        OrtBuilder().build(tmp_path / "nope.onnx", tmp_path / "out")
    with pytest.raises(GraphError, match=r"\[build-ort\] .*model.onnx is not a readable ONNX model"):
        OrtBuilder().build(trunc, tmp_path / "out")
    broken = tmp_path / "engine"
    shutil.copytree(engine("llama"), broken)
    (broken / "engine.json").write_text("{not json")
    with pytest.raises(GraphError, match="not valid JSON"):
        OrtCausalLM.from_engine(broken)
    with pytest.raises(ConfigError, match="attention must be 'gqa' or 'onnx'"):
        OrtBuildConfig(attention="flash")
    with pytest.raises(ConfigError, match="unknown graph_optimization_level"):
        OrtCausalLM(exported("llama"), graph_optimization_level="max")
    lm = OrtCausalLM(engine("llama"), intra_op_threads=2)
    with pytest.raises(ConfigError, match="attention_mask"):
        lm.generate(IDS, MASK[:, :3])
    with pytest.raises(ConfigError, match="past has layers"):
        lm.forward(IDS, MASK, MASK, {0: lm.empty_past(2)[0]})


def test_generate_cli(tmp_path, capsys):
    """Engine with the model folder's tokenizer -> `harp-trt generate --json`."""
    from conftest import save_tiny
    from harp_trt.cli import main

    folder = save_tiny("mistral", tmp_path / "m")  # seed 0: the weights of exported("mistral")
    eng = tmp_path / "engine"
    spec = OrtBuilder().build(exported("mistral"), eng, OrtBuildConfig(intra_op_threads=2), tokenizer_dir=folder)
    assert "tokenizer.json" in spec["tokenizer_files"] and (eng / "config.json").is_file()

    rc = main(["generate", "--artifact", str(eng), "--prompt", "Hello world", "--max-new-tokens", "6", "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lm = OrtCausalLM(eng / "model.onnx")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(eng)
    ids = tok("Hello world", add_special_tokens=False)["input_ids"]
    want = lm.generate(np.array([ids]), max_new_tokens=6, stop_token_ids=[tok.eos_token_id])[0, len(ids):]
    assert res["tokens"] == len(want) and res["text"] == tok.decode(want, skip_special_tokens=True)
    assert res["seconds"] > 0 and res["tokens_per_s"] > 0 and res["kv_layers"] == 4

    assert main(["generate", "--artifact", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
    assert "no engine folder or cached artifact" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_engine_generates_like_hf(smollm2, smollm2_export):
    """Real model: export stage -> GQA engine -> greedy tokens equal HF's (batch 2, left padding)."""
    from harp_trt.builders.ort.builder import OrtBuildStage
    from harp_trt.models import load_tokenizer

    _, model, _ = smollm2
    store, export = smollm2_export
    eng = OrtBuildStage().execute(store, OrtBuildConfig(intra_op_threads=2), {"onnx": export})
    spec = eng.manifest["engine"]
    assert len(spec["attention"]["converted_layers"]) == 30
    assert spec["kv"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    tok = load_tokenizer(eng.path)
    tok.padding_side = "left"
    batch = tok(["The capital of France is", "Water boils at a temperature of"], return_tensors="np",
                padding=True, add_special_tokens=False)
    lm = OrtCausalLM.from_engine(eng.path)
    got = lm.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=12)
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = model.generate(input_ids=torch.from_numpy(batch["input_ids"]),
                             attention_mask=torch.from_numpy(batch["attention_mask"]),
                             max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id or 0).numpy()
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_static_cache_decode_equals_the_growing_past(family):
    """In-place KV (GQA past/present buffer sharing): the same logits as a growing numpy past,
    step by step, with left padding, through a buffer that has to grow twice."""
    from harp_trt.ort_session import StaticCache

    lm = OrtCausalLM(engine(family, harp=True), intra_op_threads=2)
    if family == "gemma2":  # its sliding-window layers keep the opset-23 Attention (no GQA)
        assert not lm.shares_kv_buffer
        with pytest.raises(ConfigError, match="GroupQueryAttention on every KV layer"):
            lm.static_cache(lm.empty_past(1), 4)
        return
    assert lm.shares_kv_buffer
    mask, pos = MASK.copy(), np.clip(np.cumsum(MASK, 1) - 1, 0, None)
    logits, past = lm.forward(IDS, mask, pos)
    cache = lm.static_cache(past, capacity=IDS.shape[1] + 1)   # full after one step
    assert isinstance(cache, StaticCache) and cache.length == IDS.shape[1]
    tok, pos = logits[:, -1].argmax(-1)[:, None], pos[:, -1:] + 1
    for step in range(6):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        ref, past = lm.forward(tok, mask, pos, past)
        got = lm.decode_step(cache, tok, mask, pos)
        assert np.abs(got - ref).max() <= 1e-5, f"step {step}"
        tok, pos = ref[:, -1].argmax(-1)[:, None], pos + 1
    assert cache.capacity >= cache.length == IDS.shape[1] + 6 > IDS.shape[1] + 1  # it grew
    for i, (k, v) in cache.past().items():
        np.testing.assert_allclose(k, past[i][0], atol=1e-6)
        np.testing.assert_allclose(v, past[i][1], atol=1e-6)
    assert cache.nbytes() == sum(k.nbytes + v.nbytes for k, v in past.values())
    with pytest.raises(ConfigError, match="decode_step takes"):
        lm.decode_step(cache, tok, mask, pos)  # mask one token short


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_sliding_window_layers_fuse_with_gqa_local_window(family, tmp_path):
    """A sliding window (every Mistral v0.1 layer; Gemma3's local layers) becomes GroupQueryAttention's
    ``local_window_size`` = the window: left-padded prefill of 13 tokens and 5 decode steps through a
    window of 4 equal transformers' own sliding mask (the build's verification fails at 3 or 5)."""
    from harp_trt.export.export import export_dense

    model = make_tiny(family, sliding_window=4, max_position_embeddings=256)
    spec = OrtBuilder().build(export_dense(model, tmp_path / "export"), tmp_path / "engine", OrtBuildConfig())
    assert spec["attention"]["converted_layers"] == [0, 1, 2, 3] and spec["attention"]["skipped"] == {}
    import onnx

    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), None)
               for n in onnx.load(str(tmp_path / "engine" / "model.onnx")).graph.node
               if n.op_type == "GroupQueryAttention"]
    windows = [None if w in (None, -1) else w for w in windows]   # -1: ORT's "no window" default
    assert windows == {"mistral": [4] * 4, "gemma3": [4, 4, None, 4]}[family]   # Gemma3's layer 2 is global
    lm = OrtCausalLM(tmp_path / "engine", intra_op_threads=2)
    ids = np.random.default_rng(0).integers(3, 120, (2, 13))
    mask = np.ones_like(ids)
    mask[0, :3] = 0
    _decode_against_hf(model, lm, ids, mask, 6)
