"""TensorRT-LLM checkpoint writer: written files, read back by the independent PyTorch reader, compute
the PyTorch HARP model (fp32 max |diff| <= 1e-4) for every family and tp/pp layout; config fields,
tensor names, shapes and splits match TensorRT-LLM's converters; bad input gets typed errors."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from builders.trtllm import (TrtllmCheckpointConfig, TrtllmCheckpointStage, read_checkpoint,
                             read_hf_decilm, write_checkpoint, write_hf_decilm)
from builders.trtllm.checkpoint import ModelDims, fold_vo, pp_layers
from harp_trt.errors import ConfigError, PreconditionError
from harp_trt.harp import apply_harp
from harp_trt.plan import Plan
from harp_trt.store import ArtifactStore

from conftest import FAMILY_NAMES, make_tiny

TOL = 1e-4
ALPHAS = {2: 0.7, 3: 0.0}  # one scaled layer, one removed block (alpha = 0)
SEQ = 20                   # longer than Gemma2's tiny sliding window (8)


def _plan(family: str, alphas=ALPHAS, n: int = 4) -> Plan:
    layers = tuple(sorted(alphas))
    return Plan("tiny", "0" * 64, family, n, "test", layers, tuple(alphas[i] for i in layers))


def _model(family: str, **kw):
    if family == "gemma2":
        kw.setdefault("tie_word_embeddings", True)  # TensorRT-LLM's Gemma always ties lm_head
    return make_tiny(family, **kw)


@pytest.fixture(scope="module")
def cases():
    """family -> (model, HARP reference logits on fixed ids, ids); built once for the module."""
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for fam in FAMILY_NAMES:
        m = _model(fam)
        ref = apply_harp(copy.deepcopy(m), ALPHAS)
        with torch.no_grad():
            out[fam] = (m, ref(ids).logits, ids)
    return out


# ---- numerics -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_roundtrip_equals_harp_reference(cases, tmp_path, family, tp, pp):
    model, want, ids = cases[family]
    info = write_checkpoint(model, _plan(family), tmp_path, dtype="float32", tp_size=tp, pp_size=pp)
    assert info["files"] == sorted(f"rank{r}.safetensors" for r in range(tp * pp))
    got = read_checkpoint(tmp_path)(ids)
    assert got.shape == want.shape == (2, SEQ, 128)
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{family} tp={tp} pp={pp}: max |diff| {diff:.3g} > {TOL}"


def test_tp_above_kv_heads_duplicates_kv(cases, tmp_path):
    """tp=4 > 2 KV heads: each rank holds one copy of KV head rank // 2 (dup_kv_weight)."""
    model, want, ids = cases["llama"]
    write_checkpoint(model, _plan("llama"), tmp_path, dtype="float32", tp_size=4)
    v = model.model.layers[0].self_attn.v_proj.weight.detach()
    for r in range(4):
        qkv = load_file(str(tmp_path / f"rank{r}.safetensors"))["transformer.layers.0.attention.qkv.weight"]
        assert qkv.shape == ((1 + 2) * 16, 64)  # 1 query head, 1 k head, 1 v head per rank
        torch.testing.assert_close(qkv[32:48], v[(r // 2) * 16:(r // 2 + 1) * 16], rtol=0, atol=0)
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() <= TOL


def test_lm_head_is_zero_padded_to_tp(tmp_path):
    model = make_tiny("qwen2", vocab_size=127)
    ids = torch.randint(0, 127, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), ALPHAS)(ids).logits
    write_checkpoint(model, _plan("qwen2"), tmp_path, dtype="float32", tp_size=2)
    heads = [load_file(str(tmp_path / f"rank{r}.safetensors"))["lm_head.weight"] for r in range(2)]
    assert [h.shape[0] for h in heads] == [64, 64]
    assert torch.count_nonzero(heads[1][-1]) == 0  # the padding row
    got = read_checkpoint(tmp_path)(ids)
    assert got.shape[-1] == 127 and (got - want).abs().max().item() <= TOL


def test_one_token_window_is_load_bearing(cases, tmp_path):
    """Without the per-layer window of 1, the zero-Q/K pruned layers would average V over the
    prefix instead of reading the token's own V: the reader must then disagree with HARP."""
    model, want, ids = cases["qwen2"]
    write_checkpoint(model, _plan("qwen2", {2: 0.7, 3: 0.9}), tmp_path, dtype="float32")
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), {2: 0.7, 3: 0.9})(ids).logits
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() <= TOL
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["runtime_defaults"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() > 1e-2


# ---- config fields, tensor names, shapes ------------------------------------------------------
def test_decilm_config_and_tensor_layout_tp2_pp2(cases, tmp_path):
    model, _, _ = cases["llama"]
    write_checkpoint(model, _plan("llama"), tmp_path, dtype="float16", tp_size=2, pp_size=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == "DeciLMForCausalLM" and cfg["dtype"] == "float16"
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and cfg["hidden_act"] == "silu"
    assert [c["attention"] for c in cfg["layer_configs"]] == [
        {"impl": "attention", "num_key_value_heads": 2}, {"impl": "attention", "num_key_value_heads": 2},
        {"impl": "linear", "num_key_value_heads": None}, {"impl": "no_op", "num_key_value_heads": None}]
    assert all(c["ffn"] == {"impl": "mlp", "intermediate_size": 128} for c in cfg["layer_configs"])
    r0, r2 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 2))  # (tp0, pp0), (tp0, pp1)
    assert set(r0) == {"transformer.vocab_embedding.weight"} | {
        f"transformer.layers.{i}.{n}" for i in (0, 1) for n in (
            "input_layernorm.weight", "attention.qkv.weight", "attention.dense.weight", "post_layernorm.weight",
            "ffn.fc.weight", "ffn.gate.weight", "ffn.proj.weight")}
    # pp stage 1 holds global layers 2 (linear) and 3 (no_op) as local 0 and 1
    assert set(r2) == {"lm_head.weight", "transformer.ln_f.weight",
                       "transformer.layers.0.input_layernorm.weight", "transformer.layers.0.attention.weight"} | {
        f"transformer.layers.{i}.{n}" for i in (0, 1) for n in (
            "post_layernorm.weight", "ffn.fc.weight", "ffn.gate.weight", "ffn.proj.weight")}
    assert all(t.dtype == torch.float16 for t in (*r0.values(), *r2.values()))
    assert r0["transformer.layers.0.attention.qkv.weight"].shape == ((2 + 1 + 1) * 16, 64)
    assert r0["transformer.layers.0.attention.dense.weight"].shape == (64, 32)
    assert r0["transformer.layers.0.ffn.fc.weight"].shape == (64, 64)
    assert r0["transformer.layers.0.ffn.proj.weight"].shape == (64, 64)
    assert r0["transformer.vocab_embedding.weight"].shape == (128, 64)  # replicated
    assert r2["lm_head.weight"].shape == (64, 64)
    lin = torch.cat([load_file(str(tmp_path / f"rank{r}.safetensors"))["transformer.layers.0.attention.weight"]
                     for r in (2, 3)]).float()
    a = model.model.layers[2].self_attn
    want = fold_vo(a.v_proj.weight.detach(), a.o_proj.weight.detach(), ModelDims.of(model.config), 0.7)
    torch.testing.assert_close(lin, want.half().float(), rtol=0, atol=0)
    # the GQA fold equals the explicit repeat_kv then o_proj, in fp32
    rep = a.v_proj.weight.detach().view(2, 1, 16, 64).expand(2, 2, 16, 64).reshape(64, 64)
    torch.testing.assert_close(want, 0.7 * a.o_proj.weight.detach() @ rep, rtol=1e-5, atol=1e-6)


def test_qwen2_window_layers_keep_v_bias_and_zero_qk(cases, tmp_path):
    model, _, _ = cases["qwen2"]
    write_checkpoint(model, _plan("qwen2"), tmp_path, dtype="float32", max_seq_len=256)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == "Qwen2ForCausalLM" and cfg["qwen_type"] == "qwen2" and cfg["attn_bias"]
    assert cfg["runtime_defaults"] == {"max_attention_window": [256, 256, 1, 1], "sink_token_length": 0}
    w = load_file(str(tmp_path / "rank0.safetensors"))
    qkv, bias = w["transformer.layers.2.attention.qkv.weight"], w["transformer.layers.2.attention.qkv.bias"]
    assert torch.count_nonzero(qkv[:64 + 32]) == 0 and torch.count_nonzero(bias[:64 + 32]) == 0
    a = model.model.layers[2].self_attn
    torch.testing.assert_close(bias[96:], a.v_proj.bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w["transformer.layers.2.attention.dense.weight"],
                               0.7 * a.o_proj.weight.detach(), rtol=0, atol=0)
    assert "transformer.layers.2.attention.dense.bias" not in w
    assert w["transformer.layers.2.mlp.fc.weight"].equal(model.model.layers[2].mlp.gate_proj.weight.detach())
    assert w["transformer.layers.2.mlp.gate.weight"].equal(model.model.layers[2].mlp.up_proj.weight.detach())


def test_gemma2_norms_embedding_and_alpha_in_post_norm(cases, tmp_path):
    model, _, _ = cases["gemma2"]
    write_checkpoint(model, _plan("gemma2"), tmp_path, dtype="float32", tp_size=2, max_seq_len=64)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == "Gemma2ForCausalLM" and cfg["share_embedding_table"]
    assert cfg["use_parallel_embedding"] and cfg["query_pre_attn_scalar"] == 16
    assert cfg["attn_logit_softcapping"] == 50.0 and cfg["final_logit_softcapping"] == 30.0
    assert cfg["runtime_defaults"]["max_attention_window"] == [8, 64, 1, 1]  # sliding, full, pruned
    w0, w1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    emb = model.model.embed_tokens.weight.detach()
    assert w0["transformer.vocab_embedding.weight"].equal(emb[:64]) and w1["transformer.vocab_embedding.weight"].equal(emb[64:])
    layer = model.model.layers[2]
    torch.testing.assert_close(w0["transformer.layers.2.post_layernorm.weight"],
                               0.7 * (1 + layer.post_attention_layernorm.weight.detach()), rtol=0, atol=0)
    torch.testing.assert_close(w0["transformer.layers.1.pre_feedforward_layernorm.weight"],
                               1 + model.model.layers[1].pre_feedforward_layernorm.weight.detach(), rtol=0, atol=0)
    assert torch.count_nonzero(w0["transformer.layers.3.post_layernorm.weight"]) == 0  # alpha = 0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_kv_per_layer_follows_the_plan(cases, tmp_path, family):
    """Pruned layers hold no KV (DeciLM: no KV heads; window routes: one token per sequence)."""
    model, _, _ = cases[family]
    write_checkpoint(model, _plan(family), tmp_path, dtype="float16", max_seq_len=64)
    ck = read_checkpoint(tmp_path)
    tokens = ck.kv_cache_tokens(64)
    if family in ("llama", "mistral"):
        assert ck.kv_heads_per_layer() == [2, 2, 0, 0] and tokens == [64, 64, 0, 0]
    else:
        assert tokens[2:] == [1, 1] and min(tokens[:2]) > 1
    assert all(tokens[i] <= 1 for i in ALPHAS)
    assert all(tokens[i] > 1 for i in range(4) if i not in ALPHAS)


def test_pp_layer_assignment_gives_first_stages_the_extra_layer():
    assert [pp_layers(5, 2, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [pp_layers(4, 3, r) for r in range(3)] == [[0, 1], [2], [3]]


def test_already_patched_model_writes_identical_files(cases, tmp_path):
    model, _, _ = cases["mistral"]
    write_checkpoint(model, _plan("mistral"), tmp_path / "a", dtype="float32", tp_size=2)
    patched = apply_harp(copy.deepcopy(model), ALPHAS)
    write_checkpoint(patched, _plan("mistral"), tmp_path / "b", dtype="float32", tp_size=2)
    for r in range(2):
        a, b = (load_file(str(tmp_path / d / f"rank{r}.safetensors")) for d in "ab")
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


# ---- HF heterogeneous (DeciLM block_configs) checkpoint ----------------------------------------
def test_hf_decilm_checkpoint_llama(tmp_path):
    model = make_tiny("llama", intermediate_size=256)  # DeciLM widths are multiples of 256
    r = write_hf_decilm(model, _plan("llama"), tmp_path, dtype="float32")
    assert r["written"] and r["ffn_mult"] == 6.0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DeciLMForCausalLM"] and cfg["model_type"] == "nemotron-nas"
    attn = [b["attention"] for b in cfg["block_configs"]]
    assert [a["n_heads_in_group"] for a in attn] == [2, 2, None, None]
    assert [a["replace_with_linear"] for a in attn] == [False, False, True, False]
    assert [a["no_op"] for a in attn] == [False, False, False, True]
    w = load_file(str(tmp_path / "model.safetensors"))
    assert w["model.layers.2.self_attn.linear_attn.weight"].shape == (64, 64)
    assert not any(k.startswith("model.layers.3.self_attn") or k == "model.layers.3.input_layernorm.weight" for k in w)
    assert "model.layers.2.self_attn.q_proj.weight" not in w
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), ALPHAS)(ids).logits
    assert (read_hf_decilm(tmp_path)(ids) - want).abs().max().item() <= TOL
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert hf.block_configs[2].attention.replace_with_linear and hf.block_configs[3].attention.no_op


def test_hf_decilm_refuses_what_it_cannot_express(cases, tmp_path):
    r = write_hf_decilm(cases["qwen2"][0], _plan("qwen2"), tmp_path / "q")
    assert not r["written"] and "DeciLM lacks" in r["reason"]
    r = write_hf_decilm(cases["llama"][0], _plan("llama"), tmp_path / "l")  # intermediate 128
    assert not r["written"] and "multiple of 256" in r["reason"]
    assert not (tmp_path / "q").exists() and not (tmp_path / "l").exists()


# ---- the stage --------------------------------------------------------------------------------
def test_stage_writes_verified_artifact_and_caches(cases, tmp_path):
    model, _, _ = cases["qwen2"]
    store = ArtifactStore(tmp_path)
    cfg = TrtllmCheckpointConfig(dtype="bfloat16", tp_size=2, pp_size=2, max_input_len=64, max_seq_len=128)
    art = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("qwen2"), "model": model})
    man = art.manifest
    assert man["stage"] == "trtllm" and not art.cached
    assert man["verification"]["passed"] and man["verification"]["max_abs_diff"] <= man["verification"]["tolerance"]
    assert man["checkpoint"]["architecture"] == "Qwen2ForCausalLM"
    assert man["checkpoint"]["kv_bytes_per_sequence"] < man["checkpoint"]["kv_bytes_per_sequence_unpruned"]
    assert man["engine"]["built"] is False and "build_engine.sh" in man["engine"]["reason"]
    assert Plan.load(art.path / "plan.json") == _plan("qwen2")
    assert sorted(os.listdir(art.path / "checkpoint")) == ["config.json"] + [f"rank{r}.safetensors" for r in range(4)]
    assert "max_attention_window: [128, 128, 1, 1]" in (art.path / "llm_api_options.yaml").read_text()
    script = (art.path / "build_engine.sh").read_text()
    for flag in ('--checkpoint_dir "$HERE/checkpoint"', '--output_dir "$OUT"', "--gemm_plugin auto",
                 "--kv_cache_type paged", "--max_batch_size 8", "--max_input_len 64", "--max_seq_len 128",
                 "--workers 4"):
        assert flag in script
    assert os.access(art.path / "build_engine.sh", os.X_OK)
    again = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("qwen2"), "model": model})
    assert again.cached and again.key == art.key


def test_stage_llama_writes_hf_format(tmp_path):
    model = make_tiny("llama", intermediate_size=256)
    cfg = TrtllmCheckpointConfig(dtype="float32", max_input_len=32, max_seq_len=64)
    art = TrtllmCheckpointStage().execute(ArtifactStore(tmp_path), cfg, {"plan": _plan("llama"), "model": model})
    assert art.manifest["hf_checkpoint"]["written"] and (art.path / "hf" / "model.safetensors").is_file()
    assert art.manifest["verification"]["max_abs_diff"] <= TOL
    assert not (art.path / "llm_api_options.yaml").exists()  # DeciLM needs no per-layer windows


# ---- errors -----------------------------------------------------------------------------------
def test_tp_not_dividing_heads_names_valid_values(cases, tmp_path):
    with pytest.raises(ConfigError, match=r"tp_size=3 does not divide the model's 4 attention heads.*"
                                          r"valid tp_size values for this model: 1, 2, 4"):
        write_checkpoint(cases["llama"][0], _plan("llama"), tmp_path, tp_size=3)


def test_pp_above_layer_count(cases, tmp_path):
    with pytest.raises(ConfigError, match=r"pp_size=5 exceeds the model's 4 decoder layers; valid pp_size values: 1..4"):
        write_checkpoint(cases["gemma2"][0], _plan("gemma2"), tmp_path, pp_size=5)


@pytest.mark.parametrize("dtype", ["fp8", "int8", "fp16"])
def test_unsupported_dtype(cases, tmp_path, dtype):
    with pytest.raises(ConfigError, match=f"unsupported TensorRT-LLM dtype '{dtype}'; valid: float16, bfloat16, float32"):
        write_checkpoint(cases["llama"][0], _plan("llama"), tmp_path, dtype=dtype)
    with pytest.raises(ConfigError, match="valid: float16, bfloat16, float32"):
        TrtllmCheckpointConfig.from_dict({"dtype": dtype})


def test_stage_rejects_bad_layout_before_writing(cases, tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(ConfigError, match="valid tp_size values"):
        TrtllmCheckpointStage().execute(store, TrtllmCheckpointConfig(tp_size=8),
                                        {"plan": _plan("llama"), "model": cases["llama"][0]})
    assert store.list() == [] and not any((tmp_path / ".tmp").iterdir())


def test_config_rejects_unknown_keys_and_bad_lengths():
    with pytest.raises(ConfigError, match="unknown key.*tp.*valid keys: dtype, tp_size, pp_size"):
        TrtllmCheckpointConfig.from_dict({"tp": 2})
    with pytest.raises(ConfigError, match=r"max_input_len \(4096\) exceeds max_seq_len \(2048\)"):
        TrtllmCheckpointConfig.from_dict({"max_input_len": 4096})
    with pytest.raises(ConfigError, match="tokens_per_block must be a power of two"):
        TrtllmCheckpointConfig.from_dict({"tokens_per_block": 48})


def test_plan_for_another_model_is_a_precondition_error(cases, tmp_path):
    with pytest.raises(PreconditionError, match=r"\[trtllm\] plan is for family 'qwen2' but the model is 'llama'"):
        write_checkpoint(cases["llama"][0], _plan("qwen2"), tmp_path)
    with pytest.raises(PreconditionError, match="plan has 6 layers but the model has 4"):
        write_checkpoint(cases["llama"][0], _plan("llama", n=6), tmp_path)
    patched = apply_harp(copy.deepcopy(cases["llama"][0]), {1: 0.5})
    with pytest.raises(PreconditionError, match=r"model layers \[1\] are HARP-pruned but not in the plan"):
        write_checkpoint(patched, _plan("llama"), tmp_path)


def test_untied_gemma2_is_refused(tmp_path):
    with pytest.raises(PreconditionError, match="always ties lm_head to the embedding"):
        write_checkpoint(make_tiny("gemma2"), _plan("gemma2"), tmp_path)
