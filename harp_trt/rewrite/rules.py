"""Graph-rewrite rules: one class per kind of attention core, each with ``pattern`` (candidate
cores for a layer), ``check`` (a structural match, or the reason it failed) and ``rewrite``.

Every rule replaces a pruned layer's attention block, from the input-norm output ``x`` to the
tensor added into the residual stream, with HARP's per-token linear map (arXiv 2507.01900,
Eq. 4-5; ``fold.py`` for the exact GQA fold)::

    h <- h + MatMul(MatMul(x, W_V) + b_V, alpha * W_O_fold) (+ alpha * b_O)
    h <- h + post_norm_{alpha * g}(MatMul(MatMul(x, W_V) + b_V, W_O_fold))   (post-attn norm, Gemma2)

and ``alpha = 0`` removes the block (the residual add becomes the identity). Q, K, rotary, the
attention core and the layer's KV-cache inputs/outputs are left dead and removed by the pass.

Names (``layers.{i}`` in node names, torch's ``pkg.torch.onnx.name_scopes``) are only used to
*locate* a layer's core when the KV-cache inputs do not; everything used to rewrite is checked
structurally: the V path is pure data movement from one constant-weight MatMul, o_proj is a
constant-weight MatMul fed only by the core, and the residual add's other input feeds ``x``."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx_ir as ir

from ..onnx_io import parse_any_kv_name
from .fold import fold_o_proj, scale_norm_gain
from .graph import ancestors, const_array, const_ndim, consumers, is_const, name_hint_matches, only_consumer

__all__ = ["AttentionMatch", "MatchResult", "AttentionRule", "OnnxAttentionRule",
           "SoftmaxAttentionRule", "GroupQueryAttentionRule", "DEFAULT_RULES", "LayerEdit", "describe"]

log = logging.getLogger(__name__)

# ops that only move data: a V path made of these keeps V's values per token and head
LAYOUT_OPS = {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Identity", "Cast", "Flatten"}
NORM_OPS = {"RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization"}
SKIP_NORM_OPS = {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}
# ops that may sit between a post-attention norm's input and its output (decomposed RMSNorm)
NORM_PIECES = NORM_OPS | {"Pow", "ReduceMean", "Add", "Sqrt", "Div", "Reciprocal", "Mul", "Cast"}


@dataclass
class AttentionMatch:
    """Everything a rule found for one layer; all values belong to the graph being rewritten."""

    layer: int
    rule: str
    locator: str                   # how the core was found: kv-input | name | order
    core: ir.Node
    x: ir.Value                    # input-norm output, read by the Q/K/V projections
    w_v: ir.Value                  # V projection weight (MatMul layout: [hidden, cols])
    v_cols: tuple[int, int] | None  # columns of w_v that are V (packed QKV), None = all
    b_v: ir.Value | None
    w_o: ir.Value                  # o_proj weight [q_dim, hidden]
    b_o: ir.Value | None
    o_node: ir.Node                # last node of o_proj (MatMul or its bias Add)
    o_out: ir.Value                # o_proj output (after its bias)
    residual_node: ir.Node         # Add (or fused Skip*Norm) that adds the block into h
    residual: ir.Value             # h, the residual stream
    post_norm: ir.Node | None      # last node of a post-attention norm between o_proj and residual
    gain_index: int | None         # input of post_norm holding its constant gain, if any
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_nodes: list[ir.Node] = field(default_factory=list)
    kv_inputs: list[ir.Value] = field(default_factory=list)
    kv_outputs: list[ir.Value] = field(default_factory=list)

    @property
    def n_rep(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class MatchResult:
    """A match, or the reason there is none (falsy)."""

    match: AttentionMatch | None = None
    reason: str = ""

    def __bool__(self) -> bool:
        return self.match is not None

    @classmethod
    def fail(cls, reason: str) -> "MatchResult":
        return cls(None, reason)


@dataclass
class LayerEdit:
    """What one rule's rewrite added (removals are counted by the pass's dead-code sweep)."""

    mode: str                      # alpha-in-o_proj | alpha-in-norm-gain | alpha-mul | removed
    nodes_added: list[str] = field(default_factory=list)
    initializers_added: list[str] = field(default_factory=list)
    params_added: int = 0


class _Fail(Exception):
    pass


def _const_weight(node: ir.Node) -> ir.Value | None:
    """B of a MatMul whose B is a 2-D constant."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    return w if is_const(w) and const_ndim(w) == 2 else None


def _is_bias_add(node: ir.Node, data: ir.Value) -> ir.Value | None:
    """If ``node`` is ``Add(data, const 1-D)`` return the constant."""
    if node.op_type != "Add" or len(node.inputs) != 2:
        return None
    other = node.inputs[1] if node.inputs[0] is data else node.inputs[0]
    return other if is_const(other) and const_ndim(other) == 1 else None


class AttentionRule:
    """Base of the rules. Subclasses say what an attention core looks like and where its Q/K/V
    inputs, output and KV-cache inputs are; the shared V/o_proj/residual tracing and the rewrite
    live here."""

    name: ClassVar[str]
    description: ClassVar[str]

    # ---- what a core looks like (subclasses) ------------------------------------------------
    def is_core(self, node: ir.Node) -> bool:
        raise NotImplementedError

    def core_value_input(self, core: ir.Node) -> ir.Value | None:
        raise NotImplementedError

    def core_qk_inputs(self, core: ir.Node) -> list[ir.Value]:
        raise NotImplementedError

    def core_heads(self, core: ir.Node) -> tuple[int | None, int | None]:
        """(num_heads, num_kv_heads) from the core's attributes, where it has them."""
        return None, None

    def packed_v(self, core: ir.Node) -> bool:
        return False

    # ---- pattern: candidate cores of a layer ------------------------------------------------
    def pattern(self, graph: ir.Graph, layer: int, num_layers: int) -> tuple[list[ir.Node], str]:
        """Candidate cores for ``layer`` and how they were located. KV-cache inputs/outputs named
        for the layer come first (structural: the core they feed), then name hints, then the
        layer-th core in topological order when the graph has exactly one core per layer."""
        cores = [n for n in graph if self.is_core(n)]
        if not cores:
            return [], "none"
        core_ids = {id(n) for n in cores}
        seeds = [v for v in graph.inputs if _kv_name(v.name, layer, "past")]
        seeds += [v for v in graph.outputs if _kv_name(v.name, layer, "present")]
        if seeds:
            hit = _forward_cores(seeds, core_ids, depth=8)
            hit += [v.producer() for v in seeds if v.producer() is not None and id(v.producer()) in core_ids]
            uniq = list({id(n): n for n in hit}.values())
            if len(uniq) == 1:
                return uniq, "kv-input"
        named = [n for n in cores if name_hint_matches(n, layer)]
        if len(named) == 1:
            return named, "name"
        if len(cores) == num_layers:
            return [cores[layer]], "order"
        return cores if len(named) == 0 else named, "ambiguous"

    # ---- check ----------------------------------------------------------------------------------
    def check(self, graph: ir.Graph, core: ir.Node, layer: int, locator: str,
              head_dim_hint: int | None = None) -> MatchResult:
        try:
            return MatchResult(self._match(graph, core, layer, locator, head_dim_hint))
        except _Fail as e:
            return MatchResult.fail(str(e))

    def _match(self, graph, core, layer, locator, head_dim_hint) -> AttentionMatch:
        # V projection: back from the core's V input through data movement only
        if self.packed_v(core):
            w_v, b_v, x, v_path, v_cols = self._packed_v(core)
        else:
            v_in = self.core_value_input(core)
            if v_in is None:
                raise _Fail(f"{_desc(core)} has no value input")
            x, w_v, b_v, v_path = _trace_projection(v_in, "V")
            v_cols = None
        w_v_shape = tuple(w_v.const_value.shape) if w_v.const_value is not None else const_array(w_v).shape
        kv_dim = (v_cols[1] - v_cols[0]) if v_cols else w_v_shape[1]
        # o_proj: forward from the core's output through data movement to a constant MatMul
        o_mm, o_path = _trace_o_proj(core)
        w_o = _const_weight(o_mm)
        q_dim, hidden = tuple(w_o.const_value.shape) if w_o.const_value is not None else const_array(w_o).shape
        if w_v_shape[0] != hidden:
            raise _Fail(f"V weight {w_v.name} has {w_v_shape[0]} rows but o_proj {w_o.name} "
                        f"writes {hidden} features")
        o_node, o_out, b_o = o_mm, o_mm.outputs[0], None
        cons = only_consumer(o_out)
        if cons is not None and (b := _is_bias_add(cons, o_out)) is not None:
            o_node, o_out, b_o = cons, cons.outputs[0], b
        residual_node, residual, post_norm, gain_index = _trace_residual(o_out)
        xs = ancestors(x, limit=48)
        if id(residual) not in xs and residual.producer() is not x.producer():
            raise _Fail(f"the add after o_proj ({_desc(residual_node)}) does not take the residual "
                        f"stream that feeds the input norm")
        num_heads, num_kv = self.core_heads(core)
        head_dim = _head_dim(q_dim, kv_dim, num_heads, num_kv, v_path, self.core_kv_inputs(core),
                             head_dim_hint)
        if q_dim % head_dim or kv_dim % head_dim or (q_dim // head_dim) % (kv_dim // head_dim):
            raise _Fail(f"head size {head_dim} does not divide q_dim {q_dim} / kv_dim {kv_dim} "
                        f"into whole KV groups")
        qk_nodes = self._qk_projections(core, x)
        if not qk_nodes and not self.packed_v(core):
            raise _Fail("found no Q/K projections reading the V projection's input")
        kv_in, kv_out = self._kv_io(graph, core, layer)
        return AttentionMatch(
            layer=layer, rule=self.name, locator=locator, core=core, x=x, w_v=w_v, v_cols=v_cols,
            b_v=b_v, w_o=w_o, b_o=b_o, o_node=o_node, o_out=o_out, residual_node=residual_node,
            residual=residual, post_norm=post_norm, gain_index=gain_index,
            num_heads=q_dim // head_dim, num_kv_heads=kv_dim // head_dim, head_dim=head_dim,
            qk_nodes=qk_nodes, kv_inputs=kv_in, kv_outputs=kv_out)

    def core_kv_inputs(self, core: ir.Node) -> list[ir.Value]:
        return []

    def _packed_v(self, core):
        raise _Fail("packed QKV is not supported by this rule")

    def _qk_projections(self, core: ir.Node, x: ir.Value) -> list[ir.Node]:
        """Constant-weight MatMuls reading ``x`` that feed the core's Q/K inputs (bounded search
        that does not go behind ``x``)."""
        found: dict[int, ir.Node] = {}
        # breadth first: rotary tables and masks hang off the Q/K paths with long chains of
        # their own; a depth-first walk would spend its budget there before reaching q_proj
        queue = deque(v for v in self.core_qk_inputs(core) if v is not None)
        seen: set[int] = set()
        visited = 0
        while queue and visited < 160:
            v = queue.popleft()
            if id(v) in seen or v is x:
                continue
            seen.add(id(v))
            node = v.producer()
            if node is None:
                continue
            visited += 1
            if _const_weight(node) is not None:
                if node.inputs[0] is x:
                    found[id(node)] = node
                continue
            queue.extend(i for i in node.inputs if i is not None)
        return list(found.values())

    def _kv_io(self, graph: ir.Graph, core: ir.Node, layer: int) -> tuple[list[ir.Value], list[ir.Value]]:
        """The layer's KV-cache graph inputs/outputs: past tensors the core reads directly or
        through the cache Concat on its K/V data path, the present tensors the core or that
        Concat produce, and any input/output named for the layer."""
        ins: list[ir.Value] = [v for v in self.core_kv_inputs(core) if v.is_graph_input()]
        outs: list[ir.Value] = [v for v in core.outputs if v.is_graph_output()]
        for start in self.core_qk_inputs(core)[1:] + [self.core_value_input(core)]:
            v = start
            for _ in range(12):
                node = v.producer() if v is not None else None
                if node is None:
                    break
                if node.op_type == "Concat":
                    ins += [r for i in node.inputs if i is not None and (r := _cache_root(i)) is not None]
                    outs += [o for o in node.outputs if o.is_graph_output()]
                    break
                if node.op_type in ("Mul", "Div") and is_const(node.inputs[1]):
                    v = node.inputs[0]  # a (split) softmax scale on K
                    continue
                if node.op_type == "Mul" and is_const(node.inputs[0]):
                    v = node.inputs[1]
                    continue
                if node.op_type not in LAYOUT_OPS | {"RotaryEmbedding"}:
                    break
                v = node.inputs[0]
        ins += [v for v in graph.inputs if _kv_name(v.name, layer, "past")]
        outs += [v for v in graph.outputs if _kv_name(v.name, layer, "present")]
        # in the graph's own I/O order (key before value for every exporter seen)
        in_pos = {id(v): k for k, v in enumerate(graph.inputs)}
        out_pos = {id(v): k for k, v in enumerate(graph.outputs)}
        ins = sorted({id(v): v for v in ins}.values(), key=lambda v: in_pos.get(id(v), len(in_pos)))
        outs = sorted({id(v): v for v in outs}.values(), key=lambda v: out_pos.get(id(v), len(out_pos)))
        return ins, outs

    # ---- rewrite ---------------------------------------------------------------------------------
    def rewrite(self, graph: ir.Graph, m: AttentionMatch, alpha: float) -> LayerEdit:
        """Replace the block; leaves the old one dead for the pass to sweep."""
        prefix = f"harp.layers.{m.layer}"
        if alpha == 0.0:
            return _remove_block(graph, m, prefix)
        edit = LayerEdit(mode="alpha-in-o_proj" if m.post_norm is None else "alpha-in-norm-gain")
        new_nodes: list[ir.Node] = []

        def init(name: str, arr: np.ndarray) -> ir.Value:
            val = ir.Value(name=_unique(graph, name), const_value=ir.tensor(arr, name=None))
            val.const_value.name = val.name
            graph.register_initializer(val)
            edit.initializers_added.append(val.name)
            edit.params_added += int(arr.size)
            return val

        w_v, b_v = m.w_v, m.b_v
        if m.v_cols is not None:  # packed QKV: keep only V's columns
            lo, hi = m.v_cols
            w_v = init(f"{prefix}.v_proj.weight", np.ascontiguousarray(const_array(m.w_v)[:, lo:hi]))
            if b_v is not None:
                b_v = init(f"{prefix}.v_proj.bias", np.ascontiguousarray(const_array(m.b_v)[lo:hi]))
        v = _node(graph, new_nodes, "MatMul", [m.x, w_v], f"{prefix}/v_proj/MatMul")
        if b_v is not None:
            v = _node(graph, new_nodes, "Add", [v, b_v], f"{prefix}/v_proj/Add")
        w_o = const_array(m.w_o)
        w_fold = fold_o_proj(w_o, m.num_heads, m.num_kv_heads, m.head_dim)
        o_scale = alpha if m.post_norm is None else 1.0
        if o_scale != 1.0:
            w_fold = (w_fold.astype(np.float64) * o_scale).astype(w_o.dtype)
        w_fold_v = init(f"{prefix}.o_proj.weight_vo_fold", np.ascontiguousarray(w_fold))
        o = _node(graph, new_nodes, "MatMul", [v, w_fold_v], f"{prefix}/o_proj/MatMul")
        if m.b_o is not None:
            b_o = const_array(m.b_o)
            if o_scale != 1.0:
                b_o = (b_o.astype(np.float64) * o_scale).astype(b_o.dtype)
            o = _node(graph, new_nodes, "Add", [o, init(f"{prefix}.o_proj.bias_scaled", b_o)], f"{prefix}/o_proj/Add")
        graph.insert_after(m.o_node, new_nodes)
        m.o_out.replace_all_uses_with(o)
        if m.post_norm is not None and alpha != 1.0:
            if m.gain_index is not None:
                g = m.post_norm.inputs[m.gain_index]
                m.post_norm.replace_input_with(
                    m.gain_index, init(f"{prefix}.post_attention_norm.gain_alpha",
                                       scale_norm_gain(const_array(g), alpha)))
                if m.post_norm.op_type == "LayerNormalization" and len(m.post_norm.inputs) > 2 \
                        and m.post_norm.inputs[2] is not None:
                    bias = m.post_norm.inputs[2]
                    m.post_norm.replace_input_with(
                        2, init(f"{prefix}.post_attention_norm.bias_alpha", scale_norm_gain(const_array(bias), alpha)))
            else:  # no constant gain to fold into: scale the norm's output
                edit.mode = "alpha-mul"
                out = m.post_norm.outputs[0]
                a = init(f"{prefix}.alpha", np.asarray(alpha, dtype=const_array(m.w_o).dtype))
                mul = ir.node("Mul", [out, a], name=f"{prefix}/alpha/Mul")
                mul.outputs[0].name = _unique(graph, f"{prefix}/alpha/Mul_output_0")
                graph.insert_after(m.post_norm, [mul])
                m.residual_node.replace_input_with(list(m.residual_node.inputs).index(out), mul.outputs[0])
                new_nodes.append(mul)
        edit.nodes_added = [n.name for n in new_nodes]
        return edit


# ---- the rules ------------------------------------------------------------------------------------
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
    return p if kept is p and _const_like(other) else None


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
        x, w, b, path = _trace_projection(core.inputs[0], "packed QKV")
        heads, kv = self.core_heads(core)
        if not heads or not kv:
            raise _Fail(f"{_desc(core)} lacks num_heads/kv_num_heads attributes")
        cols = tuple(w.const_value.shape)[1] if w.const_value is not None else const_array(w).shape[1]
        if cols % (heads + 2 * kv):
            raise _Fail(f"packed QKV weight {w.name} has {cols} columns, not a multiple of "
                        f"{heads} + 2 x {kv} heads")
        hd = cols // (heads + 2 * kv)
        return w, b, x, path, ((heads + kv) * hd, cols)


DEFAULT_RULES: tuple[AttentionRule, ...] = (OnnxAttentionRule(), GroupQueryAttentionRule(), SoftmaxAttentionRule())


# ---- tracing helpers -----------------------------------------------------------------------------
def _desc(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node"


def _kv_name(name: str | None, layer: int, kind: str) -> bool:
    k = parse_any_kv_name(name)
    return k is not None and k.layer == layer and k.direction == kind


def _cache_root(v: ir.Value) -> ir.Value | None:
    """The graph input a KV-cache operand comes from (directly, or sliced to a sliding window)."""
    for _ in range(4):
        if v.is_graph_input():
            return v
        node = v.producer()
        if node is None or node.op_type not in {"Slice", "Identity", "Cast", "Reshape", "Transpose"}:
            return None
        v = node.inputs[0]
    return v if v.is_graph_input() else None


def _forward_cores(seeds: list[ir.Value], core_ids: set[int], depth: int) -> list[ir.Node]:
    hits, frontier, seen = [], list(seeds), set()
    for _ in range(depth):
        nxt = []
        for v in frontier:
            for n in consumers(v):
                if id(n) in seen:
                    continue
                seen.add(id(n))
                if id(n) in core_ids:
                    hits.append(n)
                    continue
                if n.op_type in LAYOUT_OPS | {"Concat", "Slice"}:  # the cache's data path, not Shape reads
                    nxt.extend(n.outputs)
        frontier = nxt
    return hits


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


def _trace_projection(value: ir.Value, what: str) -> tuple[ir.Value, ir.Value, ir.Value | None, list[ir.Node]]:
    """Back from a core input through data movement (and the past-cache Concat) to
    ``MatMul(x, W)`` [+ bias]. Returns (x, W, bias, path)."""
    v, path, bias = value, [], None
    for _ in range(16):
        node = v.producer()
        if node is None:
            raise _Fail(f"{what} path reaches graph input {v.name!r} without a projection")
        path.append(node)
        if _const_weight(node) is not None:
            return node.inputs[0], node.inputs[1], bias, path
        if node.op_type == "Add":
            data = [i for i in node.inputs if i is not None and not is_const(i)]
            cst = [i for i in node.inputs if i is not None and is_const(i)]
            prod = data[0].producer() if len(data) == 1 else None
            if bias is None and len(cst) == 1 and const_ndim(cst[0]) == 1 and prod is not None \
                    and _const_weight(prod) is not None:
                bias, v = cst[0], data[0]
                continue
            raise _Fail(f"{what} path passes through {_desc(node)} that is not a projection bias")
        if node.op_type == "Concat":
            data = [i for i in node.inputs if i is not None and not is_const(i) and _cache_root(i) is None]
            if len(data) != 1:
                raise _Fail(f"{what} path meets {_desc(node)} with {len(data)} computed inputs; "
                            f"expected a KV-cache concat with one")
            v = data[0]
            continue
        if node.op_type in LAYOUT_OPS and node.domain in ("", "ai.onnx"):
            v = node.inputs[0]
            continue
        raise _Fail(f"{what} path passes through {_desc(node)}; only data movement "
                    f"({', '.join(sorted(LAYOUT_OPS))}, Concat) may sit between v_proj and attention")
    raise _Fail(f"{what} path is longer than 16 nodes")


def _trace_o_proj(core: ir.Node) -> tuple[ir.Node, list[ir.Node]]:
    v, path = core.outputs[0], []
    for _ in range(8):
        node = only_consumer(v)
        if node is None:
            raise _Fail(f"attention output {v.name!r} has {len(consumers(v))} consumers; "
                        f"expected one path to o_proj")
        path.append(node)
        if _const_weight(node) is not None and node.inputs[0] is v:
            return node, path
        if node.op_type in LAYOUT_OPS:
            v = node.outputs[0]
            continue
        raise _Fail(f"attention output reaches {_desc(node)} before any constant-weight MatMul (o_proj)")
    raise _Fail("no o_proj within 8 nodes of the attention output")


def _trace_residual(o_out: ir.Value) -> tuple[ir.Node, ir.Value, ir.Node | None, int | None]:
    """Find the node adding the block into the residual stream. Returns
    (residual node, residual value h, post-norm last node or None, gain input index or None)."""
    cons = consumers(o_out)
    if len(cons) == 1 and not o_out.is_graph_output():
        n = cons[0]
        if n.op_type == "Add" and len(n.inputs) == 2:
            other = n.inputs[1] if n.inputs[0] is o_out else n.inputs[0]
            if not is_const(other):
                return n, other, None, None
        if n.op_type in SKIP_NORM_OPS and o_out in list(n.inputs[:2]):
            other = n.inputs[1] if n.inputs[0] is o_out else n.inputs[0]
            return n, other, None, None
    # a post-attention norm sits in between: collect its nodes until an Add joins h
    inside: set[int] = {id(o_out)}
    chain: list[ir.Node] = []
    frontier = [o_out]
    while frontier and len(chain) < 16:
        nxt = []
        for v in frontier:
            for n in consumers(v):
                if n in chain:
                    continue
                ins = [i for i in n.inputs if i is not None]
                outside = [i for i in ins if id(i) not in inside and not _const_like(i)]
                if not outside:
                    if n.op_type not in NORM_PIECES:
                        raise _Fail(f"o_proj output reaches {_desc(n)}, neither a residual add nor "
                                    f"part of a post-attention norm")
                    chain.append(n)
                    inside.update(id(o) for o in n.outputs)
                    nxt.extend(n.outputs)
                    continue
                if n.op_type == "Add" and len(ins) == 2 and len(outside) == 1:
                    mine = ins[0] if outside[0] is ins[1] else ins[1]
                    last = mine.producer()
                    if last is None or last not in chain:
                        raise _Fail(f"o_proj output joins {_desc(n)} before any post-attention norm")
                    _check_closed(chain, last)
                    return n, outside[0], last, _gain_index(last)
                if n.op_type not in NORM_PIECES:
                    raise _Fail(f"o_proj output reaches {_desc(n)}, neither a residual add nor part "
                                f"of a post-attention norm")
                # a norm node also reading a value the chain has not reached yet: revisit then
        frontier = nxt
    raise _Fail("no residual add found after o_proj (looked 16 nodes ahead)")


def _const_like(v: ir.Value, depth: int = 4) -> bool:
    """A constant, or computed from constants only (e.g. a gain ``1 + w`` built at run time)."""
    if is_const(v):
        return True
    node = v.producer()
    if node is None or depth == 0 or v.is_graph_input():
        return False
    return all(i is None or _const_like(i, depth - 1) for i in node.inputs)


def _check_closed(chain: list[ir.Node], last: ir.Node) -> None:
    """Every value the post-norm computes is used only inside it (else removing it is unsafe)."""
    for n in chain:
        for out in n.outputs:
            if out is last.outputs[0]:
                continue
            for c in consumers(out):
                if c not in chain:
                    raise _Fail(f"post-attention norm value {out.name!r} escapes to {_desc(c)}")


def _gain_index(node: ir.Node) -> int | None:
    if node.op_type in NORM_OPS and len(node.inputs) > 1 and is_const(node.inputs[1]):
        return 1
    if node.op_type == "Mul":
        for i, v in enumerate(node.inputs):
            if is_const(v) and const_array(v).ndim <= 1:
                return i
    return None


def _head_dim(q_dim: int, kv_dim: int, num_heads: int | None, num_kv: int | None,
              v_path: list[ir.Node], kv_inputs: list[ir.Value], hint: int | None) -> int:
    if num_heads:
        return q_dim // num_heads
    if num_kv:
        return kv_dim // num_kv
    if q_dim == kv_dim:
        return q_dim if not hint else hint  # one KV head per query head: the fold is the identity
    cands: list[int] = []
    for v in kv_inputs:
        if v.shape is not None and len(v.shape) == 4 and isinstance(v.shape[3], int):
            cands.append(v.shape[3])
    for node in v_path:
        for out in node.outputs:
            if out.shape is not None and len(out.shape) == 4 and isinstance(out.shape[3], int):
                cands.append(out.shape[3])
        if node.op_type == "Reshape":
            shape = const_array(node.inputs[1])
            if shape is not None and shape.ndim == 1 and len(shape) == 4 and shape[-1] > 0:
                cands.append(int(shape[-1]))
    if hint:
        cands.append(int(hint))
    for c in cands:
        if c > 0 and kv_dim % c == 0 and q_dim % c == 0:
            return c
    raise _Fail(f"cannot tell the head size (q_dim {q_dim}, kv_dim {kv_dim}): no head-count "
                f"attributes, static KV shapes or constant reshapes on the V path")


def _unique(graph: ir.Graph, name: str) -> str:
    taken = graph.meta.setdefault("harp_names", None)
    if taken is None:
        taken = {v.name for n in graph for v in n.outputs} | set(graph.initializers) | \
            {v.name for v in graph.inputs}
        graph.meta["harp_names"] = taken
    base, k = name, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _node(graph: ir.Graph, acc: list[ir.Node], op: str, inputs: list[ir.Value], name: str) -> ir.Value:
    n = ir.node(op, inputs, name=name)
    n.outputs[0].name = _unique(graph, f"{name}_output_0")
    acc.append(n)
    return n.outputs[0]


def _remove_block(graph: ir.Graph, m: AttentionMatch, prefix: str) -> LayerEdit:
    """alpha = 0: the residual node stops adding anything (HARP with alpha_l = 0)."""
    n = m.residual_node
    edit = LayerEdit(mode="removed")
    if n.op_type == "Add":
        out = n.outputs[0]
        if out.is_graph_output():
            ident = ir.node("Identity", [m.residual], name=f"{prefix}/residual/Identity")
            graph.insert_after(n, [ident])
            out.replace_all_uses_with(ident.outputs[0], replace_graph_outputs=True)
            edit.nodes_added.append(ident.name)
        else:
            out.replace_all_uses_with(m.residual)
        return edit
    # fused Skip*Norm: out0 = norm(h + block), out3 = h + block  ->  norm(h), h
    eps = n.attributes.get_float("epsilon", 1e-5)
    opset = graph.opset_imports.get("", 0)
    if n.op_type == "SkipSimplifiedLayerNormalization":
        op, domain, ins = ("RMSNormalization", "", [m.residual, n.inputs[2]]) if opset >= 23 else \
            ("SimplifiedLayerNormalization", "", [m.residual, n.inputs[2]])
    else:
        op, domain = "LayerNormalization", ""
        ins = [m.residual, n.inputs[2]] + ([n.inputs[3]] if len(n.inputs) > 3 and n.inputs[3] is not None else [])
    norm = ir.node(op, ins, attributes={"epsilon": eps, "axis": -1}, domain=domain,
                   name=f"{prefix}/residual/{op}")
    norm.outputs[0].name = _unique(graph, f"{prefix}/residual/{op}_output_0")
    graph.insert_after(n, [norm])
    n.outputs[0].replace_all_uses_with(norm.outputs[0], replace_graph_outputs=True)
    if len(n.outputs) > 3 and n.outputs[3] is not None:
        n.outputs[3].replace_all_uses_with(m.residual)
    edit.nodes_added.append(norm.name)
    return edit


def describe(m: AttentionMatch) -> dict[str, Any]:
    return {"rule": m.rule, "locator": m.locator, "core": m.core.name, "x": m.x.name,
            "v_weight": m.w_v.name, "v_bias": m.b_v.name if m.b_v is not None else None,
            "o_weight": m.w_o.name, "o_bias": m.b_o.name if m.b_o is not None else None,
            "post_norm": m.post_norm.name if m.post_norm is not None else None,
            "heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "qk_projections": [n.name for n in m.qk_nodes]}
