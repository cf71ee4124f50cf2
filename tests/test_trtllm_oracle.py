"""The TensorRT-LLM checkpoint reader is an oracle independent of the writer: it imports nothing from
the family tables the writer follows (``FamilySpec.trtllm``), so changing one fact in the writer's
table alone makes the written checkpoint fail the golden comparison; and it reads ``config.json`` and
the rank files as TensorRT-LLM 1.2 does (its own facts, ``builders/trtllm/trtllm_models.py``), where
that differs from what the writer or Hugging Face would suggest."""
from __future__ import annotations

import ast
import copy
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from harp_trt.builders.trtllm import read_checkpoint, write_checkpoint
from harp_trt.builders.trtllm.stage import _qk_norm_eps
from harp_trt.builders.trtllm.targets import QK_LAYERNORM_EPS
from harp_trt.builders.trtllm.trtllm_models import ACTIVATIONS
from harp_trt.codekey import module_file
from harp_trt.errors import CorruptWeightsError, UnsupportedArchitectureError
from harp_trt.families import FAMILIES
from harp_trt.harp import apply_harp
from harp_trt.plan import Plan

from conftest import make_tiny

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4               # the golden tolerance (tests/test_trtllm_checkpoint.py)
ALPHAS = {2: 0.7, 3: 0.0}
SEQ = 20


def _plan(family: str) -> Plan:
    layers = tuple(sorted(ALPHAS))
    return Plan("tiny", "0" * 64, family, 4, "test", layers, tuple(ALPHAS[i] for i in layers))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (HF folder, HARP reference logits, ids), built once."""
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))
    root = tmp_path_factory.mktemp("oracle")
    out = {}
    for fam in ("llama", "qwen2", "gemma2", "qwen3", "gemma3"):
        m = make_tiny(fam, **({"tie_word_embeddings": True} if fam == "gemma2" else {}))
        with torch.no_grad():  # HF initialises biases to zero: perturb them so a lost bias shows
            for n, p in m.named_parameters():
                if n.endswith("bias"):
                    p.add_(0.5 * torch.randn_like(p))
        m.save_pretrained(root / fam, safe_serialization=True)
        ref = apply_harp(copy.deepcopy(m), ALPHAS)
        _qk_norm_eps(ref, QK_LAYERNORM_EPS)   # Qwen3 / Gemma3: TensorRT-LLM's QK-norm eps (row qk-norm-eps)
        with torch.no_grad():
            out[fam] = (root / fam, ref(ids).logits, ids)
    return out


def _diff(ckpt: Path, want: torch.Tensor, ids: torch.Tensor) -> float:
    return (read_checkpoint(ckpt)(ids) - want).abs().max().item()


# ---- independence ------------------------------------------------------------------------------
def _closure(module: str) -> set[str]:
    """In-repository modules importing ``module`` runs, transitively: function-level imports and the
    packages' ``__init__`` files included."""
    seen, todo = set(), [module]
    while todo:
        mod = todo.pop()
        path = module_file(mod, ROOT)
        if mod in seen or path is None:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run first
        pkg = parts if path.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
                todo += [base] + [f"{base}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
    return seen


def test_reader_imports_nothing_from_the_family_tables():
    closure = _closure("harp_trt.builders.trtllm.reader")
    assert {"harp_trt.builders.trtllm", "harp_trt.builders.trtllm.trtllm_models", "harp_trt.weights"} <= closure  # the scan follows imports
    writer_side = {"harp_trt.families", "harp_trt.builders.trtllm.checkpoint", "harp_trt.builders.trtllm.targets",
                   "harp_trt.builders.trtllm.hf_format", "harp_trt.builders.trtllm.stage"}
    bad = sorted(m for m in closure if m in writer_side or m.startswith("harp_trt.families."))
    assert not bad, f"the reader reaches the writer's facts through {bad}"
    # and at run time: importing the reader (its whole closure) loads no family table
    code = "import sys, harp_trt.builders.trtllm.reader; print(sorted(m for m in sys.modules if 'families' in m))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# One fact of the writer's table changed alone: (family, change, tp, expected). Expected is
# "differs" (the reader runs the files and disagrees with HARP) or an error the reader raises
# where TensorRT-LLM would refuse the checkpoint.
MUTATIONS = {
    "qwen2-attn-bias-off": ("qwen2", lambda t: {"extra_config": {**t.extra_config, "attn_bias": False}}, 1, "differs"),
    "qwen2-type-qwen": ("qwen2", lambda t: {"extra_config": {**t.extra_config, "qwen_type": "qwen"}}, 1,
                        "has shape"),
    "gemma2-as-gemma": ("gemma2", lambda t: {"architecture": "GemmaForCausalLM"}, 1, "differs"),
    "gemma2-no-softcap-fields": ("gemma2", lambda t: {"softcapping": False}, 1, "query_pre_attn_scalar"),
    "gemma2-replicated-embedding": ("gemma2", lambda t: {"parallel_embedding": False}, 2, "vocab-split"),
    "llama-no-layer-configs": ("llama", lambda t: {"layer_configs": False}, 1, "Required but not provided"),
    "qwen3-no-qk-layernorm": ("qwen3", lambda t: {"qk_layernorm": False}, 1, "Required but not provided"),
    "qwen3-as-qwen2": ("qwen3", lambda t: {"extra_config": {**t.extra_config, "qwen_type": "qwen2"}}, 1, "differs"),
    "gemma3-no-config-group": ("gemma3", lambda t: {"gemma3_group": False}, 1, "query_pre_attn_scalar"),
    "gemma3-as-gemma2": ("gemma3", lambda t: {"architecture": "Gemma2ForCausalLM"}, 1, "differs"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_wrong_fact_in_the_writers_table_fails_the_golden_test(models, tmp_path, monkeypatch, name):
    family, change, tp, expected = MUTATIONS[name]
    folder, want, ids = models[family]
    write_checkpoint(folder, _plan(family), tmp_path / "right", dtype="float32", tp_size=tp)
    assert _diff(tmp_path / "right", want, ids) <= TOL  # the control: the table as it is passes
    spec = FAMILIES.get(family)
    monkeypatch.setattr(spec, "trtllm", dataclasses.replace(spec.trtllm, **change(spec.trtllm)))
    write_checkpoint(folder, _plan(family), tmp_path / "wrong", dtype="float32", tp_size=tp)
    if expected == "differs":
        assert _diff(tmp_path / "wrong", want, ids) > 1e-2
    else:
        with pytest.raises(CorruptWeightsError, match=expected):
            _diff(tmp_path / "wrong", want, ids)


# ---- the reader's own facts ----------------------------------------------------------------------
def test_gelu_is_tensorrt_llms_tanh_approximation():
    """functional.py ACT2FN maps every GELU name to ``gelu``, the tanh approximation; Hugging Face's
    'gelu' is the exact erf form, so a 'gelu' model would differ in the engine."""
    x = torch.linspace(-4, 4, 101)
    for name in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        torch.testing.assert_close(ACTIVATIONS[name](x), 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3))))
    assert (ACTIVATIONS["gelu"](x) - F.gelu(x)).abs().max() > 1e-4
    assert "swish" not in ACTIVATIONS  # not an ACT2FN key: TensorRT-LLM cannot build it


def _edit_config(ckpt: Path, **fields) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for k, v in fields.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_gemma2_config_is_read_as_gemmaconfig_reads_it(models, tmp_path):
    """GemmaConfig.__init__ forces use_parallel_embedding = tp > 1 and, for Gemma2ForCausalLM,
    inter_layernorms = True whatever config.json says; the Gemma2 soft-capping fields are required."""
    folder, want, ids = models["gemma2"]
    write_checkpoint(folder, _plan("gemma2"), tmp_path, dtype="float32", tp_size=2)
    _edit_config(tmp_path, use_parallel_embedding=False, inter_layernorms=False, attn_bias=None, mlp_bias=None)
    assert _diff(tmp_path, want, ids) <= TOL
    _edit_config(tmp_path, attn_logit_softcapping=0.01)  # the cap is read: a tight one moves the logits
    assert _diff(tmp_path, want, ids) > 10 * TOL
    _edit_config(tmp_path, query_pre_attn_scalar=None)
    with pytest.raises(CorruptWeightsError, match="requires it for Gemma2ForCausalLM"):
        read_checkpoint(tmp_path)


def test_qwen_config_is_read_as_qwenconfig_reads_it(models, tmp_path):
    """QWenConfig defaults attn_bias to True (the q/k/v bias is then read) and QWenDecoderLayer reads
    qwen_type with no default; a dense bias is never read (dense_bias=False)."""
    folder, want, ids = models["qwen2"]
    write_checkpoint(folder, _plan("qwen2"), tmp_path, dtype="float32")
    _edit_config(tmp_path, attn_bias=None, mlp_bias=None)
    assert _diff(tmp_path, want, ids) <= TOL
    r0 = load_file(str(tmp_path / "rank0.safetensors"))
    r0["transformer.layers.0.attention.dense.bias"] = torch.full((64,), 5.0)  # unused by QWenDecoderLayer
    save_file(r0, str(tmp_path / "rank0.safetensors"))
    assert _diff(tmp_path, want, ids) <= TOL
    _edit_config(tmp_path, qwen_type=None)
    with pytest.raises(CorruptWeightsError, match="no 'qwen_type'"):
        read_checkpoint(tmp_path)


def test_decilm_mlp_names_are_renamed_on_load(models, tmp_path):
    """DeciLMForCausalLM.from_checkpoint renames '.mlp.' to '.ffn.' before loading
    (nemotron_nas/convert.py update_weights_following_modelopt_optimization), so a DeciLM checkpoint
    with mlp.* names runs the same; a LLaMA checkpoint gets no such rename."""
    folder, want, ids = models["llama"]
    write_checkpoint(folder, _plan("llama"), tmp_path, dtype="float32")
    r0 = load_file(str(tmp_path / "rank0.safetensors"))
    assert any(".ffn." in k for k in r0)
    save_file({k.replace(".ffn.", ".mlp."): v for k, v in r0.items()}, str(tmp_path / "rank0.safetensors"))
    assert _diff(tmp_path, want, ids) <= TOL
    _edit_config(tmp_path, architecture="LlamaForCausalLM", layer_configs=None)
    with pytest.raises(CorruptWeightsError, match="Required but not provided"):
        read_checkpoint(tmp_path)(ids)  # LLaMA has every layer as attention: layer 2's qkv is missing


def test_config_defaults_are_pretrainedconfigs(models, tmp_path):
    """PretrainedConfig.__init__ fills num_key_value_heads (= heads), head_size (= hidden / heads) and
    position_embedding_type (learned_absolute, not RoPE) when config.json lacks them."""
    folder, want, ids = models["qwen2"]
    write_checkpoint(folder, _plan("qwen2"), tmp_path, dtype="float32")
    _edit_config(tmp_path, head_size=None)  # 64 / 4 = 16, the model's own
    assert _diff(tmp_path, want, ids) <= TOL
    _edit_config(tmp_path, num_key_value_heads=None)  # 4 KV heads: the 2-head qkv rows no longer fit
    with pytest.raises(CorruptWeightsError, match="has shape"):
        read_checkpoint(tmp_path)(ids)
    _edit_config(tmp_path, num_key_value_heads=2, position_embedding_type=None)
    with pytest.raises(UnsupportedArchitectureError, match="position_embedding_type 'learned_absolute'"):
        read_checkpoint(tmp_path)
