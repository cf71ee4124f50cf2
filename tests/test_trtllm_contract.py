"""docs/trtllm-contract.md against the code it describes: every row names its source, a test that
exists and code of ours that exists (each ``module.name`` it cites is defined in that module); the
findings that started the document hold on files the code really writes (a tiny Qwen2 TensorRT-LLM
artifact and its Triton repository, a tiny Llama's DeciLM folder, ORT graphs); and the
qwen-seq-length row is what the writer writes and what the reader, our stand-in for TensorRT-LLM's
computation (builders/trtllm/reader.py), computes with."""
from __future__ import annotations

import ast
import copy
import functools
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from conftest import make_tiny, save_tiny

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("harp_trt", "calib", "builders", "bench", "tests")


def _rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "trtllm-contract.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| id ") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _tests(file: str) -> set[str]:
    tree = ast.parse((ROOT / "tests" / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@functools.cache
def _code_index() -> tuple[dict[Path, set[str]], dict[Path, set[str]]]:
    """Per repository Python file: the names it defines (functions, classes, methods, assigned names,
    fields, attributes set on ``self``, names it imports) and its string constants."""
    defined, strings = {}, {}
    for d in CODE_DIRS:
        for f in (ROOT / d).rglob("*.py"):
            tree = ast.parse(f.read_text())
            names, texts = set(), set()
            for n in ast.walk(tree):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(n.name)
                elif isinstance(n, ast.ImportFrom):  # ``module.name`` is reachable as an attribute
                    names.update(a.asname or a.name for a in n.names)
                elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                        for x in ast.walk(t):
                            names.update([x.id] if isinstance(x, ast.Name) else [x.attr] if isinstance(x, ast.Attribute) else [])
                elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                    texts.add(n.value)
            defined[f], strings[f] = names, texts
    return defined, strings


def _unresolved(ref: str) -> str | None:
    """Why a code reference of a row's "ours" column names nothing in the code (None: it resolves).
    ``x.py`` a repository file or one the code writes; ``--flag`` / ``file.sh`` a string the code writes; ``module.name`` a name
    defined in that module (``Class.name``: in the class's module); a bare name one defined somewhere."""
    defined, strings = _code_index()
    if ref.endswith(".py"):  # a repository file, or one the code writes
        hits = [f for f in defined if f.as_posix().endswith("/" + ref)] or [1 for t in strings.values() if ref in t]
        return None if hits else f"no file {ref}, and no code writes one"
    if ref.startswith("--") or re.search(r"\.(sh|yaml|json)$", ref):
        return None if any(ref in s for texts in strings.values() for s in texts) else f"no code writes {ref!r}"
    parts = ref.split(".")
    if not all(p.isidentifier() for p in parts):
        return f"{ref!r} is not a code reference"
    owners = [f for f in defined if f.stem == parts[0]] or [f for f, names in defined.items() if parts[0] in names]
    if len(parts) > 1 and owners:
        return None if any(parts[-1] in defined[f] for f in owners) else f"{parts[0]} defines no {parts[-1]}"
    missing = [p for p in parts if not any(p in names or p in strings[f] for f, names in defined.items())]
    return f"nothing defines {missing}" if missing else None


@pytest.mark.slow
def test_every_row_cites_a_source_an_existing_test_and_existing_code():
    rows = _rows()
    assert len(rows) >= 20
    ids = [r[0] for r in rows]
    assert len(set(ids)) == len(ids)
    for row in rows:
        assert len(row) == 5, row
        rid, requirement, source, ours, tests = row
        assert requirement and "`" in source, f"{rid}: no source file/function"
        refs = re.findall(r"(test_\w+\.py)::(test_\w+)", tests)
        refs += [(refs[-1][0], name) for name in re.findall(r"`::(test_\w+)`", tests)] if refs else []
        assert refs, f"{rid}: names no test"
        for file, name in refs:
            assert name in _tests(file), f"{rid}: {file}::{name} does not exist"
        code = re.findall(r"`([^`]+)`", ours)
        assert code, f"{rid}: the ours column names no code"
        bad = {c: why for c in code if (why := _unresolved(c))}
        assert not bad, f"{rid}: {bad}"


# ---- the issue items, on written files ------------------------------------------------------
ISSUE_ITEMS = ("qwen-seq-length", "sink", "pp-windows", "kv-shares", "user-window", "pp-attention", "hf-lm-head",
               "tb-keys", "ort-release", "tb-batching", "ort-gpu-gqa", "tb-version-folder", "ort-bf16",
               # deployments that start: tokenizer folder, portable tokenizers, Triton image, docker -e
               "tokenizer-folder", "tokenizer-portable", "triton-trtllm-release", "triton-docker-env")
BUILD = dict(dtype="float32", max_batch_size=4, max_input_len=32, max_seq_len=64)
PLAN = {2: 0.7, 3: 0.0}


def _plan(family: str, alphas=PLAN):
    from harp_trt.plan import Plan

    return Plan("tiny", "0" * 64, family, 4, "test", tuple(sorted(alphas)), tuple(alphas[i] for i in sorted(alphas)))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny Qwen2 (window route) TensorRT-LLM artifact and the Triton repository written from it."""
    from harp_trt.builders.triton import write_repository
    from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
    from harp_trt.models import ResolvedModel
    from harp_trt.store import ArtifactStore

    root = tmp_path_factory.mktemp("contract")
    folder = save_tiny("qwen2", root / "qwen2")
    art = TrtllmCheckpointStage().execute(ArtifactStore(root / "cache"), TrtllmCheckpointConfig(**BUILD),
                                          {"plan": _plan("qwen2"), "model": ResolvedModel("qwen2", folder, "", "folder")})
    write_repository(art.path, root / "repo")
    return {"root": root, "folder": folder, "art": art.path, "repo": root / "repo",
            "config": json.loads((art.path / "checkpoint" / "config.json").read_text())}


def _text_files(*folders: Path) -> dict[Path, str]:
    return {f: f.read_text() for d in folders for f in d.rglob("*")
            if f.is_file() and f.suffix in (".json", ".yaml", ".sh", ".pbtxt", ".md", "")}


def _llm_params(repo: Path) -> dict[str, str]:
    from harp_trt.builders.triton import parse_model_config, string_params

    return string_params(parse_model_config(repo / "tensorrt_llm" / "config.pbtxt"))


def _check_qwen_seq_length(w):
    assert w["config"]["seq_length"] == 8192  # getattr(hf_config, "seq_length", 8192): Qwen2 has none


def _check_sink(w):
    assert "sink_token_length" not in w["config"]["runtime_defaults"]
    for f, text in _text_files(w["art"], w["repo"]).items():
        for m in re.finditer(r"sink_token_length\W+(\d+)", text):
            assert int(m.group(1)) > 0, f"{f}: sink_token_length {m.group(1)}"


def _check_pp_windows(w, tmp_path):
    from harp_trt.builders.trtllm import write_checkpoint
    from harp_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="pp_size=1"):
        write_checkpoint(w["folder"], _plan("qwen2"), tmp_path, dtype="float32", pp_size=2)
    assert not (tmp_path / "config.json").exists()


def _check_kv_shares(w):
    windows = w["config"]["runtime_defaults"]["max_attention_window"]
    serve = (w["art"] / "serve_engine.sh").read_text()
    shares = re.search(r"^export TRTLLM_WINDOW_SIZE_SHARES=([\d.,]+)$", serve, re.M)
    assert shares, serve
    values = [float(x) for x in shares.group(1).split(",")]
    assert len(values) == len(set(windows)) == 2 and abs(sum(values) - 1) < 1e-6, (values, windows)
    assert f"-e TRTLLM_WINDOW_SIZE_SHARES={shares.group(1)}" in (w["repo"] / "README.md").read_text()


def _check_user_window(w):
    windows = w["config"]["runtime_defaults"]["max_attention_window"]
    assert windows == [64, 64, 1, 1]   # kept layers: max_seq_len; HARP-pruned 2, 3: one token
    for yaml in w["art"].glob("*_llm_api_options.yaml"):
        assert f"max_attention_window: [{', '.join(map(str, windows))}]" in yaml.read_text(), yaml
    assert '--extra_llm_api_options "$HERE/engine_llm_api_options.yaml"' in (w["art"] / "serve_engine.sh").read_text()
    assert _llm_params(w["repo"])["max_attention_window_size"] == ",".join(map(str, windows))


def _check_pp_attention(w, tmp_path):
    from harp_trt.builders.trtllm import write_checkpoint
    from harp_trt.errors import ConfigError

    folder = save_tiny("llama", tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"pipeline stage 1 \(layers 2-3\) has no attention layer"):
        write_checkpoint(folder, _plan("llama"), tmp_path / "out", dtype="float32", pp_size=2)
    write_checkpoint(folder, _plan("llama", {1: 0.7, 3: 0.0}), tmp_path / "out", dtype="float32", pp_size=2)


def _check_hf_lm_head(w, tmp_path):
    from safetensors.torch import load_file

    from harp_trt.builders.trtllm import write_hf_decilm

    model = make_tiny("llama", intermediate_size=256, tie_word_embeddings=True)  # DeciLM widths: multiples of 256
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "src" / "model.safetensors"))  # tied: not stored
    write_hf_decilm(tmp_path / "src", _plan("llama"), tmp_path / "hf", dtype="float32")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written["lm_head.weight"].equal(model.model.embed_tokens.weight.detach())


def _check_tb_keys(w):
    p = _llm_params(w["repo"])
    assert {"tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"} <= set(p), sorted(p)


def _check_tb_batching(w):
    from harp_trt.builders.triton import TritonRepoConfig
    from harp_trt.errors import ConfigError

    assert _llm_params(w["repo"])["gpt_model_type"] == "inflight_fused_batching"
    with pytest.raises(ConfigError, match="inflight_fused_batching"):
        TritonRepoConfig(batching_strategy="V1").validate()


def _check_tb_version_folder(w):
    models = [d for d in w["repo"].iterdir() if d.is_dir()]
    assert sorted(d.name for d in models) == ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
    for d in models:
        assert any((d / "1").iterdir()), f"{d.name}/1 is empty"


def _check_ort_release(w):
    from _exported import exported
    from harp_trt.builders.triton.compat import check_triton_release, required_ort
    from harp_trt.errors import HarpError

    graph = exported("llama")   # standard opset-23 ops
    assert required_ort(graph)[0] == "1.22.0"
    with pytest.raises(HarpError, match=r"24\.10 ships ONNX Runtime 1\.19\.2"):
        check_triton_release("24.10", graph)
    check_triton_release("25.05", graph)


def _check_ort_gpu_gqa(w):
    from _exported import engine
    from harp_trt.builders.triton.llm_repo import check_gpu_graph
    from harp_trt.errors import HarpError

    gqa = engine("llama") / "model.onnx"   # com.microsoft GroupQueryAttention, fp32
    with pytest.raises(HarpError, match="fp32 GroupQueryAttention graph"):
        check_gpu_graph(gqa, "gpu")
    check_gpu_graph(gqa, "cpu")


def _check_ort_bf16(w, tmp_path):
    from harp_trt.builders.triton import TritonRepoConfig, write_repository
    from harp_trt.errors import HarpError
    from harp_trt.export.export import export_folder

    export_folder(save_tiny("llama", tmp_path / "m"), tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(HarpError, match="bfloat16 graph"):
        write_repository(tmp_path / "bf16", tmp_path / "repo", TritonRepoConfig(serving="onnx"))
    assert not (tmp_path / "repo").exists()


def _check_tokenizer_folder(w):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = w["art"] / "tokenizer"
    text = "harp prunes attention"
    # the model's own tokenizer.json (transformers 5 would load the model folder as a Qwen2Tokenizer)
    want = Tokenizer.from_file(str(w["folder"] / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(tok)(text)["input_ids"] == want
    assert '--tokenizer "${TOKENIZER:-$HERE/tokenizer}"' in (w["art"] / "serve_engine.sh").read_text()
    for m in ("preprocessing", "postprocessing"):
        assert (w["repo"] / m / "1" / "tokenizer" / "tokenizer.json").is_file(), m


def _check_tokenizer_portable(w):
    for tok in (w["art"] / "tokenizer", w["repo"] / "preprocessing" / "1" / "tokenizer"):
        assert json.loads((tok / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
        assert not (tok / "config.json").exists(), tok


def _check_triton_trtllm_release(w, tmp_path):
    from harp_trt.builders.triton import TritonRepoConfig, write_repository
    from harp_trt.builders.triton.releases import DEFAULT_TRITON_RELEASE, TRITON_TRTLLM
    from harp_trt.errors import HarpError

    target = json.loads((w["art"] / "manifest.json").read_text())["tensorrt_llm"]["version"]
    assert TRITON_TRTLLM[DEFAULT_TRITON_RELEASE].tensorrt_llm == target
    with pytest.raises(HarpError, match=rf"Triton 25\.10 carries TensorRT-LLM 1\.0\.0.*{re.escape(target)}"):
        write_repository(w["art"], tmp_path / "old", TritonRepoConfig(triton_release="25.10"))


def _check_triton_docker_env(w):
    readme = (w["repo"] / "README.md").read_text()
    runs = [shlex.split(line) for block in readme.split("```bash")[1:]
            for line in block.split("```")[0].replace("\\\n", " ").splitlines() if line.startswith("docker run")]
    assert runs, "the README has no docker run"
    for words in runs:
        for i, word in enumerate(words):
            if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", word):
                assert words[i - 1] == "-e", f"{word} is not behind -e in {' '.join(words)}"


CHECKS = {"qwen-seq-length": _check_qwen_seq_length, "sink": _check_sink, "pp-windows": _check_pp_windows,
          "kv-shares": _check_kv_shares, "user-window": _check_user_window, "pp-attention": _check_pp_attention,
          "hf-lm-head": _check_hf_lm_head, "tb-keys": _check_tb_keys, "ort-release": _check_ort_release,
          "tb-batching": _check_tb_batching, "ort-gpu-gqa": _check_ort_gpu_gqa,
          "tb-version-folder": _check_tb_version_folder, "ort-bf16": _check_ort_bf16,
          "tokenizer-folder": _check_tokenizer_folder, "tokenizer-portable": _check_tokenizer_portable,
          "triton-trtllm-release": _check_triton_trtllm_release, "triton-docker-env": _check_triton_docker_env}


@pytest.mark.slow
@pytest.mark.parametrize("item", ISSUE_ITEMS)
def test_each_issue_item_is_a_row_and_holds_on_written_files(item, written, tmp_path):
    """The findings that started the document: each is a row, and what the row requires holds on
    what the code writes (config.json, launch files, the Triton repository, ORT graphs)."""
    assert item in {r[0] for r in _rows()}, f"no row {item!r} in docs/trtllm-contract.md"
    check = CHECKS[item]
    check(written, tmp_path) if check.__code__.co_argcount == 2 else check(written)


def test_qwen_seq_length_is_written_as_the_converter_does_and_read_by_nothing(tmp_path):
    """Row qwen-seq-length: ``QWenConfig.from_hugging_face`` writes ``getattr(hf_config, "seq_length",
    8192)`` and the Qwen model never reads it. The writer: 8192 for a Qwen2 config without the field,
    the config's own value where it has one. Nothing computes with it: the checkpoint read back (the
    reader computes what TensorRT-LLM's QWen model does) gives the same logits whatever seq_length
    says, shorter than the sequence included, and equals PyTorch HARP."""
    from harp_trt.builders.trtllm import read_checkpoint, write_checkpoint
    from harp_trt.harp import apply_harp

    model = make_tiny("qwen2")
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = apply_harp(copy.deepcopy(model), PLAN)(ids).logits
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    assert "seq_length" not in json.loads((tmp_path / "src" / "config.json").read_text())
    write_checkpoint(tmp_path / "src", _plan("qwen2"), tmp_path / "ckpt", dtype="float32", max_seq_len=64)
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["seq_length"] == 8192 and cfg["max_position_embeddings"] == model.config.max_position_embeddings
    got = read_checkpoint(tmp_path / "ckpt")(ids)
    assert (got - want).abs().max().item() <= 1e-4
    for other in (4096, 7):   # 7 < the 20 tokens read
        (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**cfg, "seq_length": other}))
        assert torch.equal(read_checkpoint(tmp_path / "ckpt")(ids), got), other

    hf = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**hf, "seq_length": 4096}))
    write_checkpoint(tmp_path / "src", _plan("qwen2"), tmp_path / "ckpt2", dtype="float32", max_seq_len=64)
    assert json.loads((tmp_path / "ckpt2" / "config.json").read_text())["seq_length"] == 4096
