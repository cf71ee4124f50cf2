"""Every TensorRT-LLM launch file points at a tokenizer that exists in the artifact and loads
(``docs/trtllm-contract.md``, row tokenizer-folder): for every family, for ``--no-hf`` and for an MLP
width the DeciLM route cannot express (no ``hf/``), the paths a launch file passes (``--tokenizer``,
a YAML ``tokenizer`` key) are resolved as bash would resolve them with no environment overrides, must
lie inside the artifact, and must load with ``AutoTokenizer`` into the model's own token ids."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
from harp_trt.builders.trtllm.config import TRTLLM_VERSION
from harp_trt.errors import PreconditionError
from harp_trt.models import ResolvedModel
from harp_trt.plan import Plan
from harp_trt.store import ArtifactStore

from conftest import save_tiny

TEXTS = ["Hello world", "HARP prunes 2 of 4 layers."]
# (case id, family, model overrides, hf_format, whether hf/ is written)
CASES = [
    ("llama", "llama", {"intermediate_size": 256}, True, True),
    ("llama-no-hf", "llama", {"intermediate_size": 256}, False, False),
    ("llama-mlp-width", "llama", {}, True, False),  # 128: round_up(2 * ffn_mult * hidden / 3, 256) cannot give it
    ("mistral", "mistral", {"intermediate_size": 256}, True, True),
    ("qwen2", "qwen2", {}, True, False),
    ("gemma2", "gemma2", {"tie_word_embeddings": True}, True, False),
]


def _artifact(tmp_path: Path, family: str, overrides: dict, hf_format: bool):
    folder = save_tiny(family, tmp_path / "model", **overrides)
    plan = Plan(str(folder), "0" * 64, family, 4, "test", (2, 3), (0.7, 0.0))
    cfg = TrtllmCheckpointConfig(dtype="float32", max_input_len=32, max_seq_len=64, hf_format=hf_format,
                                 verify=False, build="never")
    return folder, TrtllmCheckpointStage().execute(ArtifactStore(tmp_path / "cache"), cfg, {
        "plan": plan, "model": ResolvedModel(str(folder), folder, "", "folder")})


def _words(script: str) -> list[str]:
    return shlex.split(script.replace("\\\n", " "), comments=True)


def _resolve(word: str, here: Path) -> Path:
    """A launch-file path as bash expands it when the user sets nothing: ``${VAR:-default}`` is the
    default, ``$HERE`` the artifact folder (the scripts set it to their own folder)."""
    word = re.sub(r"\$\{\w+:-(.*)\}", r"\1", word)
    assert "$" not in word.replace("$HERE", ""), f"{word}: a variable with no default"
    return Path(word.replace("$HERE", str(here)))


def _tokenizer_paths(art: Path) -> dict[str, Path]:
    """launch file -> the tokenizer path it passes; every launch file of the artifact is read."""
    found = {}
    for sh in sorted(art.glob("*.sh")):
        words = _words(sh.read_text())
        for i, w in enumerate(words):
            if w == "--tokenizer":
                found[sh.name] = _resolve(words[i + 1], art)
        if "trtllm-serve" in words:
            assert sh.name in found, f"{sh.name} serves a model without --tokenizer"
    for y in sorted(art.glob("*.yaml")):
        opts = yaml.safe_load(y.read_text())
        if "tokenizer" in opts:
            found[y.name] = _resolve(str(opts["tokenizer"]), art)
    return found


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_launch_file_tokenizer_exists_and_loads(tmp_path, case):
    from transformers import AutoTokenizer

    _, family, overrides, hf_format, has_hf = case
    folder, art = _artifact(tmp_path, family, overrides, hf_format)
    assert (art.path / "hf").is_dir() == has_hf == art.manifest["hf_checkpoint"]["written"]
    launch = art.manifest["launch"]
    for files in launch["files"].values():  # every file the manifest lists exists
        for f in files:
            assert (art.path / f).exists(), f
    paths = _tokenizer_paths(art.path)
    assert "serve_engine.sh" in paths and ("serve_pytorch.sh" in paths) == has_hf
    from tokenizers import Tokenizer

    want = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the serialized pipeline, what 4.x and 5 both read
    for launch_file, path in paths.items():
        assert path.is_dir() and art.path in path.resolve().parents, (launch_file, path)
        assert path == art.path / launch["tokenizer"] == art.path / art.manifest["tokenizer"]["dir"]
        tok = AutoTokenizer.from_pretrained(path)
        for text in TEXTS:
            assert tok(text).input_ids == want.encode(text).ids, (launch_file, text)
    assert art.manifest["tensorrt_llm"]["version"] == TRTLLM_VERSION
    for sh in ("build_engine.sh", "serve_engine.sh"):
        assert f"TensorRT-LLM {TRTLLM_VERSION}" in (art.path / sh).read_text() or \
            f"tensorrt_llm {TRTLLM_VERSION}" in (art.path / sh).read_text()


def test_a_model_without_a_tokenizer_is_refused_before_writing(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "model")
    for f in folder.glob("tokenizer*"):
        f.unlink()
    plan = Plan(str(folder), "0" * 64, "qwen2", 4, "test", (2, 3), (0.7, 0.0))
    store = ArtifactStore(tmp_path / "cache")
    with pytest.raises(PreconditionError, match=r"has no tokenizer .*every launch file needs one"):
        TrtllmCheckpointStage().execute(store, TrtllmCheckpointConfig(dtype="float32", max_seq_len=64,
                                                                      max_input_len=32), {
            "plan": plan, "model": ResolvedModel(str(folder), folder, "", "folder")})
    assert not list((tmp_path / "cache").glob("trtllm-*"))
