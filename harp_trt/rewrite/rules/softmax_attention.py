"""Rule for unfused attention, ``MatMul(Softmax(QK^T), V)`` (optimum, legacy exporters, eager
attention)."""
from __future__ import annotations

import onnx_ir as ir

from ..graph import is_const
from .base import AttentionRule
from .tracing import const_like

__all__ = ["SoftmaxAttentionRule"]


class SoftmaxAttentionRule(AttentionRule):
    """Unfused attention ``MatMul(P, V)`` with ``P = Softmax(S)``, as optimum and legacy exporters
    write it and as torch.onnx writes eager attention (Gemma2's soft-capping). The pattern, with
    optional nodes in brackets and ``{a, b}`` for inputs in either order::

        S = [Where(mask, -inf, .)] / [Add{., mask}] / [soft-cap] / [Mul|Div{., scale}]
              ( MatMul( [Mul{Q, sqrt(scale)}], [Mul{K^T, sqrt(scale)}] ) )
        P = [Cast] [Where(IsNaN(P'), 0, P') | Where(Not(IsNaN(P')), P', 0)] Softmax(S)
        core = MatMul(P, V)

    optimum-onnx 0.1.0 (torch SDPA decomposed, transformers 4.57) splits the softmax scale over Q
    and K (``sqrt(scale)`` on each) and guards fully masked rows with ``IsNaN``/``Where`` after
    the softmax; its constants are ``Constant`` nodes, not initializers."""

    name = "softmax-attention"
    description = "MatMul(Softmax(QK^T), V)"

    def is_core(self, node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            return False
        return self._softmax(node) is not None and not is_const(node.inputs[1])

    @staticmethod
    def _softmax(node):
        v = node.inputs[0]
        for _ in range(6):
            p = v.producer() if v is not None else None
            if p is None:
                return None
            if p.op_type == "Softmax":
                return p
            if p.op_type in ("Cast", "Identity"):
                v = p.inputs[0]
                continue
            guarded = _nan_guarded(p)
            if guarded is None:
                return None
            v = guarded
        return None

    def core_value_input(self, core):
        return core.inputs[1]

    def core_qk_inputs(self, core):
        # back from the softmax through masking/scaling/soft-capping to MatMul(Q, K^T)
        v = self._softmax(core).inputs[0]
        for _ in range(12):
            p = v.producer()
            if p is None:
                break
            if p.op_type == "MatMul" and not is_const(p.inputs[1]):
                return [p.inputs[0], p.inputs[1]]
            data = [i for i in p.inputs if i is not None and not is_const(i) and not i.is_graph_input()]
            if not data:
                break
            # the score path is the input that itself comes from a MatMul chain (not the mask)
            v = max(data, key=lambda i: _depth_to_matmul(i))
        return []


def _nan_guarded(node: ir.Node) -> ir.Value | None:
    """``p`` if ``node`` is ``Where(IsNaN(p), c, p)`` or ``Where(Not(IsNaN(p)), p, c)`` with a
    constant ``c`` (the guard exporters put after a softmax over fully masked rows), else None."""
    if node.op_type != "Where" or len(node.inputs) != 3 or node.inputs[0] is None:
        return None
    cond, a, b = node.inputs
    c = cond.producer()
    negated = c is not None and c.op_type == "Not"
    if negated:
        c = c.inputs[0].producer()
    if c is None or c.op_type != "IsNaN":
        return None
    p = c.inputs[0]
    kept, other = (b, a) if not negated else (a, b)
    return p if kept is p and const_like(other) else None


def _depth_to_matmul(v: ir.Value, limit: int = 8) -> int:
    """Higher for the input that leads (backwards) to a MatMul of two activations soonest."""
    for d in range(limit):
        p = v.producer()
        if p is None:
            return -1
        if p.op_type == "MatMul" and not is_const(p.inputs[1]):
            return limit - d
        data = [i for i in p.inputs if i is not None and not is_const(i)]
        if not data:
            return -1
        v = data[0]
    return -1
