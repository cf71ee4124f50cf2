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
from ..families import FAMILIES
from ..probe import check_structure, layer_signatures, probe_alphas, probe_fitted
from ..store import Artifact
from ..verify import VerifyConfig, verify_rewrite
from .graph import STAGE

__all__ = ["ProbeCheck", "check_probe"]


def _probe_plan(plan: Plan, layers: list[int]) -> Plan:
    alphas = probe_alphas(layers, plan.alpha_map)
    keep = sorted(alphas)
    return dataclasses.replace(plan, num_layers=len(layers), layers=tuple(keep),
                               alphas=tuple(alphas[k] for k in keep), scores=())


@dataclasses.dataclass
class ProbeCheck:
    """The numeric half of the check, done before the full graph is written (``check_probe``), and
    the probe's layer signatures for the structural half (``structure``)."""

    result: dict[str, Any]
    signatures: dict
    layers: list[int]
    alphas: dict[int, float]
    vocab: int
    artifact: str

    def structure(self, full: Path, plan: Plan) -> dict[str, Any]:
        """Every layer of the full rewritten graph against the probe layer of its form; the report."""
        import onnx_ir as ir

        big = ir.load(str(full))  # weights stay on disk (memory-mapped)
        vocab = json.loads(big.metadata_props[EXPORT_META_KEY])["vocab_size"]
        structure = check_structure(big, self.signatures, self.layers, plan.alpha_map, plan.num_layers, vocab, STAGE)
        del big
        return {**self.result, "path": "probe", "probe": {"layers": self.layers, "alphas": self.alphas,
                                                          "vocab": self.vocab, "artifact": self.artifact},
                "structure": structure,
                "verified": "numerically: the probe (its layers, real weights, sliced vocabulary) against PyTorch "
                            "HARP; structurally: every layer of the full graph against the probe layer of its form",
                "inferred": "that the full graph's other layers, whose nodes equal a verified layer's, compute their "
                            "weights as the verified ones do"}


def check_probe(probe: Artifact, plan: Plan, cfg: VerifyConfig, work: Path,
                rewrite_onnx: Callable[..., dict]) -> ProbeCheck:
    """Rewrite ``probe``'s graph for ``plan`` into ``work`` with the stage's ``rewrite_onnx`` (the one
    that writes the full graph), verify it numerically and keep its layer signatures; ``work`` is
    removed before the full graph is written, so the cache never holds both rewrites."""
    import onnx_ir as ir

    info = probe.manifest["probe"]
    layers = list(info["layers"])
    probe_plan = _probe_plan(plan, layers)
    work.mkdir(parents=True, exist_ok=True)
    try:
        rewritten = work / MODEL_FILE
        fitted = probe_fitted(layers, plan.fitted_tensors(), FAMILIES.get(plan.family).layer_prefix)
        rewrite_onnx(probe.path / probe.manifest.get("onnx", MODEL_FILE), probe_plan, rewritten, fitted=fitted)
        res = verify_rewrite(rewritten, probe.path / info["folder"], probe_plan.alpha_map, cfg, fitted=fitted)
        signatures = layer_signatures(ir.load(str(rewritten)), info["vocab"])  # dtypes and shapes, no data
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return ProbeCheck(res.to_dict(), signatures, layers, probe_plan.alpha_map, info["vocab"], probe.key)
