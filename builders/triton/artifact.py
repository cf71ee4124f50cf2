"""What a Triton repository is written from: an artifact folder (or cache key) classified as an ONNX
graph (export / rewrite / ORT engine / bare ``model.onnx`` folder) or a TensorRT-LLM checkpoint."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from harp_trt import engine_spec
from harp_trt.errors import PreconditionError
from harp_trt.store import MANIFEST

from .pbtxt import STAGE

__all__ = ["ArtifactInfo", "inspect_artifact", "ONNX_STAGES", "TRTLLM_STAGES"]

ONNX_STAGES = ("export", "rewrite", "build-ort")
TRTLLM_STAGES = ("trtllm",)


@dataclasses.dataclass(frozen=True)
class ArtifactInfo:
    kind: str               # "onnx" or "trtllm"
    path: Path
    stage: str | None       # the manifest's stage, "ort-engine" for an engine.json folder, None for a bare folder
    manifest: dict[str, Any]
    onnx: Path | None = None
    engine: dict[str, Any] | None = None  # engine.json of an ORT engine folder


def inspect_artifact(ref: str | os.PathLike, store=None) -> ArtifactInfo:
    """Classify an artifact folder (or a cache key, looked up in ``store``) for the Triton target."""
    p = Path(ref)
    if not p.is_dir() and store is not None:
        try:
            p = store.open(str(ref)).path
        except Exception:  # CacheError: report below with the Triton wording
            pass
    if not p.is_dir():
        raise PreconditionError(STAGE, f"no artifact folder at {ref}",
                                "pass an export/rewrite/ORT-engine/trtllm artifact folder or its cache key "
                                "(`harp-trt cache ls`)")
    p = p.resolve()
    manifest = json.loads((p / MANIFEST).read_text()) if (p / MANIFEST).is_file() else {}
    stage = manifest.get("stage")
    engine_json = engine_spec.engine_json(p)
    valid = ", ".join(ONNX_STAGES + TRTLLM_STAGES)
    if stage in TRTLLM_STAGES:
        return ArtifactInfo("trtllm", p, stage, manifest)
    if stage is not None and stage not in ONNX_STAGES and not engine_json.is_file():
        raise PreconditionError(STAGE, f"{p.name} is a {stage!r} artifact; Triton repositories are written from "
                                f"{valid} artifacts or an ORT engine folder",
                                "deploy the plan first (`harp-trt deploy trtllm --plan ...`, or export/rewrite it "
                                "to ONNX), then pass that artifact")
    name = manifest.get("onnx") or "model.onnx"
    engine: Any = None
    if engine_json.is_file():
        try:
            engine = json.loads(engine_json.read_text())
        except ValueError:
            raise PreconditionError(STAGE, f"{engine_json} is not valid JSON") from None
        stage = stage or "ort-engine"
        onnx_name = engine.get("model") if isinstance(engine, dict) else None  # builders/ort engine.json
        name = onnx_name if isinstance(onnx_name, str) and onnx_name.endswith(".onnx") else name
    onnx_path = p / name
    if not onnx_path.is_file():
        what = f"{stage!r} artifact" if stage else "folder"
        raise PreconditionError(STAGE, f"{what} {p} has no {name}",
                                "re-run the stage that writes it; an ONNX Runtime repository needs the graph")
    return ArtifactInfo("onnx", p, stage, manifest, onnx_path,
                        engine if engine_json.is_file() and isinstance(engine, dict) else None)
