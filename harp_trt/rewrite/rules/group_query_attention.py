"""Rule for ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai's model builder)."""
from __future__ import annotations

from ..graph import const_array
from .base import AttentionRule
from .tracing import TraceError, describe_node, trace_projection

__all__ = ["GroupQueryAttentionRule"]


class GroupQueryAttentionRule(AttentionRule):
    """``com.microsoft::GroupQueryAttention`` (onnxruntime-genai builder): inputs (query, key,
    value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, ...);
    key/value empty means query holds packed QKV ``[q | k | v]``."""

    name = "group-query-attention"
    description = "com.microsoft GroupQueryAttention (packed or separate QKV)"

    def is_core(self, node):
        return node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"

    def packed_v(self, core):
        return len(core.inputs) < 3 or core.inputs[2] is None or not core.inputs[2].name

    def core_value_input(self, core):
        return core.inputs[2]

    def core_qk_inputs(self, core):
        return [v for v in core.inputs[:2] if v is not None]

    def core_kv_inputs(self, core):
        return [v for v in core.inputs[3:5] if v is not None]

    def core_heads(self, core):
        return core.attributes.get_int("num_heads", 0) or None, core.attributes.get_int("kv_num_heads", 0) or None

    def _packed_v(self, core):
        x, w, b, path = trace_projection(core.inputs[0], "packed QKV")
        heads, kv = self.core_heads(core)
        if not heads or not kv:
            raise TraceError(f"{describe_node(core)} lacks num_heads/kv_num_heads attributes")
        cols = tuple(w.const_value.shape)[1] if w.const_value is not None else const_array(w).shape[1]
        if cols % (heads + 2 * kv):
            raise TraceError(f"packed QKV weight {w.name} has {cols} columns, not a multiple of "
                        f"{heads} + 2 x {kv} heads")
        hd = cols // (heads + 2 * kv)
        return w, b, x, path, ((heads + kv) * hd, cols)
