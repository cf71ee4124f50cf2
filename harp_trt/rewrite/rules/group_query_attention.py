"""Rule for ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai's model builder)."""
from __future__ import annotations

from ..graph import const_array
from .base import AttentionRule
from .tracing import LAYOUT_OPS, TraceError, describe_node, trace_projection

__all__ = ["GroupQueryAttentionRule"]


class GroupQueryAttentionRule(AttentionRule):
    """``com.microsoft::GroupQueryAttention`` (onnxruntime-genai builder): inputs (query, key,
    value, past_key, past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache, ...);
    key/value empty means query holds packed QKV ``[q | k | v]``; a value that is one output of a
    ``Split`` of such a packed projection (the builder's QK-norm families, Qwen3: the split Q and K go
    through their norms first) is V's columns of the packed weight too."""

    name = "group-query-attention"
    description = "com.microsoft GroupQueryAttention (packed or separate QKV)"

    def is_core(self, node):
        return node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft"

    def packed_v(self, core):
        return (len(core.inputs) < 3 or core.inputs[2] is None or not core.inputs[2].name
                or self._split_of(core) is not None)

    @staticmethod
    def _split_of(core):
        """(Split node, V's output index) when the value input is one output of a Split, else None."""
        v = core.inputs[2] if len(core.inputs) > 2 else None
        for _ in range(8):
            node = v.producer() if v is not None else None
            if node is None:
                return None
            if node.op_type == "Split" and node.domain in ("", "ai.onnx"):
                return node, next(i for i, o in enumerate(node.outputs) if o is v)
            if node.op_type not in LAYOUT_OPS:
                return None
            v = node.inputs[0]
        return None

    def core_value_input(self, core):
        return core.inputs[2]

    def core_qk_inputs(self, core):
        return [v for v in core.inputs[:2] if v is not None]

    def core_kv_inputs(self, core):
        return [v for v in core.inputs[3:5] if v is not None]

    def core_heads(self, core):
        return core.attributes.get_int("num_heads", 0) or None, core.attributes.get_int("kv_num_heads", 0) or None

    def _packed_v(self, core):
        split = self._split_of(core)
        if split is not None:
            return self._split_v(*split)
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

    @staticmethod
    def _split_v(split, index):
        """V's columns of a packed projection read through ``Split`` (sizes from its input or attribute)."""
        axis = split.attributes.get_int("axis", 0)
        sizes = const_array(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
        if sizes is None and split.attributes.get("split") is not None:
            sizes = split.attributes.get_ints("split")
        x, w, b, path = trace_projection(split.inputs[0], "packed QKV")
        cols = tuple(w.const_value.shape)[1] if w.const_value is not None else const_array(w).shape[1]
        if sizes is None or axis not in (-1, 2) or sum(int(n) for n in sizes) != cols:
            raise TraceError(f"{describe_node(split)} does not split the packed weight {w.name}'s {cols} "
                             f"columns along the last axis by constant sizes")
        lo = sum(int(n) for n in sizes[:index])
        return w, b, x, [split, *path], (lo, lo + int(sizes[index]))
