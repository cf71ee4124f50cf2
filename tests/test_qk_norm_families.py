"""The families people run now, end to end through the CLI on tiny random models built from
transformers' own config classes:

* Qwen3 (``harp_trt/families/qwen3.py``: per-head Q/K RMSNorm, ``head_dim`` of its own): ``build``
  calibrates, exports, rewrites (verified against the PyTorch HARP model) and builds ORT engines whose
  GroupQueryAttention fusion keeps the QK-norm (every kept layer converted, fp32 logits equal to the
  rewrite's); the genai folder's greedy tokens equal ours; ``deploy trtllm`` writes a Qwen3ForCausalLM
  checkpoint read back equal to the HARP model; llama.cpp refuses it with the reason (exit 2, one line). The per-family graph tests (export, HARP, engine, prefill, int4,
  rewrite) run it through ``conftest.ALL_FAMILIES``; a real tritonserver serves it in
  test_triton_server.py.
* Gemma3 (``harp_trt/families/gemma3.py``: Gemma2's sandwich norms, QK-norm after the head
  transpose, local and global layers with their own RoPE bases): a pruned global and a pruned local
  layer verified, the kept global layer GQA-fused, the genai folder, a Gemma3ForCausalLM checkpoint, the
  same llama.cpp refusal.
* Llama-3.2's shape (``model_type`` llama, tied embeddings, ``llama3`` RoPE scaling): ``build`` and
  the llama.cpp GGUF and TensorRT-LLM checkpoint, each verified against the PyTorch HARP model."""
from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from safetensors import safe_open

from conftest import save_tiny
from test_calibrate_cli import run_json, write_corpus

# Llama-3.2-1B/3B's RoPE scaling (config.json ``rope_scaling``), with a short original context so the
# scaled frequencies matter inside a tiny model's positions
LLAMA32 = {"tie_word_embeddings": True, "max_position_embeddings": 1024,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}}


def _build(capsys, folder: Path, cache: Path, corpus: Path, *extra: str) -> dict:
    code, res, err = run_json(capsys, "build", "--model", str(folder), "--layers", "2", "--tokens", "256",
                              "--seq-len", "64", "--corpus", str(corpus), "--alpha-grid", "0.5,1",
                              "--workdir", str(cache), "--json", *extra)
    assert code == 0, err
    return res


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    folder = save_tiny("qwen3", root / "tiny", seed=9, max_position_embeddings=1024)
    return folder, root / "cache", write_corpus(root / "corpus.txt")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Layers 0, 1, 3 local (window 8), 2 global: its own RoPE base (rope_parameters per layer type)."""
    root = tmp_path_factory.mktemp("gemma3")
    folder = save_tiny("gemma3", root / "tiny", seed=10, max_position_embeddings=1024)
    return folder, root / "cache", write_corpus(root / "corpus.txt")


@pytest.mark.slow
def test_gemma3_prunes_a_global_and_a_local_layer_and_fuses_the_kept_global_one(gemma3, capsys):
    """P = 2 (top: layers 2 global and 3 local) is verified against the PyTorch HARP model by the
    rewrite; P = 1 keeps the global layer 2, whose attention (QK-norm after the BNSH Transpose, its
    own RoPE base) becomes GroupQueryAttention, and the local layers 0, 1 become GroupQueryAttention
    with ``local_window_size`` 8 (their window); the engine build verifies each against the rewrite."""
    folder, cache, corpus = gemma3
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["layer_types"][2] == "full_attention"
    rope = cfg["rope_parameters"]
    assert rope["full_attention"]["rope_theta"] != rope["sliding_attention"]["rope_theta"]
    res = _build(capsys, folder, cache, corpus)
    assert res["layers"] == [2, 3]
    rewrite = json.loads((Path(res["stages"]["rewrite"]["artifact"]) / "rewrite_report.json").read_text())
    for layer in rewrite["layers"]:   # alpha after the post-attention norm, as Gemma2 (families/gemma3.py)
        assert layer["rule"] == "onnx-attention" and layer["mode"] == "alpha-in-norm-gain", layer
    assert rewrite["verification"]["greedy_steps"] == 32
    res = _build(capsys, folder, cache, corpus, "--layers", "1", "--quant", "int4")
    spec = json.loads((Path(res["engine"]) / "engine.json").read_text())
    assert res["layers"] == [3] and spec["attention"]["converted_layers"] == [0, 1, 2]
    assert spec["attention"]["skipped"] == {}
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1)
               for n in onnx.load(str(Path(res["engine"]) / "model.onnx")).graph.node if n.op_type == "GroupQueryAttention"]
    assert windows == [8, 8, -1]   # -1: ORT's "no window"


@pytest.mark.slow
def test_qwen3_builds_with_gqa_fused_around_its_qk_norm(qwen3, capsys):
    folder, cache, corpus = qwen3
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]
    for quant in ("none", "int4"):
        res = _build(capsys, folder, cache, corpus, "--quant", quant)
        kept = [l for l in range(4) if l not in res["layers"]]
        spec = json.loads((Path(res["engine"]) / "engine.json").read_text())
        assert spec["attention"]["converted_layers"] == kept and spec["attention"]["skipped"] == {}
        assert spec["verify"]["logits_max_abs_diff"] <= spec["verify"]["tolerance"]
        if quant == "none":   # the fused engine computes what the verified rewrite computes
            assert spec["verify"]["logits_max_abs_diff"] < 1e-5
    rewrite = next(cache.glob("rewrite-*"))
    report = json.loads((rewrite / "rewrite_report.json").read_text())
    assert report["verification"]["greedy_steps"] == 32
    d, h, kv, hd = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    for layer in report["layers"]:   # the QK-norm gains go with Q and K: HARP's removal, not clean-up
        assert {f"model.model.layers.{layer['layer']}.self_attn.{r}_norm.weight" for r in "qk"} <= \
            set(layer["initializers_removed"])
        assert not [n for n in layer["cleanup_initializers"] if "_norm" in n]
        if layer["alpha"] != 0.0:
            assert layer["harp_params_removed"] == d * h * hd + d * kv * hd + 2 * hd


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_genai_folder_greedy_equals_ours(family, request, capsys):
    folder, cache, corpus = request.getfixturevalue(family)
    res = _build(capsys, folder, cache, corpus, "--backend", "genai")
    genai = next(cache.glob("genai-*"))
    meta = json.loads((genai / "harp_genai.json").read_text())
    assert meta["verify"]["equal"] and meta["verify"]["greedy_tokens"] > 0
    assert meta["pruned_layers"] == res["layers"]


def _deploy(family: str, target: str, request, capsys):
    """``deploy TARGET`` on the family fixture's calibrated plan: (exit code, JSON, stderr, cache)."""
    folder, cache, corpus = request.getfixturevalue(family)
    _build(capsys, folder, cache, corpus)
    plan = next(cache.glob("calibrate-*"))
    capsys.readouterr()
    code, res, err = run_json(capsys, "deploy", target, "--plan", str(plan), "--model", str(folder),
                              "--workdir", str(cache), "--json")
    return code, res, err, cache


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_refused_where_the_format_cannot_express_it(family, request, capsys):
    """llama.cpp's deci graph has no per-head Q/K norm: exit 2, one line naming the targets that take it."""
    code, _, err, cache = _deploy(family, "gguf", request, capsys)
    assert code == 2 and "no per-head Q/K RMSNorm" in err and family in err
    assert not list(cache.glob("gguf-*"))
    assert "ort" in err.split("hint:")[-1] or "ORT" in err   # the line says which target takes it


@pytest.mark.parametrize("family,arch", [("qwen3", "Qwen3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM")])
def test_deploy_trtllm_writes_a_verified_qk_norm_checkpoint(family, arch, request, capsys):
    """``deploy trtllm`` on the calibrated plan: the family's own TensorRT-LLM architecture, window-1
    pruned layers, read back equal to the PyTorch HARP model with TensorRT-LLM's QK-norm eps
    (tests/test_trtllm_qk_norm.py has the layer-level checks)."""
    code, trt, err, _ = _deploy(family, "trtllm", request, capsys)
    assert code == 0, err
    assert trt["architecture"] == arch and trt["verify_max_abs_diff"] <= trt["verify_tolerance"]
    assert "QK-norm eps 1e-05 as TensorRT-LLM computes it (the model's own: 1e-06)" in trt["verify_reference"]


@pytest.mark.slow
def test_llama32_shape_end_to_end(tmp_path, capsys):
    """Tied embeddings and llama3 RoPE scaling through build, the GGUF and the TensorRT-LLM
    checkpoint, each verified against the PyTorch HARP model by its own stage."""
    folder = save_tiny("llama", tmp_path / "tiny", seed=13, **LLAMA32)
    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        assert "lm_head.weight" not in f.keys()   # tied: the checkpoint has no head of its own
    assert json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    cache = tmp_path / "cache"
    res = _build(capsys, folder, cache, write_corpus(tmp_path / "corpus.txt"), "--quant", "int4")
    spec = json.loads((Path(res["engine"]) / "engine.json").read_text())
    assert spec["attention"]["skipped"] == {} and spec["verify"]["top1_agreement"] == 1.0
    plan = next(cache.glob("calibrate-*"))
    code, gguf, err = run_json(capsys, "deploy", "gguf", "--plan", str(plan), "--model", str(folder),
                               "--workdir", str(cache), "--json")
    assert code == 0, err
    assert gguf["greedy_equal"] and gguf["verify_max_abs_diff"] <= gguf["verify_tolerance"]
    code, trt, err = run_json(capsys, "deploy", "trtllm", "--plan", str(plan), "--model", str(folder),
                              "--workdir", str(cache), "--json")
    assert code == 0, err
    assert trt["architecture"] == "DeciLMForCausalLM" and trt["verify_max_abs_diff"] < 1e-3


def test_presets_name_registered_families_and_the_multimodal_gemma3_is_refused_with_the_way_out():
    from harp_trt.errors import UnsupportedArchitectureError
    from harp_trt.families import FAMILIES, family_for_model_type
    from harp_trt.presets import PRESETS

    for name in ("qwen3-8b", "gemma3-1b", "llama3.2-3b"):
        assert PRESETS[name].family in FAMILIES.names() and not PRESETS[name].paper_alphas
    assert [PRESETS[n].family for n in ("qwen3-8b", "gemma3-1b", "llama3.2-3b")] == ["qwen3", "gemma3", "llama"]
    assert family_for_model_type("gemma3_text").name == "gemma3"
    with pytest.raises(UnsupportedArchitectureError, match="text-only checkpoints .*gemma3_text"):
        family_for_model_type("gemma3")


@pytest.mark.slow
def test_genai_builders_qwen3_graph_is_rewritten_and_verified(tmp_path, capsys):
    """A Qwen3 graph written by onnxruntime-genai's own model builder (0.18, fp32 CPU; run here, in this
    venv): it equals transformers' model, and ``harp-trt rewrite --onnx`` on it (GroupQueryAttention fed
    by a Split of the packed QKV, the split Q and K through their norms) equals the PyTorch HARP model.
    Vocabulary 256: the builder takes any Linear with vocab-many outputs for the LM head."""
    import subprocess
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "real_exports"))
    from make_fixtures import GENAI_BOOTSTRAP

    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.verify import VerifyConfig, verify_rewrite

    folder = save_tiny("qwen3", tmp_path / "tiny", seed=3, vocab_size=256, max_position_embeddings=256)
    out = tmp_path / "genai"
    proc = subprocess.run([sys.executable, "-c", GENAI_BOOTSTRAP, "-i", str(folder), "-o", str(out), "-p", "fp32",
                           "-e", "cpu", "-c", str(tmp_path / "hf-cache")], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dense = verify_rewrite(out / "model.onnx", folder, {}, VerifyConfig(rtol=1e-4, decode_steps=2, greedy_steps=4))
    assert dense.max_abs_diff <= dense.tolerance
    resolved = resolve_model(str(folder), tmp_path / "cache")
    Plan(model_ref=str(folder), model_digest=resolved.digest, family="qwen3", num_layers=4, strategy="given",
         layers=(2, 3), alphas=(0.3, 0.7)).save(tmp_path / "plan.json")
    code, res, err = run_json(capsys, "rewrite", "--onnx", str(out / "model.onnx"), "--plan", str(tmp_path / "plan.json"),
                              "--model", str(folder), "--workdir", str(tmp_path / "cache"), "--json")
    assert code == 0, err
    assert res["layers"] == [2, 3] and res["max_abs_diff"] <= res["tolerance"] and res["max_abs_diff"] < 1e-5
    report = json.loads((Path(res["artifact"]) / "rewrite_report.json").read_text())
    assert {l["rule"] for l in report["layers"]} == {"group-query-attention"}
    # HARP removes Q and K (their columns of the packed weight) and the QK-norm gains: 64 x (128 + 64) + 2 x 32
    assert all(l["harp_params_removed"] == 64 * (128 + 64) + 2 * 32 for l in report["layers"])
