"""Rule for ``ai.onnx::Attention`` (opset 23), the core harp-trt's own export writes."""
from __future__ import annotations

from .base import AttentionRule

__all__ = ["OnnxAttentionRule"]


class OnnxAttentionRule(AttentionRule):
    """``ai.onnx::Attention`` (opset 23), as torch.onnx's dynamo exporter writes SDPA: inputs
    (Q, K, V, mask, [past_key, past_value]); repeat_kv, when present, is Unsqueeze/Expand/Reshape
    on the V path."""

    name = "onnx-attention"
    description = "ai.onnx Attention (opset >= 23)"

    def is_core(self, node):
        return node.op_type == "Attention" and node.domain in ("", "ai.onnx")

    def core_value_input(self, core):
        return core.inputs[2] if len(core.inputs) > 2 else None

    def core_qk_inputs(self, core):
        return [core.inputs[0], core.inputs[1]]

    def core_kv_inputs(self, core):
        return [v for v in core.inputs[4:6] if v is not None]

    def core_heads(self, core):
        q = core.attributes.get_int("q_num_heads", 0)
        kv = core.attributes.get_int("kv_num_heads", 0)
        return (q or None), (kv or None)
