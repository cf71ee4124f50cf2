"""docs/trtllm-contract.md: every row names its source and a test, and every test it names exists
(so a requirement we cannot run here is never left unchecked)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "trtllm-contract.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| id ") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _tests(file: str) -> set[str]:
    tree = ast.parse((ROOT / "tests" / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_row_cites_a_source_and_an_existing_test():
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


def test_the_issue_items_are_all_rows():
    ids = {r[0] for r in _rows()}
    # the findings that started this document: seq_length, sink, pp windows, KV split, user
    # windows, empty pp stages, tied lm_head, Triton keys, ORT versions, V1 / GPU / bf16
    for rid in ("qwen-seq-length", "sink", "pp-windows", "kv-shares", "user-window", "pp-attention", "hf-lm-head",
                "tb-keys", "ort-release", "tb-batching", "ort-gpu-gqa", "tb-version-folder", "ort-bf16",
                # deployments that start: tokenizer folder, portable tokenizers, Triton image, docker -e
                "tokenizer-folder", "tokenizer-portable", "triton-trtllm-release", "triton-docker-env"):
        assert rid in ids


def test_qwen_seq_length_row_says_what_the_source_does():
    """QWenConfig.from_hugging_face writes getattr(hf_config, "seq_length", 8192) and QWenDecoderLayer
    never reads it: the row must say so, not that the decoder reads it (the writer's value is checked by
    the row's own test)."""
    row = {r[0]: r for r in _rows()}["qwen-seq-length"]
    assert "8192" in row[1] and "never read" in row[1] and "read it with no default" not in row[1]
    assert "QWenConfig.from_hugging_face" in row[2] and "QWenDecoderLayer" in row[2]
