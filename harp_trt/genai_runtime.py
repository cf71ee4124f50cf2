"""Opening onnxruntime-genai folders: the one place that imports ``onnxruntime_genai`` and loads an
``og.Model`` on the CPU (or, for the GPU scripts, on CUDA) with a fixed thread count. The genai deploy stage (``builders/genai``), the
bench's genai engine (``bench/stage/engine_genai.py``) and the genai baseline script
(``bench/_genai_baseline.py``) all open folders through it; it lives in the core because no stage
may import another.

``onnxruntime_genai`` 0.18 aborts the whole process ("Failed to load onnxruntime") when it is
imported before ``onnxruntime``; ``import_genai`` imports them in the working order. Threads go
into ``model.decoder.session_options`` through ``og.Config.overlay`` (intra-op = ``threads``,
inter-op = 1, like ``harp_trt.ort_session``); ``clear_providers`` keeps the model on the CPU, and
``provider="cuda"`` appends genai's CUDA provider after it (``og.Config.append_provider``; it needs
the onnxruntime-genai-cuda build, ``og.is_cuda_available()``)."""
from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from .errors import PreconditionError

__all__ = ["genai_version", "import_genai", "open_genai_model"]


def genai_version() -> str | None:
    """The installed onnxruntime-genai version, or None (without importing it)."""
    try:
        return importlib.metadata.version("onnxruntime-genai")
    except importlib.metadata.PackageNotFoundError:
        return None


def import_genai(stage: str = "genai") -> Any:
    """``onnxruntime_genai``, imported after ``onnxruntime`` (the order 0.18 needs);
    ``PreconditionError`` naming ``stage`` where it does not import."""
    try:
        import onnxruntime  # noqa: F401  (must precede onnxruntime_genai)
        import onnxruntime_genai as og
    except ImportError as exc:
        raise PreconditionError(stage, f"onnxruntime_genai does not import: {exc}",
                                "pip install -e '.[genai]'") from exc
    return og


def open_genai_model(folder: str | os.PathLike, threads: int = 0, stage: str = "genai",
                     provider: str = "cpu", arena: bool = True) -> Any:
    """``og.Model`` of the genai folder ``folder`` on the CPU, or on ``provider`` ("cuda"); ``threads``
    > 0 sets the intra-op thread count (0 keeps the folder's ``genai_config.json`` setting or
    genai's default); ``arena`` False turns ONNX Runtime's CPU memory arena off
    (``enable_cpu_mem_arena``), so buffers go back to the system after each run."""
    og = import_genai(stage)
    if provider not in ("cpu", "cuda"):
        raise PreconditionError(stage, f"genai provider {provider!r} is not cpu or cuda")
    if provider == "cuda" and not og.is_cuda_available():
        raise PreconditionError(stage, f"onnxruntime-genai {genai_version()} here has no CUDA provider",
                                "pip install onnxruntime-genai-cuda (it brings onnxruntime-gpu) on a CUDA host")
    if not (Path(folder) / "genai_config.json").is_file():
        raise PreconditionError(stage, f"{folder} has no genai_config.json",
                                "pass a folder written by `harp-trt deploy genai` (or build --backend genai)")
    config = og.Config(str(folder))
    config.clear_providers()  # CPU
    if provider == "cuda":
        config.append_provider("cuda")
    session: dict[str, Any] = {}
    if threads:
        session.update(intra_op_num_threads=int(threads), inter_op_num_threads=1)
    if not arena:
        session["enable_cpu_mem_arena"] = False
    if session:
        config.overlay(json.dumps({"model": {"decoder": {"session_options": session}}}))
    return og.Model(config)
