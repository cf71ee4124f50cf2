"""A model's identity (``harp_trt.models.weight_digest``, ``ResolvedModel.digest``, a plan's
``model_digest``) is its weights and what turns text into their inputs and their outputs into text:
config, tokenizer, chat template, generation config. Tested by mutation: the same safetensors
under another tokenizer, chat template or generation config is another model, for the digest
and for the calibrate and export keys; a copy is the same model."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from conftest import save_tiny
from harp_trt.calib.config import CalibrateConfig
from harp_trt.calib.stage import CalibrateInputs, CalibrateStage
from harp_trt.data import load_corpus
from harp_trt.export.config import ExportConfig
from harp_trt.export.export import ExportStage
from harp_trt.models import resolve_model, weight_digest
from harp_trt.store import ArtifactStore


def _swap_two_ids(folder: Path, a: str = "a", b: str = "b") -> None:
    """Swap the ids of tokens ``a`` and ``b`` in ``tokenizer.json``: the same weights now read
    other embeddings for the same text."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(tok))


def _mutants(tmp_path: Path) -> dict[str, Path]:
    base = save_tiny("llama", tmp_path / "base")
    out = {"base": base}
    for name in ("copy", "tokenizer", "chat_template", "generation_config", "eos"):
        out[name] = Path(shutil.copytree(base, tmp_path / name, ignore=shutil.ignore_patterns(".harp_digest.json")))
    _swap_two_ids(out["tokenizer"])
    (out["chat_template"] / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    gen = json.loads((base / "generation_config.json").read_text())
    (out["generation_config"] / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 3}))
    cfg = json.loads((base / "tokenizer_config.json").read_text())  # EOS <0x03> -> another token
    (out["eos"] / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<0x02>"}))
    return out


def test_the_tokenizer_chat_template_and_generation_config_are_part_of_the_models_identity(tmp_path):
    """Mutation: each changed file gives another digest, another calibrate key and another export
    key; an unchanged copy (another path) gives the same ones. Before the tokenizer counted, all
    five digests were equal (safetensors and config.json only)."""
    folders = _mutants(tmp_path)
    store = ArtifactStore(tmp_path / "cache")
    corpus = load_corpus(str(_text(tmp_path / "corpus.txt")), store.root)
    resolved = {n: resolve_model(str(f), store.root) for n, f in folders.items()}
    digests = {n: r.digest for n, r in resolved.items()}
    assert digests["copy"] == digests["base"] == weight_digest(folders["base"])
    assert len({digests[n] for n in folders if n != "copy"}) == len(folders) - 1, digests
    calibrate, export = CalibrateStage(), ExportStage()
    cal = {n: calibrate.key(store, CalibrateConfig(layers=1), {"calibrate": CalibrateInputs(r, corpus)})
           for n, r in resolved.items()}
    exp = {n: export.key(store, ExportConfig(), {"model": r}) for n, r in resolved.items()}
    for keys in (cal, exp):
        assert keys["copy"] == keys["base"]
        assert len({keys[n] for n in folders if n != "copy"}) == len(folders) - 1, keys


def test_identity_files_cover_each_tokenizer_format(tmp_path):
    """The files hashed, by name: weights, config, each tokenizer format transformers reads, chat
    templates (also the named ones), added tokens, generation config; not the digest's own memo."""
    from harp_trt.models import identity_files

    folder = tmp_path / "m"
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
             "chat_template.jinja", "chat_template.json", "additional_chat_templates/tool_use.jinja",
             "qwen.tiktoken"]
    for n in [*names, ".harp_digest.json", "README.md", "model.safetensors.index.json.lock"]:
        (folder / n).parent.mkdir(parents=True, exist_ok=True)
        (folder / n).write_text(n)
    assert [f.relative_to(folder).as_posix() for f in identity_files(folder)] == sorted(names)


def test_the_digest_memo_is_used_and_refreshed(tmp_path):
    """``.harp_digest.json`` keeps each file's sha256 by (size, mtime): a file whose stamp is
    unchanged is not read again (a memo entry edited here shows in the digest), a rewritten file is."""
    folder = save_tiny("llama", tmp_path / "m")
    first = weight_digest(folder)
    memo_path = folder / ".harp_digest.json"
    memo = json.loads(memo_path.read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(memo)
    memo["tokenizer.json"]["sha256"] = "0" * 64
    memo_path.write_text(json.dumps(memo))
    assert weight_digest(folder) != first            # the memo was trusted: the file was not read
    tok = folder / "tokenizer.json"
    st = tok.stat()
    os.utime(tok, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert weight_digest(folder) == first            # a new stamp: read and hashed again
    assert json.loads(memo_path.read_text())["tokenizer.json"]["sha256"] != "0" * 64
    _swap_two_ids(folder)
    assert weight_digest(folder) != first


def _text(path: Path) -> Path:
    from test_calibrate_cli import write_corpus

    return write_corpus(path, docs=6, words=60)


def test_a_calibration_is_not_served_to_the_same_weights_under_another_tokenizer(tmp_path):
    """The issue's case, run: calibrate a folder, then the same safetensors with two token ids
    swapped. The second run calibrates (no cache hit) and its plan names its own folder and digest,
    so a deployment from it ships its own tokenizer."""
    from harp_trt.calib import run_calibrate
    from harp_trt.plan import Plan

    folders = _mutants(tmp_path)
    store = ArtifactStore(tmp_path / "cache")
    cfg = CalibrateConfig(layers=1, tokens=256, seq_len=64, alpha_grid=(0.0, 1.0),
                          corpus=str(_text(tmp_path / "corpus.txt")))
    first = run_calibrate(str(folders["base"]), cfg, store)
    other = run_calibrate(str(folders["tokenizer"]), cfg, store)
    assert not other.cached and other.key != first.key
    plan = Plan.load(other.path / "plan.json")
    assert plan.model_ref == str(folders["tokenizer"])
    assert plan.model_digest == weight_digest(folders["tokenizer"]) != weight_digest(folders["base"])
    again = run_calibrate(str(folders["copy"]), cfg, store)
    assert again.cached and again.key == first.key
