"""TensorRT-LLM checkpoints of the QK-norm families, window-1 route: Qwen3 as
``Qwen3ForCausalLM`` (QWenForCausalLM, qwen_type qwen3) and Gemma3 text as ``Gemma3ForCausalLM``
(GemmaForCausalLM with the Gemma3 config group), pruned layers a one-token window over zeroed Q/K.

The independent reader (builders/trtllm/reader.py, its facts in trtllm_models.py) reads every written
file back and runs what TensorRT-LLM's TensorRT backend computes from it; the result must equal the
PyTorch HARP model (fp32, max |diff| <= 1e-4) when that model's Q/K norms use TensorRT-LLM's eps
(1e-5: ``Attention``'s default, which QWenDecoderLayer / GemmaDecoderLayer do not override; the
models' own is 1e-6). Each fact the result rests on is shown load-bearing: the eps, the norms' gains
(Gemma's stored as 1 + w), Gemma3's local RoPE base and window pattern, the refusal of tp layouts
whose ranks hold as many query as KV heads (TensorRT-LLM's QK-norm reads those interleaved)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from harp_trt.builders.trtllm import read_checkpoint, write_checkpoint
from harp_trt.builders.trtllm import checkpoint as ck
from harp_trt.builders.trtllm.stage import _qk_norm_eps
from harp_trt.errors import ConfigError, PreconditionError
from harp_trt.harp import apply_harp
from harp_trt.plan import Plan

from conftest import QK_NORM_FAMILIES, make_tiny
from test_trtllm_checkpoint import ALPHAS, SEQ, TOL, _plan, _save

# ALPHAS prune layers 2 and 3: Gemma3's tiny layers are 0, 1, 3 local (window 8) and 2 global, so both kinds
ARCH = {"qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (folder, HARP logits with TensorRT-LLM's QK-norm eps, HARP logits with the model's own, ids)."""
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    root = tmp_path_factory.mktemp("qk-models")
    out = {}
    for fam in QK_NORM_FAMILIES:
        m = make_tiny(fam)
        ref = apply_harp(copy.deepcopy(m), ALPHAS)
        with torch.no_grad():
            own = ref(ids).logits
            assert _qk_norm_eps(ref, 1e-5) == 1e-6
            trt = ref(ids).logits
        out[fam] = (_save(m, root / fam), trt, own, ids)
    return out


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", QK_NORM_FAMILIES)
def test_roundtrip_equals_harp_with_tensorrt_llms_qk_norm_eps(cases, tmp_path, family, tp):
    folder, want, own, ids = cases[family]
    info = write_checkpoint(folder, _plan(family), tmp_path, dtype="float32", tp_size=tp)
    assert info["architecture"] == ARCH[family] and info["route"] == "window1"
    got = read_checkpoint(tmp_path)(ids)
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{family} tp={tp}: max |diff| {diff:.3g} > {TOL}"
    # the eps is load-bearing here: against the model's own 1e-6 the same files are off by more
    assert (got - own).abs().max().item() > 10 * diff


@pytest.mark.parametrize("family", QK_NORM_FAMILIES)
def test_config_and_norm_tensors_are_what_tensorrt_llm_reads(cases, tmp_path, family):
    folder, _, _, _ = cases[family]
    write_checkpoint(folder, _plan(family), tmp_path, dtype="float32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    hf = json.loads((folder / "config.json").read_text())
    w = load_file(str(tmp_path / "rank0.safetensors"))
    src = load_file(str(next(folder.glob("*.safetensors"))))
    offset = 1.0 if family == "gemma3" else 0.0
    for i in range(4):   # kept and pruned layers alike: one [head_dim] gain each, Gemma's as 1 + w
        for n in "qk":
            got = w[f"transformer.layers.{i}.attention.{n}_layernorm.weight"]
            assert got.shape == (hf["head_dim"],)
            torch.testing.assert_close(got, offset + src[f"model.layers.{i}.self_attn.{n}_norm.weight"])
    qkv = w["transformer.layers.2.attention.qkv.weight"]   # a pruned layer: Q and K zeroed, V kept
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    assert not qkv[: q_rows + hf["num_key_value_heads"] * hf["head_dim"]].any()
    if family == "qwen3":
        assert (cfg["qwen_type"], cfg["attn_bias"], cfg["head_size"]) == ("qwen3", False, 32)
        assert cfg["runtime_defaults"] == {"max_attention_window": [256, 256, 1, 1]}
    else:
        assert cfg["_sliding_window_pattern"] == 3 and cfg["rope_local_base_freq"] == 10000.0
        assert cfg["rotary_base"] == 1000000.0 and cfg["sliding_window"] == 8
        assert cfg["query_pre_attn_scalar"] == hf["query_pre_attn_scalar"]
        assert cfg["runtime_defaults"] == {"max_attention_window": [8, 8, 1, 1]}


def test_gemma3_local_rope_base_and_windows_are_load_bearing(cases, tmp_path):
    """A local layer's RoPE base and window change the logits: with the local base set to the global
    one, or the kept local layers' windows opened to the whole sequence, the check fails."""
    folder, _, _, ids = cases["gemma3"]
    write_checkpoint(folder, _plan("gemma3", {3: 0.5}), tmp_path, dtype="float32")  # layer 2 global, kept
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(make_tiny("gemma3")), {3: 0.5})
        _qk_norm_eps(want, 1e-5)
        want = want(ids).logits
    assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() <= TOL
    cfg = json.loads((tmp_path / "config.json").read_text())
    for bad in ({"rope_local_base_freq": cfg["rotary_base"]},
                {"runtime_defaults": {"max_attention_window": [SEQ, SEQ, SEQ, 1]}}):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        assert (read_checkpoint(tmp_path)(ids) - want).abs().max().item() > 100 * TOL, bad


def test_gemma3_layer_types_off_the_period_are_refused(tmp_path):
    m = make_tiny("gemma3", layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "full_attention", "full_attention", "sliding_attention"],
                  num_hidden_layers=6)
    folder = _save(m, tmp_path / "hf")
    with pytest.raises(PreconditionError, match=r"do not follow one period.*_sliding_window_pattern"):
        write_checkpoint(folder, Plan("tiny", "0" * 64, "gemma3", 6, "test", (5,), (0.5,)), tmp_path / "out",
                         dtype="float32")
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_rank_with_as_many_query_as_kv_heads_is_refused(tmp_path, monkeypatch):
    """A rank holding as many query as KV heads (more than one): TensorRT-LLM's QK-norm branch then
    views its qkv rows as [heads, 3, head_size], q, k and v interleaved per head (layers/attention.py
    ``Attention.forward``), not the [Q | K | V] rows written. A multi-head Qwen3 (4 heads, 4 KV heads)
    is refused at tp 1 and 2, naming tp 4 (one head of each per rank, where both layouts agree). The
    reader computes that view, so the same files written past the refusal fail the check."""
    model = make_tiny("qwen3", num_key_value_heads=4)
    folder = _save(model, tmp_path / "hf")
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = apply_harp(copy.deepcopy(model), ALPHAS)
        _qk_norm_eps(ref, 1e-5)
        want = ref(ids).logits
    with pytest.raises(ConfigError, match=r"tp_size=1 .*more query than KV heads per rank, or one of each.*"
                                          r"valid tp_size values for this model: 4\b"):
        write_checkpoint(folder, _plan("qwen3"), tmp_path / "refused", dtype="float32")
    assert not (tmp_path / "refused" / "config.json").exists()
    write_checkpoint(folder, _plan("qwen3"), tmp_path / "tp4", dtype="float32", tp_size=4)
    assert (read_checkpoint(tmp_path / "tp4")(ids) - want).abs().max().item() <= TOL
    monkeypatch.setattr(ck, "_tp_problems", lambda *a: [])
    write_checkpoint(folder, _plan("qwen3"), tmp_path / "forced", dtype="float32")
    assert (read_checkpoint(tmp_path / "forced")(ids) - want).abs().max().item() > 100 * TOL
