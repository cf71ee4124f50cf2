"""The rewrite's check of a graph too large for one ONNX Runtime session (``harp_trt.probe``):
the probe export, rewritten by the same pass, against the PyTorch HARP reference of the probe
model; then every layer of the full rewritten graph against the probe layer of its form."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Callable

from ..onnx_io import EXPORT_META_KEY, MODEL_FILE
from ..plan import Plan
from ..probe import check_structure, probe_alphas
from ..store import Artifact
from ..verify import VerifyConfig, verify_rewrite
from .graph import STAGE

__all__ = ["verify_with_probe"]


def _probe_plan(plan: Plan, layers: list[int]) -> Plan:
    alphas = probe_alphas(layers, plan.alpha_map)
    keep = sorted(alphas)
    return dataclasses.replace(plan, num_layers=len(layers), layers=tuple(keep),
                               alphas=tuple(alphas[k] for k in keep), scores=())


def verify_with_probe(full: Path, probe: Artifact, plan: Plan, cfg: VerifyConfig, work: Path,
                      rewrite_onnx: Callable[..., dict]) -> dict[str, Any]:
    """Rewrite ``probe``'s graph for ``plan`` into ``work`` (removed afterwards) with the stage's
    ``rewrite_onnx`` (the one that wrote ``full``), verify it numerically, and check ``full``'s
    structure against it. Returns what was checked."""
    import onnx_ir as ir

    info = probe.manifest["probe"]
    layers = list(info["layers"])
    probe_plan = _probe_plan(plan, layers)
    work.mkdir(parents=True, exist_ok=True)
    try:
        rewritten = work / MODEL_FILE
        rewrite_onnx(probe.path / probe.manifest.get("onnx", MODEL_FILE), probe_plan, rewritten)
        res = verify_rewrite(rewritten, probe.path / info["folder"], probe_plan.alpha_map, cfg)
        big, small = ir.load(str(full)), ir.load(str(rewritten))  # weights stay on disk (memory-mapped)
        vocab = json.loads(big.metadata_props[EXPORT_META_KEY])["vocab_size"]
        structure = check_structure(big, small, layers, plan.alpha_map, plan.num_layers, vocab, info["vocab"], STAGE)
        del big, small
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {**res.to_dict(), "path": "probe", "probe": {"layers": layers, "alphas": probe_plan.alpha_map,
                                                        "vocab": info["vocab"], "artifact": probe.key},
            "structure": structure,
            "verified": "numerically: the probe (its layers, real weights, sliced vocabulary) against PyTorch "
                        "HARP; structurally: every layer of the full graph against the probe layer of its form",
            "inferred": "that the full graph's other layers, whose nodes equal a verified layer's, compute their "
                        "weights as the verified ones do"}
