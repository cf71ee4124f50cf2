"""The ORT build's graph passes and the one place that orders them (``graph_passes``), run in
order by ``harp_trt.graph_rules.run_passes`` (as onnx-ir's ``Sequential`` would, and as onnxscript's
``optimize_for_ort`` composes its own), which hands back each pass's report by the engine field it
fills (``engine_fields``). The rule passes are ``RulePass`` over one rule each:

    FuseGroupQueryAttentionPass -> RemoveUnusedNodesPass     (attention="gqa")
    FuseSiblingMatMulsPass -> RemoveUnusedNodesPass          (fuse_matmuls)
    LogitsToKeepPass                                         (logits_to_keep)
    QuantizeWeightsPass                                      (quant="int4" | "int8" | "w8a8")
    QuantizeEmbeddingPass -> RemoveUnusedNodesPass           (quant_embedding, with quant)

ONNX Runtime's own graph optimizations run after these, on the saved graph (``builder.py``)."""
from __future__ import annotations

from typing import Any, Mapping

import onnx_ir as ir
import onnx_ir.passes as ir_passes
from onnx_ir.passes.common import RemoveUnusedNodesPass

from harp_trt.graph_rules import RulePass, RuleReport, RuleResult, run_passes

from .config import OrtBuildConfig, QuantSpec
from .fuse_matmuls import FuseSiblingMatMuls
from .gqa import NO_EXPORT_META, FuseGroupQueryAttention
from .logits_to_keep import LogitsToKeep
from .quant import quantize_weights
from .quant_embedding import QuantizeEmbedding

__all__ = ["FuseGroupQueryAttentionPass", "FuseSiblingMatMulsPass", "LogitsToKeepPass", "QuantizeWeightsPass", "graph_passes",
           "QuantizeEmbeddingPass", "run_passes", "engine_fields"]


class FuseGroupQueryAttentionPass(RulePass):
    """Every ``Attention`` becomes ``GroupQueryAttention`` (one that the rule does not match is a
    GraphError with the reason). ``meta`` is the export metadata (``harp_trt.onnx_io.read_export_meta``):
    without it nothing changes and the report says so."""

    def __init__(self, meta: Mapping[str, Any]):
        super().__init__(FuseGroupQueryAttention.from_export_meta(meta), "build")

    def call(self, model: ir.Model) -> RuleResult:
        if self.rule is None:
            report = FuseGroupQueryAttention.summary(RuleReport(FuseGroupQueryAttention.name, skipped={"*": NO_EXPORT_META}))
            return RuleResult(model, modified=False, key=FuseGroupQueryAttention.key, report=report)
        return super().call(model)


class FuseSiblingMatMulsPass(RulePass):
    """Every group of MatMuls reading one activation becomes one MatMul and a Split (``fuse_matmuls.py``)."""

    def __init__(self):
        super().__init__(FuseSiblingMatMuls(), "build")


class LogitsToKeepPass(RulePass):
    """The ``logits_to_keep`` input in front of the LM head (``logits_to_keep.py``)."""

    def __init__(self):
        super().__init__(LogitsToKeep(), "build")


class QuantizeEmbeddingPass(RulePass):
    """The embedding Gather as GatherBlockQuantized at the weights' bits (``quant_embedding.py``)."""

    def __init__(self, spec: QuantSpec):
        super().__init__(QuantizeEmbedding(spec.bits, spec.block_size), "build")


class QuantizeWeightsPass(ir_passes.InPlacePass):
    """Weight-only int4/int8 ``MatMulNBits`` (``quant.py``), weight by weight in place (the tied
    LM head's weight is folded first); its report, under ``quant``, is what changed. Not a rule:
    every weight MatMul is quantized, none is left for a reason."""

    def __init__(self, spec: QuantSpec, stage: str):
        super().__init__()
        self.spec, self.stage = spec, stage

    def call(self, model: ir.Model) -> RuleResult:
        out, report = quantize_weights(model, self.spec, self.stage)
        return RuleResult(out, modified=True, key="quant", report=report)


def graph_passes(config: OrtBuildConfig, meta: Mapping[str, Any], stage: str) -> list[ir_passes.PassBase]:
    """The passes ``config`` asks for, in the order they run."""
    passes: list[ir_passes.PassBase] = []
    if config.attention == "gqa":
        passes += [FuseGroupQueryAttentionPass(meta), RemoveUnusedNodesPass()]
    if config.fuse_matmuls:
        passes += [FuseSiblingMatMulsPass(), RemoveUnusedNodesPass()]
    if config.logits_to_keep:
        passes.append(LogitsToKeepPass())
    if config.quant != "none":
        passes.append(QuantizeWeightsPass(config.quant_spec(), stage))
        if config.quant_embedding:
            passes += [QuantizeEmbeddingPass(config.quant_spec()), RemoveUnusedNodesPass()]
    return passes


def engine_fields(reports: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's fields from the passes' reports (``run_passes``): what a pass that did not run
    leaves (no attention fusion: an empty conversion list; the others: None), the embedding's
    report inside the weights' (``quant.embedding``)."""
    out = {"attention": reports.get("attention") or FuseGroupQueryAttention.summary(RuleReport(FuseGroupQueryAttention.name)),
           "quant": reports.get("quant"), "fused_matmuls": reports.get("fused_matmuls"),
           "logits_to_keep": reports.get("logits_to_keep")}
    if out["quant"] is not None and reports.get("embedding") is not None:
        out["quant"] = {**out["quant"], "embedding": reports["embedding"]}
    return out
