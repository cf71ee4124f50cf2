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

from harp_trt.builders.trtllm import (TrtllmCheckpointConfig, TrtllmCheckpointStage, read_checkpoint,
                             read_hf_decilm, write_checkpoint, write_hf_decilm)
from harp_trt.builders.trtllm.checkpoint import fold_vo
from harp_trt.dims import ModelDims
from harp_trt.errors import ConfigError, PreconditionError
from harp_trt.harp import apply_harp
from harp_trt.mapping import ParallelMapping
from harp_trt.plan import Plan
from harp_trt.store import ArtifactStore

from conftest import FAMILY_NAMES, make_tiny


def _save(model, folder):
    """A model as a Hugging Face folder (with a tokenizer): the writer reads safetensors, never a
    loaded module."""
    from conftest import _tiny_tokenizer

    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer().save_pretrained(folder)
    return folder

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
def cases(tmp_path_factory):
    """family -> (model folder, HARP reference logits on fixed ids, ids, model); built once."""
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    root = tmp_path_factory.mktemp("models")
    out = {}
    for fam in FAMILY_NAMES:
        m = _model(fam)
        ref = apply_harp(copy.deepcopy(m), ALPHAS)
        with torch.no_grad():
            out[fam] = (_save(m, root / fam), ref(ids).logits, ids, m)
    return out


# ---- numerics -------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_roundtrip_equals_harp_reference(cases, tmp_path, family, tp, pp):
    folder, want, ids, _ = cases[family]
    if pp == 2 and family in ("qwen2", "gemma2"):  # per-layer windows: 1.2's KV manager misreads them at pp > 1
        with pytest.raises(ConfigError, match="build this checkpoint with pp_size=1"):
            write_checkpoint(folder, _plan(family), tmp_path, dtype="float32", tp_size=tp, pp_size=pp)
        return
    plan = _plan(family, {1: 0.7, 3: 0.0}) if pp == 2 else _plan(family)  # every stage keeps an attention layer
    if pp == 2:
        with torch.no_grad():
            want = apply_harp(copy.deepcopy(cases[family][3]), {1: 0.7, 3: 0.0})(ids).logits
    info = write_checkpoint(folder, plan, tmp_path, dtype="float32", tp_size=tp, pp_size=pp)
    assert info["files"] == sorted(f"rank{r}.safetensors" for r in range(tp * pp))
    got = read_checkpoint(tmp_path)(ids)
    assert got.shape == want.shape == (2, SEQ, 128)
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{family} tp={tp} pp={pp}: max |diff| {diff:.3g} > {TOL}"


def test_tp_above_kv_heads_duplicates_kv(cases, tmp_path):
    """tp=4 > 2 KV heads: each rank holds one copy of KV head rank // 2 (dup_kv_weight)."""
    folder, want, ids, model = cases["llama"]
    write_checkpoint(folder, _plan("llama"), tmp_path, dtype="float32", tp_size=4)
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
    write_checkpoint(_save(model, tmp_path / "m"), _plan("qwen2"), tmp_path, dtype="float32", tp_size=2)
    heads = [load_file(str(tmp_path / f"rank{r}.safetensors"))["lm_head.weight"] for r in range(2)]
    assert [h.shape[0] for h in heads] == [64, 64]
    assert torch.count_nonzero(heads[1][-1]) == 0  # the padding row
    got = read_checkpoint(tmp_path)(ids)
    assert got.shape[-1] == 127 and (got - want).abs().max().item() <= TOL


def test_one_token_window_is_load_bearing(cases, tmp_path):
    """Without the per-layer window of 1, the zero-Q/K pruned layers would average V over the
    prefix instead of reading the token's own V: the reader must then disagree with HARP."""
    folder, want, ids, model = cases["qwen2"]
    write_checkpoint(folder, _plan("qwen2", {2: 0.7, 3: 0.9}), tmp_path, dtype="float32")
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), {2: 0.7, 3: 0.9})(ids).logits
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() <= TOL
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["runtime_defaults"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() > 1e-2


# ---- config fields, tensor names, shapes ------------------------------------------------------
def test_decilm_config_and_tensor_layout_tp2_pp2(cases, tmp_path):
    folder, _, _, model = cases["llama"]
    with pytest.raises(ConfigError, match=r"pipeline stage 1 \(layers 2-3\) has no attention layer"):
        write_checkpoint(folder, _plan("llama"), tmp_path, dtype="float16", tp_size=2, pp_size=2)
    assert not (tmp_path / "config.json").exists()
    write_checkpoint(folder, _plan("llama", {1: 0.7, 3: 0.0}), tmp_path, dtype="float16", tp_size=2, pp_size=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == "DeciLMForCausalLM" and cfg["dtype"] == "float16"
    assert cfg["mapping"] == {"world_size": 4, "tp_size": 2, "pp_size": 2}
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and cfg["hidden_act"] == "silu"
    assert "runtime_defaults" not in cfg  # no sink_token_length (must be > 0) and no windows for DeciLM
    assert [c["attention"] for c in cfg["layer_configs"]] == [
        {"impl": "attention", "num_key_value_heads": 2}, {"impl": "linear", "num_key_value_heads": None},
        {"impl": "attention", "num_key_value_heads": 2}, {"impl": "no_op", "num_key_value_heads": None}]
    assert all(c["ffn"] == {"impl": "mlp", "intermediate_size": 128} for c in cfg["layer_configs"])
    r0, r2 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 2))  # (tp0, pp0), (tp0, pp1)
    mlp = ("post_layernorm.weight", "ffn.fc.weight", "ffn.gate.weight", "ffn.proj.weight")
    attn = ("input_layernorm.weight", "attention.qkv.weight", "attention.dense.weight")
    # stage 0: global 0 (attention) and 1 (linear) as local 0 and 1
    assert set(r0) == {"transformer.vocab_embedding.weight", "transformer.layers.1.input_layernorm.weight",
                       "transformer.layers.1.attention.weight"} | {
        f"transformer.layers.0.{n}" for n in attn} | {f"transformer.layers.{i}.{n}" for i in (0, 1) for n in mlp}
    # stage 1: global 2 (attention) and 3 (no_op) as local 0 and 1
    assert set(r2) == {"lm_head.weight", "transformer.ln_f.weight"} | {
        f"transformer.layers.0.{n}" for n in attn} | {f"transformer.layers.{i}.{n}" for i in (0, 1) for n in mlp}
    assert all(t.dtype == torch.float16 for t in (*r0.values(), *r2.values()))
    assert r0["transformer.layers.0.attention.qkv.weight"].shape == ((2 + 1 + 1) * 16, 64)
    assert r0["transformer.layers.0.attention.dense.weight"].shape == (64, 32)
    assert r0["transformer.layers.0.ffn.fc.weight"].shape == (64, 64)
    assert r0["transformer.layers.0.ffn.proj.weight"].shape == (64, 64)
    assert r0["transformer.vocab_embedding.weight"].shape == (128, 64)  # replicated
    assert r2["lm_head.weight"].shape == (64, 64)
    lin = torch.cat([load_file(str(tmp_path / f"rank{r}.safetensors"))["transformer.layers.1.attention.weight"]
                     for r in (0, 1)]).float()
    a = model.model.layers[1].self_attn
    want = fold_vo(a.v_proj.weight.detach(), a.o_proj.weight.detach(), ModelDims.from_config(model.config), 0.7)
    torch.testing.assert_close(lin, want.half().float(), rtol=0, atol=0)
    # the GQA fold equals the explicit repeat_kv then o_proj, in fp32
    rep = a.v_proj.weight.detach().view(2, 1, 16, 64).expand(2, 2, 16, 64).reshape(64, 64)
    torch.testing.assert_close(want, 0.7 * a.o_proj.weight.detach() @ rep, rtol=1e-5, atol=1e-6)


def test_qwen2_window_layers_keep_v_bias_and_zero_qk(cases, tmp_path):
    folder, _, _, model = cases["qwen2"]
    write_checkpoint(folder, _plan("qwen2"), tmp_path, dtype="float32", max_seq_len=256)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architecture"] == "Qwen2ForCausalLM" and cfg["qwen_type"] == "qwen2" and cfg["attn_bias"]
    # as QWenConfig.from_hugging_face writes it: getattr(hf_config, "seq_length", 8192); the HF Qwen2
    # config has none, and nothing in models/qwen/model.py reads it
    assert cfg["seq_length"] == 8192 and not hasattr(model.config, "seq_length")
    assert cfg["runtime_defaults"] == {"max_attention_window": [256, 256, 1, 1]}  # no sink_token_length
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
    folder, _, _, model = cases["gemma2"]
    write_checkpoint(folder, _plan("gemma2"), tmp_path, dtype="float32", tp_size=2, max_seq_len=64)
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
    folder = cases[family][0]
    info = write_checkpoint(folder, _plan(family), tmp_path, dtype="float16", max_seq_len=64)
    per_layer = 2 * 2 * 16 * 2  # K and V, 2 KV heads, head_dim 16, fp16
    native_full = 2 if family == "gemma2" else 4  # Gemma2's tiny config: layers 0 and 2 slide (window 8)
    assert info["kv_bytes_per_token_unpruned"] == native_full * per_layer
    assert info["kv_bytes_per_token"] == (1 if family == "gemma2" else 2) * per_layer
    ck = read_checkpoint(tmp_path)
    tokens = ck.kv_cache_tokens(64)
    if family in ("llama", "mistral"):
        assert ck.kv_heads_per_layer() == [2, 2, 0, 0] and tokens == [64, 64, 0, 0]
    else:
        assert tokens[2:] == [1, 1] and min(tokens[:2]) > 1
    assert all(tokens[i] <= 1 for i in ALPHAS)
    assert all(tokens[i] > 1 for i in range(4) if i not in ALPHAS)


def test_pp_layer_assignment_gives_first_stages_the_extra_layer():
    """The one layout both the writer and the reader use (``harp_trt.mapping``), pinned to
    TensorRT-LLM's ``Mapping.pp_layers`` (``torch.tensor_split(range(L), pp)``) and rank numbering
    (``rank = tp_rank + pp_rank * tp_size``) by literal values, so a wrong split fails here."""
    assert [ParallelMapping(pp_size=2).pp_layers(5, r) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [ParallelMapping(pp_size=3).pp_layers(4, r) for r in range(3)] == [[0, 1], [2], [3]]
    assert [ParallelMapping(pp_size=3).pp_layers(7, r) for r in range(3)] == [
        t.tolist() for t in torch.tensor_split(torch.arange(7), 3)]
    m = ParallelMapping(tp_size=2, pp_size=3)
    assert [m.rank(t, p) for p in range(3) for t in range(2)] == [0, 1, 2, 3, 4, 5]
    assert m.to_config() == {"world_size": 6, "tp_size": 2, "pp_size": 3}
    assert ParallelMapping.from_config({"tp_size": 2}) == ParallelMapping(2, 1)
    assert ParallelMapping.from_config(None).world_size == 1


# ---- HF heterogeneous (DeciLM block_configs) checkpoint ----------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_hf_decilm_checkpoint_llama(tmp_path, tied):
    model = make_tiny("llama", intermediate_size=256, tie_word_embeddings=tied)  # DeciLM widths: multiples of 256
    src = _save(model, tmp_path / "src")
    tmp_path = tmp_path / "hf"
    r = write_hf_decilm(src, _plan("llama"), tmp_path, dtype="float32")
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
    # written even when tied: TensorRT-LLM's DeciLM converter reads lm_head.weight unconditionally
    assert w["lm_head.weight"].equal(model.lm_head.weight.detach()) and cfg["tie_word_embeddings"] is tied
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), ALPHAS)(ids).logits
    assert (read_hf_decilm(tmp_path)(ids) - want).abs().max().item() <= TOL
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path, trust_remote_code=True)
    assert hf.block_configs[2].attention.replace_with_linear and hf.block_configs[3].attention.no_op


def test_hf_decilm_is_sharded_with_an_index(tmp_path):
    model = make_tiny("llama", intermediate_size=256)
    src = _save(model, tmp_path / "src")
    r = write_hf_decilm(src, _plan("llama"), tmp_path / "hf", dtype="float32", shard_bytes=200_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all(s in r["files"] for s in shards)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), ALPHAS)(ids).logits
    assert (read_hf_decilm(tmp_path / "hf")(ids) - want).abs().max().item() <= TOL


def test_hf_decilm_refuses_what_it_cannot_express(cases, tmp_path):
    r = write_hf_decilm(cases["qwen2"][0], _plan("qwen2"), tmp_path / "q")
    assert not r["written"] and "DeciLM lacks" in r["reason"]
    r = write_hf_decilm(cases["llama"][0], _plan("llama"), tmp_path / "l")  # intermediate 128
    assert not r["written"] and "multiple of 256" in r["reason"]
    assert not (tmp_path / "q").exists() and not (tmp_path / "l").exists()


# ---- the stage --------------------------------------------------------------------------------
def _resolved(folder):
    from harp_trt.models import ResolvedModel

    return ResolvedModel(str(folder), folder, "0" * 64, "folder")


def test_stage_writes_verified_artifact_and_caches(cases, tmp_path):
    model = _resolved(cases["qwen2"][0])
    store = ArtifactStore(tmp_path)
    cfg = TrtllmCheckpointConfig(dtype="bfloat16", tp_size=2, pp_size=1, max_input_len=64, max_seq_len=128,
                                 max_num_tokens=128)
    art = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("qwen2"), "model": model})
    man = art.manifest
    assert man["stage"] == "trtllm" and not art.cached
    assert man["verification"]["passed"] and man["verification"]["max_abs_diff"] <= man["verification"]["tolerance"]
    assert man["checkpoint"]["architecture"] == "Qwen2ForCausalLM"
    assert man["checkpoint"]["kv_bytes_per_token"] == man["checkpoint"]["kv_bytes_per_token_unpruned"] // 2
    assert man["engine"]["built"] is False and "build_engine.sh" in man["engine"]["reason"]
    assert Plan.load(art.path / "plan.json") == _plan("qwen2")
    assert sorted(os.listdir(art.path / "checkpoint")) == ["config.json"] + [f"rank{r}.safetensors" for r in range(2)]
    assert "max_attention_window: [128, 128, 1, 1]" in (art.path / "engine_llm_api_options.yaml").read_text()
    kv = man["launch"]["kv_runtime"]
    # two window sizes (1 and 128): the shares give the full-attention pool what it needs, not 1/2
    assert list(kv["window_size_shares"]) == ["1", "128"] and kv["window_size_shares"]["128"] > 0.5
    serve = (art.path / "serve_engine.sh").read_text()
    assert kv["shares_env"].split("=")[1] in serve and "--backend tensorrt" in serve and "--tp_size 2" in serve
    assert kv["kv_bytes_per_token_capacity"] < kv["kv_bytes_per_token_capacity_unpruned"]
    assert man["launch"]["pytorch_backend"]["available"] is False and "NemotronNAS" in man["launch"]["pytorch_backend"]["reason"]
    assert not (art.path / "serve_pytorch.sh").exists()
    script = (art.path / "build_engine.sh").read_text()
    for flag in ('--checkpoint_dir "$HERE/checkpoint"', '--output_dir "$OUT"', "--gemm_plugin auto",
                 "--kv_cache_type paged", "--max_batch_size 8", "--max_input_len 64", "--max_seq_len 128",
                 "--workers 2"):
        assert flag in script
    assert os.access(art.path / "build_engine.sh", os.X_OK)
    again = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("qwen2"), "model": model})
    assert again.cached and again.key == art.key


def test_stage_llama_writes_hf_format(tmp_path):
    from conftest import save_tiny

    folder = save_tiny("llama", tmp_path / "m", intermediate_size=256)
    cfg = TrtllmCheckpointConfig(dtype="float32", max_input_len=32, max_seq_len=64)
    art = TrtllmCheckpointStage().execute(ArtifactStore(tmp_path / "c"), cfg,
                                          {"plan": _plan("llama"), "model": _resolved(folder)})
    assert art.manifest["hf_checkpoint"]["written"] and (art.path / "hf" / "model.safetensors").is_file()
    assert art.manifest["verification"]["max_abs_diff"] <= TOL
    assert art.manifest["verification"]["hf_max_abs_diff"] <= TOL
    assert (art.path / "hf" / "tokenizer.json").is_file() and not (art.path / "hf" / "tokenizer_config.json").read_text() == ""
    opts = (art.path / "engine_llm_api_options.yaml").read_text()
    assert "max_attention_window" not in opts  # DeciLM needs no per-layer windows
    serve = (art.path / "serve_pytorch.sh").read_text()
    assert "--backend pytorch" in serve and "--trust_remote_code" in serve and os.access(art.path / "serve_pytorch.sh", os.X_OK)
    assert "trust_remote_code: true" in (art.path / "pytorch_llm_api_options.yaml").read_text()
    kv = art.manifest["launch"]["kv_runtime"]
    assert kv["window_size_shares"] is None and kv["kv_bytes_per_token_capacity"] == 2 * 2 * 2 * 16 * 4


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
                                        {"plan": _plan("llama"), "model": _resolved(cases["llama"][0])})
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


def test_untied_gemma2_is_refused(tmp_path):
    with pytest.raises(PreconditionError, match="always ties lm_head to the embedding"):
        write_checkpoint(_save(make_tiny("gemma2"), tmp_path / "m"), _plan("gemma2"), tmp_path / "out")
