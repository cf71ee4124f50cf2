"""An independent consumer of the TensorRT-LLM PyTorch-backend artifact: llama.cpp's own
``convert_hf_to_gguf.py`` (vendored in the pinned ``llama-cpp-python`` sdist, run by
``tests/_llamacpp_convert.py``) turns the ``hf/`` DeciLM folder that ``TrtllmCheckpointStage`` writes
into a GGUF, llama.cpp runs it, and its logits equal the PyTorch HARP reference.

What is the converter's and what is ours: ``conversion/deci.py`` ``DeciModel.__init__`` reads our
``block_configs`` (``n_heads_in_group`` None + ``replace_with_linear`` -> heads, 0 KV heads;
``no_op`` -> 0 heads, 0 KV heads; ``ffn_mult`` -> width), ``DeciModel.set_gguf_parameters`` writes the
per-layer head counts, ``DeciModel.modify_tensors`` permutes Q/K, and ``gguf-py``'s
``tensor_mapping.py`` maps ``model.layers.{i}.self_attn.linear_attn`` to ``blk.{i}.attn_output``. It
reads our ``config.json`` directly: ``conversion/base.py`` ``ModelBase.load_hparams`` calls
``AutoConfig.from_pretrained(trust_remote_code=False)``, which refuses the folder's ``auto_map``
config class, and falls back to the JSON. The one change: ``DeciModel.set_vocab`` handles only
128256-token vocabularies with a GPT-2 tokenizer, so for ours (SmolLM2's 49152) the runner routes
the vocabulary alone through ``TextModel._set_vocab_gpt2`` (see the runner's docstring).

The tiny models' usual 128-symbol tokenizer (``conftest._tiny_tokenizer``) cannot go that route:
``TextModel.get_vocab_base_pre`` knows BPE pre-tokenizers by the hash of a fixed text's ids and
raises "BPE pre-tokenizer was not recognized" for it. So the tiny DeciLM here is a tiny Llama with
SmolLM2's tokenizer (vocabulary 49152, pre-tokenizer ``smollm``).

Tolerance: fp32 weights (``--outtype f32``) and an fp32 KV cache; max |logit diff| <= ``REL_TOL`` x
max(1, max |reference logit|), and greedy tokens equal."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from harp_trt.builders.gguf import probe
from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
from harp_trt.harp import apply_harp
from harp_trt.models import ResolvedModel, load_tokenizer
from harp_trt.onnx_io import copy_tokenizer
from harp_trt.plan import Plan
from harp_trt.store import ArtifactStore

from _llamacpp_convert import convert_hf_folder
from conftest import make_tiny, save_tiny

REL_TOL = 2e-5  # of the logit scale; measured 3.6e-7 (tiny) and 1.8e-6 (SmolLM2, 5.4e-5 of 29.8)
PROMPT = "The capital of France is Paris, and the capital of Italy is"
GREEDY = 8
TINY_ALPHAS = {1: 0.7, 2: 0.0}     # a linear (replace_with_linear) and a no-op layer, neither the top one
SMOL_ALPHAS = {12: 0.6, 28: 0.0}


def _plan(resolved: ResolvedModel, n_layers: int, alphas: dict[int, float]) -> Plan:
    layers = tuple(sorted(alphas))
    return Plan(resolved.ref, resolved.digest, "llama", n_layers, "test", layers, tuple(alphas[i] for i in layers))


def _deploy_hf(resolved: ResolvedModel, plan: Plan, root: Path) -> Path:
    """The ``hf/`` folder of the TensorRT-LLM stage's artifact, fp32 (its own checks are
    ``test_trtllm_checkpoint.py``'s)."""
    cfg = TrtllmCheckpointConfig(dtype="float32", max_input_len=32, max_seq_len=64, verify=False, build="never")
    art = TrtllmCheckpointStage().execute(ArtifactStore(root), cfg, {"plan": plan, "model": resolved})
    return art.path / "hf"


@torch.no_grad()
def _reference(model, alphas, ids: list[int], steps: int):
    """(logits, greedy tokens) of the PyTorch HARP model (``harp_trt.harp.apply_harp``), no KV cache."""
    ref = apply_harp(copy.deepcopy(model).float().eval(), alphas)
    x = torch.tensor([ids])
    logits = ref(x).logits[0].numpy()
    out = []
    for _ in range(steps):
        nxt = int(ref(x).logits[0, -1].argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
    return logits, out


def _gguf_fields(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    keys = ("general.architecture", "deci.attention.head_count", "deci.attention.head_count_kv",
            "deci.feed_forward_length", "tokenizer.ggml.model", "tokenizer.ggml.pre")
    fields = {k: r.fields[k].contents() for k in keys if k in r.fields}
    tensors: dict[int, set[str]] = {}
    for t in r.tensors:
        if t.name.startswith("blk."):
            _, i, rest = t.name.split(".", 2)
            tensors.setdefault(int(i), set()).add(rest.removesuffix(".weight"))
    return fields, tensors


def _compare(gguf: Path, model, alphas, folder) -> float:
    """Logits and greedy tokens of llama.cpp on the GGUF vs the PyTorch HARP model; llama.cpp's
    tokenizer (the vocabulary the converter wrote) gives Hugging Face's ids. Returns max |diff| / scale."""
    ids = load_tokenizer(folder)(PROMPT, add_special_tokens=False)["input_ids"]
    assert probe.tokenize(gguf, PROMPT) == ids
    want, want_tokens = _reference(model, alphas, ids, GREEDY)
    got = probe.logits(gguf, ids, kv_type="f32")
    got_tokens = probe.greedy(gguf, ids, GREEDY, kv_type="f32")
    scale = max(1.0, float(np.abs(want).max()))
    diff = float(np.abs(got - want).max())
    print(f"{gguf.name}: llama.cpp logits max |diff| {diff:.3g} = {diff / scale:.3g} of the logit scale "
          f"{scale:.3g} (tolerance {REL_TOL}); greedy {got_tokens}")
    assert diff <= REL_TOL * scale, f"llama.cpp logits max |diff| {diff:.3g} > {REL_TOL} x {scale:.3g}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert got_tokens == want_tokens
    return diff / scale


@pytest.fixture(scope="module")
def smol_tokenizer_files(smollm2) -> Path:
    return Path(smollm2[0].folder)


@pytest.mark.slow
def test_tiny_decilm_folder_converts_runs_and_matches_harp(smol_tokenizer_files, test_cache, tmp_path):
    model = make_tiny("llama", intermediate_size=256, vocab_size=49152)  # DeciLM widths: multiples of 256
    folder = tmp_path / "tiny"
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(smol_tokenizer_files, folder, skip=("config.json", "generation_config.json"))
    resolved = ResolvedModel("tiny", folder, "0" * 64, "folder")
    hf = _deploy_hf(resolved, _plan(resolved, 4, TINY_ALPHAS), tmp_path / "store")
    conv = convert_hf_folder(hf, tmp_path / "tiny.gguf", test_cache)
    assert conv["vocab_route"] == "gpt2"
    # the converter read config.json itself: the auto_map config class was not run
    assert "Trying to load config.json instead" in conv["log"]
    fields, tensors = _gguf_fields(conv["gguf"])
    assert fields["general.architecture"] == "deci"
    assert fields["deci.attention.head_count"] == [4, 4, 0, 4]
    assert fields["deci.attention.head_count_kv"] == [2, 0, 0, 2]
    assert fields["deci.feed_forward_length"] == [256] * 4
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "smollm")
    attn = {i: sorted(n for n in names if n.startswith("attn_")) for i, names in tensors.items()}
    assert attn == {0: ["attn_k", "attn_norm", "attn_output", "attn_q", "attn_v"], 1: ["attn_norm", "attn_output"],
                    2: [], 3: ["attn_k", "attn_norm", "attn_output", "attn_q", "attn_v"]}
    _compare(conv["gguf"], model, TINY_ALPHAS, folder)


@pytest.mark.slow
def test_smollm2_decilm_folder_converts_runs_and_matches_harp(smollm2, test_cache, tmp_path):
    resolved, model, _ = smollm2
    n = model.config.num_hidden_layers
    hf = _deploy_hf(resolved, _plan(resolved, n, SMOL_ALPHAS), tmp_path / "store")
    conv = convert_hf_folder(hf, tmp_path / "smollm2.gguf", test_cache)
    fields, _ = _gguf_fields(conv["gguf"])
    assert fields["deci.attention.head_count_kv"] == [0 if i in SMOL_ALPHAS else 3 for i in range(n)]
    assert fields["deci.attention.head_count"] == [0 if SMOL_ALPHAS.get(i) == 0.0 else 9 for i in range(n)]
    _compare(conv["gguf"], model, SMOL_ALPHAS, resolved.folder)


@pytest.mark.slow
def test_vocab_routes_what_the_converter_refuses(smol_tokenizer_files, test_cache, tmp_path):
    """Why the runner changes the vocabulary step and only that: unchanged, ``DeciModel.set_vocab``
    sends a 49152-token GPT-2 vocabulary to ``_set_vocab_llama_hf``, which looks for a SentencePiece
    ``tokenizer.model``; and the GPT-2 route cannot take the tiny models' 128-symbol tokenizer, whose
    pre-tokenizer ``get_vocab_base_pre`` does not know."""
    folder = save_tiny("llama", tmp_path / "tiny128", intermediate_size=256)
    resolved = ResolvedModel("tiny", folder, "0" * 64, "folder")
    hf128 = _deploy_hf(resolved, _plan(resolved, 4, TINY_ALPHAS), tmp_path / "store")
    with pytest.raises(RuntimeError, match="BPE pre-tokenizer was not recognized"):
        convert_hf_folder(hf128, tmp_path / "a.gguf", test_cache, vocab_only=True)
    smol = tmp_path / "smol-vocab"
    smol.mkdir()
    copy_tokenizer(smol_tokenizer_files, smol, skip=("config.json",))
    cfg = json.loads((hf128 / "config.json").read_text())
    (smol / "config.json").write_text(json.dumps({**cfg, "vocab_size": 49152}))
    with pytest.raises(RuntimeError, match="Cannot find Llama BPE tokenizer"):
        convert_hf_folder(smol, tmp_path / "b.gguf", test_cache, route="deci", vocab_only=True)
