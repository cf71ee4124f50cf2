"""Graph rule: MatMuls that read the same activation with constant weights become one MatMul of the
concatenated weights and a ``Split`` (the fused QKV projection onnxruntime-genai's model builder
writes, and the MLP's gate and up projections alike)::

    q = MatMul(x, Wq); k = MatMul(x, Wk); v = MatMul(x, Wv)
        ->  q, k, v = Split(MatMul(x, Concat(Wq, Wk, Wv, axis=1)), axis=-1, split=[Nq, Nk, Nv])

Why: a decode step multiplies one row by each weight, so every MatMul is a kernel launch, a
thread-pool dispatch and (``MatMulNBits`` at accuracy level 4) one int8 quantization of the same
activation; one wider MatMul does that once. Exact: each output column is the same dot product
over K, and weight-only quantization blocks run along K, so quantizing the fused weight gives each
column the blocks and scales the separate weights would have had. It runs on the fp32 graph before
``QuantizeWeightsPass`` (``passes.py``), which then quantizes the fused weight.

One rule of the house protocol (``harp_trt/graph_rules.py``), run by ``FuseSiblingMatMulsPass``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from harp_trt.graph_rules import GraphRule, MatchResult, RuleReport

__all__ = ["FuseSiblingMatMuls", "SiblingMatMuls"]


@dataclass
class SiblingMatMuls:
    x: ir.Value                       # the activation every MatMul reads
    nodes: list[ir.Node]              # in graph order
    widths: list[int]                 # each weight's N


def _weight(node: ir.Node) -> ir.TensorProtocol | None:
    """The constant 2-D weight of a plain MatMul, else None (its data is not read: a lazily
    widened compact weight stays unread until the fused weight is)."""
    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2 or node.inputs[1] is None:
        return None
    w = node.inputs[1].const_value
    return w if w is not None and len(w.shape) == 2 else None


class FuseSiblingMatMuls(GraphRule[SiblingMatMuls]):
    """``pattern``: activations read as the left operand of two or more MatMuls; ``check``: the
    weights are constant, 2-D, of one dtype and one K; ``rewrite``: one MatMul and a Split."""

    name = "FuseSiblingMatMuls"
    description = "MatMuls of one activation by constant weights (q/k/v, gate/up)"
    key = "fused_matmuls"

    def describe(self, m: SiblingMatMuls, added: Any) -> dict[str, Any]:
        return {"input": m.x.name, "matmuls": [n.name for n in m.nodes], "widths": m.widths}

    def summary(self, report: RuleReport) -> dict[str, Any]:
        """The groups fused, and why other candidates were left alone."""
        return {"rule": self.name, "groups": len(report.matched), "matmuls": sum(len(g["matmuls"]) for g in report.matched),
                "fused": report.matched, "skipped": report.skipped}

    def pattern(self, graph: ir.Graph) -> list[ir.Value]:
        seen: dict[int, ir.Value] = {}
        for node in graph:
            if node.op_type == "MatMul" and node.domain == "" and node.inputs and node.inputs[0] is not None:
                x = node.inputs[0]
                if sum(1 for u in x.uses() if u.node.op_type == "MatMul" and u.idx == 0) >= 2:
                    seen.setdefault(id(x), x)
        return list(seen.values())

    def check(self, graph: ir.Graph, x: ir.Value) -> MatchResult[SiblingMatMuls]:
        order = {id(n): i for i, n in enumerate(graph)}
        users = sorted({id(u.node): u.node for u in x.uses() if u.node.op_type == "MatMul" and u.idx == 0}.values(),
                       key=lambda n: order[id(n)])
        weights = [_weight(n) for n in users]
        kept = [(n, w) for n, w in zip(users, weights) if w is not None]
        if len(kept) < 2:
            return MatchResult.fail("fewer than two of its MatMuls have a constant 2-D weight")
        if len({w.shape[0] for _, w in kept}) != 1 or len({w.dtype for _, w in kept}) != 1:
            found = [(tuple(w.shape), str(w.dtype.numpy())) for _, w in kept]
            return MatchResult.fail(f"weights differ in K or dtype: {found}")
        if any(o.is_graph_output() for n, _ in kept for o in n.outputs):
            return MatchResult.fail("a MatMul output is a graph output")
        return MatchResult(SiblingMatMuls(x, [n for n, _ in kept], [int(w.shape[1]) for _, w in kept]))

    def rewrite(self, graph: ir.Graph, m: SiblingMatMuls) -> ir.Node:
        """Insert the fused MatMul and its Split before the first MatMul of ``m``, move every
        user of the old outputs to the Split's and remove the old MatMuls; returns the MatMul."""
        first = m.nodes[0]
        prefix = f"{first.name or 'MatMul'}/fused{len(m.nodes)}"
        # Concatenated when read (a save, a quantizer), never held: a 7B graph's fused gate/up
        # weights would otherwise sit in memory together (15 GB at fp32; the streaming path).
        parts = [n.inputs[1].const_value for n in m.nodes]
        shape = ir.Shape([int(parts[0].shape[0]), sum(m.widths)])
        lazy = ir.LazyTensor(lambda ps=parts: ir.Tensor(np.concatenate([p.numpy() for p in ps], axis=1)),
                             dtype=parts[0].dtype, shape=shape, name=f"{prefix}/weight")
        wv = ir.Value(name=f"{prefix}/weight", shape=shape, type=ir.TensorType(parts[0].dtype), const_value=lazy)
        graph.register_initializer(wv)
        split = ir.Value(name=f"{prefix}/split", const_value=ir.tensor(np.asarray(m.widths, np.int64)))
        graph.register_initializer(split)
        mm = ir.node("MatMul", [m.x, wv], name=f"{prefix}/MatMul")
        sp = ir.node("Split", [mm.outputs[0], split], {"axis": -1}, num_outputs=len(m.nodes), name=f"{prefix}/Split")
        graph.insert_before(first, [mm, sp])
        for old, new in zip(m.nodes, sp.outputs):
            out = old.outputs[0]
            new.type, new.shape = out.type, out.shape
            out.replace_all_uses_with(new)
            name, out.name = out.name, f"{out.name}.fused"
            new.name = name
        mm.outputs[0].type = m.nodes[0].outputs[0].type
        graph.remove(m.nodes, safe=True)
        return mm
