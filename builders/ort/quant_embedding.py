"""Graph rule: the token embedding's ``Gather`` of a constant fp32 table becomes
``com.microsoft::GatherBlockQuantized`` of that table quantized to the engine's weight bits (the
int4 embedding onnxruntime-genai's model builder writes). Rows are quantized in blocks of
``block_size`` along the hidden size, symmetric round-to-nearest: scale = max|block| / (2^(bits-1) - 1),
q = clip(round(x / scale), -2^(bits-1), 2^(bits-1) - 1) stored unsigned with zero point 2^(bits-1)
(given explicitly); 4-bit values are packed two per byte, low nibble first (the com.microsoft
contrib operator's layout; tests/test_quant_embedding.py checks ORT's kernel returns exactly these
dequantized rows). A decode step gathers one row per token, so this saves memory (the table is the
largest fp32 tensor a quantized engine keeps: 113 MB of the SmolLM2-135M int4 engine's 189 MB), not time.

It runs after ``QuantizeWeightsPass`` (``passes.py``), which has already given a tied LM head its own
weight, so only the Gather reads the table. One rule of the house protocol (``harp_trt/graph_rules.py``),
run by ``QuantizeEmbeddingPass``."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from harp_trt.graph_rules import GraphRule, MatchResult, RuleReport

from .gqa import MS_DOMAIN

log = logging.getLogger(__name__)

__all__ = ["QuantizeEmbedding", "EmbeddingMatch", "quantize_rows"]


@dataclass
class EmbeddingMatch:
    gather: ir.Node
    table: np.ndarray
    name: str                         # the table initializer's


def quantize_rows(table: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data uint8, scales fp32 [V, D/block], zero points uint8) of ``table`` [V, D] in
    GatherBlockQuantized's layout (see the module docstring)."""
    v, d = table.shape
    x = table.astype(np.float32).reshape(v, d // block, block)
    top = 2 ** (bits - 1)
    scale = np.abs(x).max(-1) / (top - 1)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = (np.clip(np.rint(x / scale[..., None]), -top, top - 1) + top).astype(np.uint8).reshape(v, d)
    nb = d // block
    if bits == 4:
        data = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        zp = np.full((v, (nb + 1) // 2), top | (top << 4), np.uint8)
    else:
        data, zp = q, np.full((v, nb), top, np.uint8)
    return data, scale, zp


class QuantizeEmbedding(GraphRule[EmbeddingMatch]):
    """``pattern``: Gathers along axis 0 of a constant 2-D float table by graph-computed indices;
    ``check``: ``block_size`` divides the row length; ``rewrite``: the GatherBlockQuantized node."""

    name = "QuantizeEmbedding"
    description = "Gather of a constant fp32 embedding table"

    key = "embedding"

    def __init__(self, bits: int, block_size: int):
        self.bits, self.block_size = bits, block_size

    def name_of(self, node: ir.Node) -> str:
        return node.name or "Gather"

    def describe(self, m: EmbeddingMatch, new: ir.Node) -> dict[str, Any]:
        return {"table": m.name, "bytes_fp32": int(m.table.nbytes),
                "bytes_quantized": sum(v.const_value.nbytes for v in new.inputs if v is not None and v.const_value is not None)}

    def finish(self, model: ir.Model, report: RuleReport) -> None:
        if report.matched:
            model.opset_imports.setdefault(MS_DOMAIN, 1)

    def summary(self, report: RuleReport) -> dict[str, Any]:
        """The tables quantized, their bytes before and after, and why others were not."""
        before = sum(t["bytes_fp32"] for t in report.matched)
        after = sum(t["bytes_quantized"] for t in report.matched)
        log.info("QuantizeEmbedding: %d tables, %.1f MB -> %.1f MB", len(report.matched), before / 1e6, after / 1e6)
        return {"rule": self.name, "tables": [t["table"] for t in report.matched], "bits": self.bits,
                "block_size": self.block_size, "bytes_fp32": before, "bytes_quantized": after, "skipped": report.skipped}

    def pattern(self, graph: ir.Graph) -> list[ir.Node]:
        out = []
        for node in graph:
            if node.op_type != "Gather" or node.domain != "" or len(node.inputs) != 2:
                continue
            table, idx = node.inputs
            axis = node.attributes.get("axis")
            if (table is not None and table.const_value is not None and len(table.const_value.shape) == 2
                    and idx is not None and idx.const_value is None and (axis is None or axis.value == 0)):
                out.append(node)
        return out

    def check(self, graph: ir.Graph, node: ir.Node) -> MatchResult[EmbeddingMatch]:
        table = node.inputs[0].const_value.numpy()
        if table.dtype != np.float32:
            return MatchResult.fail(f"table is {table.dtype}, not float32")
        if table.shape[1] % self.block_size or (self.bits == 4 and self.block_size % 2):
            return MatchResult.fail(f"block {self.block_size} does not divide the row length {table.shape[1]}")
        return MatchResult(EmbeddingMatch(node, table, node.inputs[0].name))

    def rewrite(self, graph: ir.Graph, m: EmbeddingMatch) -> ir.Node:
        data, scale, zp = quantize_rows(m.table, self.bits, self.block_size)
        name = m.gather.inputs[0].name
        vals = []
        for suffix, arr in (("q", data), ("scales", scale), ("zero_points", zp)):
            v = ir.Value(name=f"{name}_{suffix}", const_value=ir.tensor(np.ascontiguousarray(arr)))
            graph.register_initializer(v)
            vals.append(v)
        node = ir.node("GatherBlockQuantized", [vals[0], m.gather.inputs[1], vals[1], vals[2]],
                       {"bits": self.bits, "block_size": self.block_size, "gather_axis": 0, "quantize_axis": 1},
                       domain=MS_DOMAIN, name=f"{m.gather.name or 'Gather'}/quantized")
        graph.insert_before(m.gather, [node])
        old = m.gather.outputs[0]
        node.outputs[0].type, node.outputs[0].shape = old.type, old.shape
        old.replace_all_uses_with(node.outputs[0], replace_graph_outputs=True)
        graph.remove(m.gather, safe=True)
        return node
