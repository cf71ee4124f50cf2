"""The ORT build's graph passes and the one place that orders them (``graph_passes``), composed
with onnx-ir's ``Sequential`` (``passes/_pass_infra.py``) as onnxscript's ``optimize_for_ort``
composes its own:

    FuseGroupQueryAttentionPass -> RemoveUnusedNodesPass     (attention="gqa")
    FuseSiblingMatMulsPass -> RemoveUnusedNodesPass          (fuse_matmuls)
    LogitsToKeepPass                                         (logits_to_keep)
    QuantizeWeightsPass                                      (quant="int4" | "int8" | "w8a8")
    QuantizeEmbeddingPass -> RemoveUnusedNodesPass           (quant_embedding, with quant)

ONNX Runtime's own graph optimizations run after these, on the saved graph (``builder.py``)."""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import onnx_ir as ir
import onnx_ir.passes as ir_passes
from onnx_ir.passes.common import RemoveUnusedNodesPass

from harp_trt.errors import GraphError, HarpError

from .config import OrtBuildConfig, QuantSpec
from .fuse_matmuls import FuseReport, FuseSiblingMatMuls
from .gqa import MS_DOMAIN, FuseGroupQueryAttention, GqaReport
from .logits_to_keep import LogitsToKeep
from .quant import quantize_weights
from .quant_embedding import QuantizeEmbedding

__all__ = ["FuseGroupQueryAttentionPass", "FuseSiblingMatMulsPass", "LogitsToKeepPass", "QuantizeWeightsPass", "graph_passes",
           "QuantizeEmbeddingPass", "run_passes"]

log = logging.getLogger(__name__)


class FuseGroupQueryAttentionPass(ir_passes.InPlacePass):
    """Every ``Attention`` becomes ``GroupQueryAttention`` (one that ``FuseGroupQueryAttention`` does
    not match is a GraphError with the reason); ``report`` says which layers were converted, or why
    the whole graph was left alone. ``meta`` is the export metadata
    (``harp_trt.onnx_io.read_export_meta``): without it nothing changes."""

    def __init__(self, meta: Mapping[str, Any]):
        super().__init__()
        self.meta = meta
        self.report = GqaReport()

    def call(self, model: ir.Model) -> ir_passes.PassResult:
        report = self.report = GqaReport()
        rule = FuseGroupQueryAttention.from_export_meta(self.meta)
        if rule is None:
            report.skipped["*"] = "graph has no harp_trt.export metadata (not from export_dense); left unchanged"
            return ir_passes.PassResult(model, modified=False)
        graph = model.graph
        candidates = rule.pattern(graph)
        if not candidates:
            report.skipped["*"] = "no opset-23 Attention nodes (eager attention export?)"
        for node in candidates:
            found = rule.check(graph, node)
            if not found:   # every Attention of our export fuses (sliding windows included)
                raise GraphError("build", f"GroupQueryAttention fusion found no match at {node.name}: "
                                 f"{found.reason}", "the export's attention graph has a form the rule does not "
                                 "know; teach it in builders/ort/gqa.py (OrtBuildConfig.attention='onnx' "
                                 "keeps the opset-23 Attention)")
            rule.rewrite(graph, found.match)
            report.matched.append(found.match.layer)
        if report.matched:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        log.info("GroupQueryAttention: converted layers %s; skipped %d", report.matched, len(report.skipped))
        for name, why in report.skipped.items():
            log.info("  not converted %s: %s", name, why)
        return ir_passes.PassResult(model, modified=bool(report.matched))


class FuseSiblingMatMulsPass(ir_passes.InPlacePass):
    """Every group ``FuseSiblingMatMuls`` matches becomes one MatMul and a Split (``fuse_matmuls.py``);
    ``report`` lists the groups and why other candidates were left alone."""

    def __init__(self):
        super().__init__()
        self.report = FuseReport()

    def call(self, model: ir.Model) -> ir_passes.PassResult:
        report = self.report = FuseReport()
        rule, graph = FuseSiblingMatMuls(), model.graph
        for x in rule.pattern(graph):
            found = rule.check(graph, x)
            if not found:
                report.skipped[x.name or "?"] = found.reason
                continue
            rule.rewrite(graph, found.match)
            report.fused.append({"input": x.name, "matmuls": [n.name for n in found.match.nodes],
                                 "widths": found.match.widths})
        log.info("FuseSiblingMatMuls: %d groups of %d MatMuls fused; skipped %d", len(report.fused),
                 sum(len(g["matmuls"]) for g in report.fused), len(report.skipped))
        return ir_passes.PassResult(model, modified=bool(report.fused))


class LogitsToKeepPass(ir_passes.InPlacePass):
    """The ``logits_to_keep`` input in front of the LM head (``logits_to_keep.py``); ``report`` says
    which head it cut, or why it left the graph alone."""

    def __init__(self):
        super().__init__()
        self.report: dict[str, Any] = {}

    def call(self, model: ir.Model) -> ir_passes.PassResult:
        rule, graph = LogitsToKeep(), model.graph
        self.report = {"rule": rule.name, "lm_head": None, "skipped": ""}
        for logits in rule.pattern(graph):
            found = rule.check(graph, logits)
            if not found:
                self.report["skipped"] = found.reason
                log.info("LogitsToKeep: left alone: %s", found.reason)
                return ir_passes.PassResult(model, modified=False)
            rule.rewrite(graph, found.match)
            self.report["lm_head"] = found.match.head.name
            return ir_passes.PassResult(model, modified=True)
        self.report["skipped"] = "the graph has no logits output"
        return ir_passes.PassResult(model, modified=False)


class QuantizeWeightsPass(ir_passes.InPlacePass):
    """Weight-only int4/int8 ``MatMulNBits`` (``quant.py``), weight by weight in place (the tied
    LM head's weight is folded first); ``report`` is what changed."""

    def __init__(self, spec: QuantSpec, stage: str):
        super().__init__()
        self.spec, self.stage = spec, stage
        self.report: dict[str, Any] | None = None

    def call(self, model: ir.Model) -> ir_passes.PassResult:
        out, self.report = quantize_weights(model, self.spec, self.stage)
        return ir_passes.PassResult(out, modified=True)


class QuantizeEmbeddingPass(ir_passes.InPlacePass):
    """The embedding Gather as GatherBlockQuantized at the weights' bits (``quant_embedding.py``);
    ``report``: the tables quantized, their bytes before and after, and why others were not."""

    def __init__(self, spec: QuantSpec):
        super().__init__()
        self.spec = spec
        self.report: dict[str, Any] = {}

    def call(self, model: ir.Model) -> ir_passes.PassResult:
        rule = QuantizeEmbedding(self.spec.bits, self.spec.block_size)
        done, skipped, before, after = [], {}, 0, 0
        for node in rule.pattern(model.graph):
            found = rule.check(model.graph, node)
            if not found:
                skipped[node.name or "Gather"] = found.reason
                continue
            done.append(node.inputs[0].name)
            new = rule.rewrite(model.graph, found.match)
            before += found.match.table.nbytes
            after += sum(v.const_value.nbytes for v in new.inputs if v is not None and v.const_value is not None)
        if done:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        self.report = {"rule": rule.name, "tables": done, "bits": self.spec.bits, "block_size": self.spec.block_size,
                       "bytes_fp32": before, "bytes_quantized": after, "skipped": skipped}
        log.info("QuantizeEmbedding: %d tables, %.1f MB -> %.1f MB", len(done), before / 1e6, after / 1e6)
        return ir_passes.PassResult(model, modified=bool(done))


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


def run_passes(passes: Sequence[ir_passes.PassBase], model: ir.Model) -> ir.Model:
    """``Sequential(*passes)`` on ``model``; the model they return. A harp-trt error raised inside
    a pass comes out as itself (``Sequential`` wraps every error in ``PassError``)."""
    if not passes:
        return model
    try:
        return ir_passes.Sequential(*passes)(model).model
    except ir_passes.PassError as e:
        if isinstance(e.__cause__, HarpError):
            raise e.__cause__ from None
        raise

