"""What the bench's engines are: their content digest (the stage key) and whether they were built
from the plan's weights and layers (the stage's precondition)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

from harp_trt.config import digest_of
from harp_trt.engine_spec import ENGINE_JSON
from harp_trt.errors import HarpError, PreconditionError
from harp_trt.onnx_io import MODEL_FILE, check_plan_weights, file_digest, read_export_meta
from harp_trt.plan import Plan
from harp_trt.store import Artifact

__all__ = ["engine_digest", "check_source_matches_plan"]

log = logging.getLogger(__name__)


def engine_digest(p: Path) -> str:
    """Content digest of an engine given as a path: a GGUF file, or a folder's graph (``model.onnx``)
    with its ``genai_config.json`` / its ``model.gguf``."""
    if p.is_file():
        return file_digest(p)
    files = [p / n for n in (MODEL_FILE, "genai_config.json", "model.gguf") if (p / n).is_file()]
    if not files:
        raise PreconditionError("bench", f"engine folder {p} holds no model.onnx or model.gguf",
                                "pass a built engine folder (or its artifact key)")
    return file_digest(files[0]) if len(files) == 1 else digest_of({f.name: file_digest(f) for f in files})


def check_source_matches_plan(plan: Plan, source: Any, engine: str) -> None:
    """PreconditionError when the engines were not built from the plan's weights and layers."""
    if isinstance(source, Mapping):
        missing = [v for v in ("dense", "harp") if v not in source]
        if missing:
            raise PreconditionError("bench", f"the {engine} engine needs a dense and a HARP engine folder; "
                                    f"missing {', '.join(missing)}", "pass --dense-engine DIR and --harp-engine DIR")
        for variant, s in source.items():
            folder = s.path if isinstance(s, Artifact) else Path(s)
            digest, layers = _engine_identity(folder)
            check_plan_weights(plan.model_digest, digest, "bench", f"the {variant} engine {folder}",
                               "bench engines built from the plan's model")
            if variant in ("harp", "harp_fp32") and layers is not None and sorted(layers) != sorted(plan.layers):
                raise PreconditionError("bench", f"HARP engine {folder} prunes layers {sorted(layers)}, the plan "
                                        f"prunes {list(plan.layers)}", "rebuild the engine from this plan")
            if variant in ("dense", "dense_fp32") and layers:
                raise PreconditionError("bench", f"dense engine {folder} already prunes layers {sorted(layers)}",
                                        "pass the dense (unrewritten) export as --dense-engine")
        return
    digest = getattr(source, "digest", None)
    if not digest:
        raise PreconditionError("bench", f"model {getattr(source, 'ref', source)!r} has no weights digest",
                                "pass a model resolved by harp_trt.models.resolve_model")
    check_plan_weights(plan.model_digest, digest, "bench", f"model {getattr(source, 'ref', source)!r}")


def _engine_identity(folder: Path) -> tuple[str | None, list[int] | None]:
    """(weights digest, pruned layers) recorded by the export/rewrite/build stages, where present:
    the artifact manifest's model digest, engine.json's KV layout (layers without KV are pruned),
    a plan.json beside the graph, or the graph's export metadata."""
    def read(name):
        f = folder / name
        try:
            return json.loads(f.read_text()) if f.is_file() else None
        except ValueError:
            return None

    manifest, engine, plan = read("manifest.json"), read(ENGINE_JSON), read("plan.json")
    digest = None
    for d in (manifest, engine):
        if d is not None and digest is None:
            found = _find(d, ("model_digest", "digest"))
            digest = found if isinstance(found, str) else None
    layers = None
    kv = (engine or {}).get("kv") or {}
    if isinstance(kv.get("layers"), list) and kv.get("num_layers"):
        layers = sorted(set(range(int(kv["num_layers"]))) - {int(i) for i in kv["layers"]})
    elif plan is not None and isinstance(plan.get("layers"), list):
        layers = [int(i) for i in plan["layers"]]
    elif (folder / MODEL_FILE).is_file():
        try:
            meta = read_export_meta(folder / MODEL_FILE, "bench")
            if isinstance(meta.get("kv_layers"), list) and meta.get("num_layers"):
                layers = sorted(set(range(int(meta["num_layers"]))) - {int(i) for i in meta["kv_layers"]})
        except HarpError as e:  # a user's graph without our metadata: nothing to check against
            log.info("no export metadata in %s: %s", folder, e)
    return digest, layers


def _find(d: Any, keys: tuple[str, ...]) -> Any:
    """First value under one of ``keys`` in a nested dict (breadth first)."""
    queue = [d]
    while queue:
        cur = queue.pop(0)
        if isinstance(cur, dict):
            for k in keys:
                if k in cur and isinstance(cur[k], (str, list)):
                    return cur[k]
            queue += [v for v in cur.values() if isinstance(v, dict)]
    return None
