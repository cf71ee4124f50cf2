"""Graph rule: opset-23 ``Attention`` (as exported by ``harp_trt.export.export``) ->
``com.microsoft::GroupQueryAttention``, the attention kernel ORT runs fastest on CPU.

One rule of the house protocol (``harp_trt/graph_rules.py``: ``pattern`` / ``check`` /
``rewrite``), run by ``FuseGroupQueryAttentionPass`` (``passes.py``). Matched per layer::

    q = RotaryEmbedding(Transpose(Reshape(q2d)), cos, sin)
    present_k = Concat(past_k, RotaryEmbedding(Transpose(Reshape(k2d)), cos, sin))   # graph output
    present_v = Concat(past_v, Transpose(Reshape(v2d)))                                # graph output
    k, v = repeat_kv(present_k), repeat_kv(present_v)   # Unsqueeze-Expand-Reshape, or nothing
    y2d = Reshape(Transpose(Attention(q, k, v, bool_mask)))

where a family with QK-norm (Qwen3, Gemma3: ``FamilySpec.qk_norm``) has a per-head
``RMSNormalization(., gain)`` over head_dim on Q and K, before the Transpose (Qwen3) or after it
(Gemma3). The fused graph applies the same norm to the [B, S, H, D] view of q2d / k2d and packs it back
to [B, S, H*D] (onnxscript's own GQA fusion accepts a SimplifiedLayerNormalization there; the norm is
over the last axis, so both orders give the same values). Rewritten to::

    y2d, present_k, present_v = GroupQueryAttention(RotaryEmbedding(q2d), RotaryEmbedding(k2d), v2d,
                                                    past_k, past_v, seqlens_k, total_len,
                                                    attention_bias=padding_bias)

GQA applies the causal mask itself; the left-padding part of ``attention_mask`` becomes an additive
bias [B, 1, S, P+S] (0 or float32 min, finite so fully padded rows give no NaN), built once and shared
by every layer. ``seqlens_k`` is P+S-1 for every row (left padding keeps rows right-aligned). The
graph's I/O is unchanged: GQA's past/present layout is [B, kv_heads, P, head_dim] (BNSH) like the
export's, and the present outputs keep their names. A layer with a sliding window shorter than the
model's context (``FamilySpec.layer_windows``: Mistral v0.1, Gemma3's local layers) becomes GQA with
``local_window_size`` = the window (the key itself and window - 1 before it, transformers' mask;
measured exact, off by one either way the build's verification fails). An Attention node that does
not match is an error with the reason (``FuseGroupQueryAttentionPass``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import onnx_ir as ir

from harp_trt.graph_rules import GraphRule, MatchResult, RuleReport
from harp_trt.onnx_io import parse_kv_name

__all__ = ["FuseGroupQueryAttention", "GqaMatch", "MS_DOMAIN", "NO_EXPORT_META"]

MS_DOMAIN = "com.microsoft"
NO_EXPORT_META = "graph has no harp_trt.export metadata (not from export_dense); left unchanged"


@dataclass
class GqaMatch:
    attention: ir.Node
    q2d: ir.Value
    k2d: ir.Value
    v2d: ir.Value
    cos: ir.Value
    sin: ir.Value
    past_k: ir.Value
    past_v: ir.Value
    present_k: ir.Value
    present_v: ir.Value
    out2d: ir.Value
    rotary_attrs: dict[str, Any]
    layer: int
    scale: float | None            # the Attention node's, carried over
    softcap: float
    q_norm: ir.Node | None = None  # per-head RMSNormalization on Q / K (QK-norm), kept and re-packed
    k_norm: ir.Node | None = None
    window: int | None = None      # the layer's sliding window (FamilySpec.layer_windows), None: full


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    if value is None:
        return None
    node = value.producer()
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _is_bnsh_transpose(node: ir.Node | None) -> bool:
    return node is not None and list(_attr(node, "perm", [])) == [0, 2, 1, 3]


def _constant(graph: ir.Graph, name: str, array) -> ir.Value:
    """The graph's initializer ``name``, registered with ``array`` the first time it is asked for."""
    if name not in graph.initializers:
        t = ir.tensor(np.asarray(array), name=name)
        graph.register_initializer(ir.Value(name=name, const_value=t, shape=ir.Shape(t.shape),
                                            type=ir.TensorType(t.dtype)))
    return graph.initializers[name]


def _last_axis_norm(value: ir.Value | None) -> ir.Node | None:
    norm = _producer(value, "RMSNormalization")
    ok = norm is not None and _attr(norm, "axis", -1) in (-1, 3) and len(list(norm.outputs[0].uses())) == 1
    return norm if ok else None


def _split_heads(value: ir.Value | None) -> tuple[ir.Node | None, ir.Node | None]:
    """Behind a rotary's input: (the Reshape that splits heads, the per-head QK-norm or None). The norm
    is over head_dim, before the BNSH Transpose (Qwen3) or after it (Gemma3)."""
    norm = _last_axis_norm(value)
    tr = _producer(norm.inputs[0] if norm is not None else value, "Transpose")
    if not _is_bnsh_transpose(tr):
        return None, None
    inner = _last_axis_norm(tr.inputs[0]) if norm is None else None
    if inner is not None:
        return _producer(inner.inputs[0], "Reshape"), inner
    return _producer(tr.inputs[0], "Reshape"), norm


class FuseGroupQueryAttention(GraphRule[GqaMatch]):
    """``pattern`` finds the candidates, ``check`` returns the match or why there is none,
    ``rewrite`` replaces a match. ``num_heads``/``kv_heads``/``head_dim`` come from the export
    metadata; ``window_layers`` maps the layers with a real sliding window to it (converted with
    ``local_window_size``)."""

    name = "FuseGroupQueryAttention"
    description = "opset-23 Attention with the export's rotary and KV-cache Concat"
    key = "attention"
    must_match = True  # every Attention of our export fuses (sliding windows included)
    fail_hint = ("the export's attention graph has a form the rule does not know; teach it in builders/ort/gqa.py "
                 "(OrtBuildConfig.attention='onnx' keeps the opset-23 Attention)")

    def __init__(self, num_heads: int, kv_heads: int, head_dim: int, window_layers=None):
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.window_layers = dict(window_layers or {})   # layer -> window
        self._shared: dict[str, ir.Value] | None = None

    @classmethod
    def from_export_meta(cls, meta: Mapping[str, Any]) -> "FuseGroupQueryAttention | None":
        """The rule for a graph with harp-trt's export metadata (``harp_trt.onnx_io.read_export_meta``),
        None without it. Layers with a sliding window shorter than the context keep it as GQA's
        ``local_window_size``."""
        if not all(k in meta for k in ("num_heads", "kv_heads", "head_dim", "num_layers")):
            return None
        window_layers: dict[int, int] = {}
        sw, ctx = meta.get("sliding_window"), meta.get("max_position_embeddings") or 0
        if "layer_windows" in meta:  # the family's own rule (FamilySpec.layer_windows), recorded at export
            window_layers = {i: w for i, w in enumerate(meta["layer_windows"]) if w and (not ctx or w < ctx)}
        elif sw and sw < ctx:  # graphs exported before layer_windows was recorded
            types = meta.get("layer_types") or []
            window_layers = {i: sw for i in range(meta["num_layers"])
                             if not types or types[i] == "sliding_attention"}
        return cls(meta["num_heads"], meta["kv_heads"], meta["head_dim"], window_layers)

    # -- the report: the layers converted ------------------------------------------------------
    def describe(self, m: GqaMatch, added: Any) -> int:
        return m.layer

    def finish(self, model: ir.Model, report: RuleReport) -> None:
        if report.matched:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        else:
            report.skipped.setdefault("*", "no opset-23 Attention nodes (eager attention export?)")

    @classmethod
    def summary(cls, report: RuleReport) -> dict[str, Any]:
        return {"rule": cls.name, "converted_layers": report.matched, "skipped": report.skipped}

    # -- pattern / check ----------------------------------------------------------------------
    def pattern(self, graph: ir.Graph) -> list[ir.Node]:
        return [n for n in graph if n.op_type == "Attention" and n.domain == ""]

    def _kv_chain(self, value: ir.Value, rotary: bool):
        """Follow repeat_kv back to the present Concat; returns (concat node, rotary node, x2d) or a reason."""
        node = value.producer()
        if node is not None and node.op_type == "Reshape":  # repeat_kv: Unsqueeze -> Expand -> Reshape
            exp = _producer(node.inputs[0], "Expand")
            uns = _producer(exp.inputs[0], "Unsqueeze") if exp else None
            if uns is None:
                return f"{value.name}: Reshape not fed by Unsqueeze-Expand (repeat_kv)"
            node = uns.inputs[0].producer()
        if node is None or node.op_type != "Concat":
            return f"{value.name}: not the KV-cache Concat"
        past, new = node.inputs
        if not (past is not None and past.is_graph_input() and node.outputs[0].is_graph_output()):
            return f"{node.name}: Concat is not past_key_values -> present"
        rot = None
        if rotary:
            rot = _producer(new, "RotaryEmbedding")
            if rot is None or len(rot.inputs) != 3:
                return f"{node.name}: new keys do not come from RotaryEmbedding(x, cos, sin)"
            new = rot.inputs[0]
        rs, norm = _split_heads(new)
        if rs is None or (norm is not None and not rotary):
            return f"{node.name}: new K/V are not Transpose(Reshape(x)) to BNSH (K: with an optional QK-norm)"
        return node, rot, rs.inputs[0], norm

    def check(self, graph: ir.Graph, node: ir.Node) -> MatchResult[GqaMatch]:
        """The match, or the reason ``node`` cannot be converted."""
        found = self._match(node)
        return MatchResult.fail(found) if isinstance(found, str) else MatchResult(found)

    def _match(self, node: ir.Node) -> str | GqaMatch:
        if len(node.inputs) != 4 or any(v is None for v in node.inputs):
            return "Attention must have exactly (Q, K, V, mask) inputs (past handled outside)"
        if _attr(node, "is_causal", 0) != 0 or _attr(node, "qk_matmul_output_mode", 0) != 0:
            return "expects is_causal=0 with an explicit mask and no qk output"
        if len(node.outputs) != 1:
            return "Attention has present/qk outputs"
        mask = node.inputs[3]
        if mask.dtype not in (ir.DataType.BOOL, None):
            return f"mask dtype {mask.dtype} is not bool"
        q_rot = _producer(node.inputs[0], "RotaryEmbedding")
        if q_rot is None or len(q_rot.inputs) != 3:
            return "Q is not RotaryEmbedding(x, cos, sin)"
        q_rs, q_norm = _split_heads(q_rot.inputs[0])
        if q_rs is None:
            return "Q is not Transpose(Reshape(x)) to BNSH (with an optional per-head RMSNormalization)"
        k = self._kv_chain(node.inputs[1], rotary=True)
        if isinstance(k, str):
            return k
        v = self._kv_chain(node.inputs[2], rotary=False)
        if isinstance(v, str):
            return v
        (k_cat, k_rot, k2d, k_norm), (v_cat, _, v2d, _) = k, v
        if (q_norm is None) != (k_norm is None):
            return "QK-norm on one of Q and K only"
        if list(k_rot.inputs[1:]) != list(q_rot.inputs[1:]) and not self._same_cos_sin(q_rot, k_rot):
            return "Q and K use different rotary tables"
        uses = list(node.outputs[0].uses())
        out_tr = uses[0].node if len(uses) == 1 else None
        if not (out_tr is not None and out_tr.op_type == "Transpose" and _is_bnsh_transpose(out_tr)):
            return "output is not Transpose(0,2,1,3) -> Reshape"
        tr_uses = list(out_tr.outputs[0].uses())
        out_rs = tr_uses[0].node if len(tr_uses) == 1 else None
        if out_rs is None or out_rs.op_type != "Reshape":
            return "output Transpose is not followed by a Reshape to [B, S, H*D]"
        layer = _layer_of(k_cat.outputs[0].name)
        if layer is None:
            return f"cannot read the layer index from {k_cat.outputs[0].name!r}"
        rot_attrs = {a: _attr(q_rot, a) for a in ("interleaved", "rotary_embedding_dim") if a in q_rot.attributes}
        return GqaMatch(node, q_rs.inputs[0], k2d, v2d, q_rot.inputs[1], q_rot.inputs[2],
                        k_cat.inputs[0], v_cat.inputs[0], k_cat.outputs[0], v_cat.outputs[0],
                        out_rs.outputs[0], rot_attrs, layer, _attr(node, "scale"),
                        _attr(node, "softcap", 0.0) or 0.0, q_norm, k_norm, self.window_layers.get(layer))

    @staticmethod
    def _same_cos_sin(a: ir.Node, b: ir.Node) -> bool:
        """The exporter emits one Cos/Sin pair per RotaryEmbedding; same source means same table."""
        def src(v):
            p = v.producer()
            return (p.op_type, tuple(id(x) for x in p.inputs)) if p is not None else id(v)
        return all(src(x) == src(y) for x, y in zip(a.inputs[1:], b.inputs[1:]))

    # -- rewrite ------------------------------------------------------------------------------
    def _shared_inputs(self, graph: ir.Graph) -> dict[str, ir.Value]:
        """seqlens_k, total_sequence_length and the padding bias, built once at the graph's top."""
        if self._shared is not None:
            return self._shared
        by_name = {v.name: v for v in graph.inputs}
        mask, ids = by_name["attention_mask"], by_name["input_ids"]
        nodes: list[ir.Node] = []

        def add(op, inputs, **attrs):
            n = ir.node(op, inputs, attrs or None, name=f"gqa_shared/{op}_{len(nodes)}")
            nodes.append(n)
            return n.outputs[0]

        def const(name, array):
            return _constant(graph, name, array)

        mshape = add("Shape", [mask])                                   # [B, T]
        batch = add("Gather", [mshape, const("gqa_i0", np.array([0], np.int64))])
        total = add("Gather", [mshape, const("gqa_i1", np.array([1], np.int64))])
        seq = add("Shape", [ids], start=1, end=2)
        total32 = add("Cast", [total], to=ir.DataType.INT32)
        total_scalar = add("Squeeze", [total32, const("gqa_ax0", np.array([0], np.int64))])
        seqlens = add("Expand", [add("Sub", [total32, const("gqa_one32", np.array([1], np.int32))]), batch])
        is_pad = add("Equal", [mask, const("gqa_zero64", np.array(0, np.int64))])
        bias2d = add("Where", [is_pad, const("gqa_neg", np.array(np.finfo(np.float32).min, np.float32)),
                               const("gqa_zero32f", np.array(0.0, np.float32))])
        bias4d = add("Unsqueeze", [bias2d, const("gqa_ax12", np.array([1, 2], np.int64))])
        shape4 = add("Concat", [batch, const("gqa_i1b", np.array([1], np.int64)), seq, total], axis=0)
        bias = add("Expand", [bias4d, shape4])
        first = next(iter(graph))
        graph.insert_before(first, nodes)
        self._shared = {"seqlens_k": seqlens, "total": total_scalar, "bias": bias}
        return self._shared

    def _pack_shape(self, graph: ir.Graph) -> ir.Value:
        """The [0, 0, -1] Reshape target that packs [B, S, H, D] to [B, S, H*D], one per graph."""
        return _constant(graph, "gqa_pack_heads", np.array([0, 0, -1], np.int64))

    def _split_shape(self, graph: ir.Graph, heads: int) -> ir.Value:
        """The [0, 0, heads, head_dim] Reshape target that splits [B, S, H*D] into heads."""
        return _constant(graph, f"gqa_split_heads_{heads}", np.array([0, 0, heads, self.head_dim], np.int64))

    def rewrite(self, graph: ir.Graph, m: GqaMatch) -> ir.Node:
        """Insert the GroupQueryAttention node for ``m`` and move the Attention's users and the
        present outputs onto it (the old nodes are left dead); returns the new node."""
        scale, softcap = m.scale, m.softcap
        shared = self._shared_inputs(graph)
        prefix = f"gqa/layer{m.layer}"
        packs = []   # QK-norm: the normed [B, S, H, D] packed back to [B, S, H*D]
        q2d, k2d = m.q2d, m.k2d
        if m.q_norm is not None:   # the norm again, on the [B, S, H, D] view of the packed input, then packed
            flat = self._pack_shape(graph)
            for norm, x2d, w in ((m.q_norm, m.q2d, "q"), (m.k_norm, m.k2d, "k")):
                heads = self.num_heads if w == "q" else self.kv_heads
                split = ir.node("Reshape", [x2d, self._split_shape(graph, heads)], name=f"{prefix}/split_{w}")
                normed = ir.node(norm.op_type, [split.outputs[0], *norm.inputs[1:]],
                                 {k: a.value for k, a in norm.attributes.items()}, domain=norm.domain,
                                 name=f"{prefix}/{w}_norm")
                packs += [split, normed, ir.node("Reshape", [normed.outputs[0], flat], name=f"{prefix}/pack_{w}")]
            q2d, k2d = packs[2].outputs[0], packs[5].outputs[0]
        rq = ir.node("RotaryEmbedding", [q2d, m.cos, m.sin], {"num_heads": self.num_heads, **m.rotary_attrs},
                     name=f"{prefix}/rotary_q")
        rk = ir.node("RotaryEmbedding", [k2d, m.cos, m.sin], {"num_heads": self.kv_heads, **m.rotary_attrs},
                     name=f"{prefix}/rotary_k")
        attrs: dict[str, Any] = {"num_heads": self.num_heads, "kv_num_heads": self.kv_heads}
        if scale is not None:
            attrs["scale"] = float(scale)
        if softcap:
            attrs["softcap"] = float(softcap)
        if m.window is not None:   # the key itself and the window - 1 before it, as transformers' mask
            attrs["local_window_size"] = int(m.window)
        gqa = ir.node("GroupQueryAttention",
                      [rq.outputs[0], rk.outputs[0], m.v2d, m.past_k, m.past_v, shared["seqlens_k"],
                       shared["total"], None, None, None, shared["bias"]],
                      attrs, domain=MS_DOMAIN, num_outputs=3, name=f"{prefix}/GroupQueryAttention")
        graph.insert_before(m.attention, [*packs, rq, rk, gqa])
        y, pk, pv = gqa.outputs
        m.out2d.replace_all_uses_with(y)
        for old, new in ((m.present_k, pk), (m.present_v, pv)):
            name = old.name
            old.name = f"{name}.replaced"
            new.shape, new.type = old.shape, old.type
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            new.name = name
        y.shape, y.type = m.out2d.shape, m.out2d.type
        return gqa


def _layer_of(name: str) -> int | None:
    k = parse_kv_name(name)
    return k.layer if k is not None and k.direction == "present" else None
