"""The engine contract: the file that makes a folder a harp-trt engine, and its format.

An engine folder (written by ``harp_trt.builders.ort``, read by ``generate``, the bench, the genai and
Triton deployments and the served Triton model) holds the graph, its tokenizer and ``engine.json``,
whose ``"format"`` is ``ENGINE_FORMAT``; ``builders/ort/builder.py``'s docstring lists its fields.
This module owns the file name, the format string, how the file is read and written, which graph
file an engine runs (``engine_model``) and how an engine's thread count is read, as
``harp_trt.onnx_io`` owns the ONNX I/O names (``tests/test_house_owners.py`` checks no other module
spells them). Light: json, pathlib and ``onnx_io``'s names only, so the Triton model and the CLI
import it freely."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from .onnx_io import MODEL_FILE

__all__ = ["ENGINE_JSON", "ENGINE_FORMAT", "is_engine", "engine_json", "read_engine_spec", "write_engine_spec",
           "engine_model", "engine_threads"]

ENGINE_JSON = "engine.json"
ENGINE_FORMAT = "harp-engine/1"


def engine_json(folder: str | Path) -> Path:
    """The path of ``folder``'s engine description (which may not exist)."""
    return Path(folder) / ENGINE_JSON


def is_engine(folder: str | Path) -> bool:
    """Whether ``folder`` holds an engine description (its format is checked when it is read)."""
    return engine_json(folder).is_file()


def read_engine_spec(folder: str | Path) -> dict[str, Any]:
    """``folder``'s ``engine.json`` as a dict. Raises ``FileNotFoundError`` when there is none and
    ``ValueError`` when it is not JSON or not of ``ENGINE_FORMAT``; callers turn these into their
    stage's typed error."""
    f = engine_json(folder)
    try:
        spec = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(spec, dict) or spec.get("format") != ENGINE_FORMAT:
        raise ValueError(f"{f} is not a harp-trt engine description (format {ENGINE_FORMAT!r})")
    return spec


def write_engine_spec(folder: str | Path, spec: dict[str, Any]) -> Path:
    """Write ``spec`` (its ``"format"`` set to ``ENGINE_FORMAT``) as ``folder``'s ``engine.json``."""
    f = engine_json(folder)
    f.write_text(json.dumps({**spec, "format": ENGINE_FORMAT}, indent=2))
    return f


def engine_model(folder: str | Path, spec: Mapping[str, Any] | None = None) -> Path:
    """The graph file an engine in ``folder`` runs: ``engine.json``'s ``"model"`` (the file its
    builder wrote), else ``MODEL_FILE``. ``spec``: the description already read (an empty one for a
    folder without ``engine.json``); None reads it here, as ``read_engine_spec`` does."""
    spec = read_engine_spec(folder) if spec is None else spec
    return Path(folder) / spec.get("model", MODEL_FILE)


def engine_threads(spec: Mapping[str, Any] | None, threads: int | str | None = None) -> int | None:
    """The intra-op thread count an engine runs with, the one reading of every ``threads`` setting:
    ``threads`` when it is a positive count (the caller's choice: a flag, a Triton parameter), else
    the ``intra_op_threads`` the engine was built with, else None, the runtime's own default (ONNX
    Runtime: one per physical core). 0, "" and None all mean "not set". ``ValueError`` for a
    negative count or a non-integer."""
    for value in (threads, (spec or {}).get("intra_op_threads")):
        n = int(value or 0)
        if n < 0:
            raise ValueError(f"a thread count must be >= 0 (0: not set), got {value!r}")
        if n:
            return n
    return None
