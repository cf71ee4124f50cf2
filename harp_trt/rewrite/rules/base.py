"""What every attention rule shares: the match it returns (``AttentionMatch``), the record of
what its rewrite added (``LayerEdit``) and ``AttentionRule``, whose subclasses only say what their
attention core looks like. The V path, o_proj, the residual add and the KV-cache I/O are traced
here (``tracing.py``), and the rewrite is the same for every form: HARP Eq. 4-5 with the GQA fold
(``harp_trt/fold.py``)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Mapping

import numpy as np
import onnx_ir as ir

from ...fold import fold_o_proj
from ...graph_rules import GraphRule, MatchResult
from ..fold import scale_norm_gain
from ..graph import ancestors, const_array, is_const, name_hint_matches, only_consumer
from .edit import add_node, remove_block, unique_name
from .tracing import (LAYOUT_OPS, TraceError, cache_root, const_weight, describe_node, forward_cores, infer_head_dim,
                      is_bias_add, is_kv_name, trace_o_proj, trace_projection, trace_residual)

__all__ = ["AttentionMatch", "MatchResult", "LayerEdit", "AttentionRule", "describe"]


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
class LayerEdit:
    """What one rule's rewrite added (removals are counted by the pass's dead-code sweep)."""

    mode: str                      # alpha-in-o_proj | alpha-in-norm-gain | alpha-mul | removed | fitted-rrr | fitted-lmmse
    nodes_added: list[str] = field(default_factory=list)
    initializers_added: list[str] = field(default_factory=list)
    params_added: int = 0


class AttentionRule(GraphRule[AttentionMatch]):
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
        seeds = [v for v in graph.inputs if is_kv_name(v.name, layer, "past")]
        seeds += [v for v in graph.outputs if is_kv_name(v.name, layer, "present")]
        if seeds:
            hit = forward_cores(seeds, core_ids, depth=8)
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
        except TraceError as e:
            return MatchResult.fail(str(e))

    def _match(self, graph, core, layer, locator, head_dim_hint) -> AttentionMatch:
        # V projection: back from the core's V input through data movement only
        if self.packed_v(core):
            w_v, b_v, x, v_path, v_cols = self._packed_v(core)
        else:
            v_in = self.core_value_input(core)
            if v_in is None:
                raise TraceError(f"{describe_node(core)} has no value input")
            x, w_v, b_v, v_path = trace_projection(v_in, "V")
            v_cols = None
        w_v_shape = tuple(w_v.const_value.shape) if w_v.const_value is not None else const_array(w_v).shape
        kv_dim = (v_cols[1] - v_cols[0]) if v_cols else w_v_shape[1]
        # o_proj: forward from the core's output through data movement to a constant MatMul
        o_mm, o_path = trace_o_proj(core)
        w_o = const_weight(o_mm)
        q_dim, hidden = tuple(w_o.const_value.shape) if w_o.const_value is not None else const_array(w_o).shape
        if w_v_shape[0] != hidden:
            raise TraceError(f"V weight {w_v.name} has {w_v_shape[0]} rows but o_proj {w_o.name} "
                        f"writes {hidden} features")
        o_node, o_out, b_o = o_mm, o_mm.outputs[0], None
        cons = only_consumer(o_out)
        if cons is not None and (b := is_bias_add(cons, o_out)) is not None:
            o_node, o_out, b_o = cons, cons.outputs[0], b
        residual_node, residual, post_norm, gain_index = trace_residual(o_out)
        xs = ancestors(x, limit=48)
        if id(residual) not in xs and residual.producer() is not x.producer():
            raise TraceError(f"the add after o_proj ({describe_node(residual_node)}) does not take the residual "
                        f"stream that feeds the input norm")
        num_heads, num_kv = self.core_heads(core)
        head_dim = infer_head_dim(q_dim, kv_dim, num_heads, num_kv, v_path, self.core_kv_inputs(core),
                             head_dim_hint)
        if q_dim % head_dim or kv_dim % head_dim or (q_dim // head_dim) % (kv_dim // head_dim):
            raise TraceError(f"head size {head_dim} does not divide q_dim {q_dim} / kv_dim {kv_dim} "
                        f"into whole KV groups")
        qk_nodes = self._qk_projections(core, x)
        if not qk_nodes and not self.packed_v(core):
            raise TraceError("found no Q/K projections reading the V projection's input")
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
        raise TraceError("packed QKV is not supported by this rule")

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
            if const_weight(node) is not None:
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
                    ins += [r for i in node.inputs if i is not None and (r := cache_root(i)) is not None]
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
        ins += [v for v in graph.inputs if is_kv_name(v.name, layer, "past")]
        outs += [v for v in graph.outputs if is_kv_name(v.name, layer, "present")]
        # in the graph's own I/O order (key before value for every exporter seen)
        in_pos = {id(v): k for k, v in enumerate(graph.inputs)}
        out_pos = {id(v): k for k, v in enumerate(graph.outputs)}
        ins = sorted({id(v): v for v in ins}.values(), key=lambda v: in_pos.get(id(v), len(in_pos)))
        outs = sorted({id(v): v for v in outs}.values(), key=lambda v: out_pos.get(id(v), len(out_pos)))
        return ins, outs

    # ---- rewrite ---------------------------------------------------------------------------------
    def rewrite(self, graph: ir.Graph, m: AttentionMatch, alpha: float,
                fitted: Mapping[str, np.ndarray] | None = None) -> LayerEdit:
        """Replace the block; leaves the old one dead for the pass to sweep. ``fitted`` (a fitted
        map, ``calib/fit.py``, at alpha 1): ``rrr``'s checkpoint-layout ``v`` [kv_dim, hidden], ``o``
        [hidden, heads * head_dim], optional ``vb`` take the place of the layer's own V and O weights
        and biases (the same two GEMMs); ``lmmse``'s ``w`` [hidden, hidden] and ``b`` [hidden] make
        the block one GEMM and a bias Add (:meth:`_rewrite_linear`)."""
        prefix = f"harp.layers.{m.layer}"
        if alpha == 0.0:
            return LayerEdit(mode="removed", nodes_added=remove_block(graph, m.residual_node, m.residual, prefix))
        if fitted is not None and "w" in fitted:
            return self._rewrite_linear(graph, m, fitted, prefix)
        edit = LayerEdit(mode="alpha-in-o_proj" if m.post_norm is None else "alpha-in-norm-gain")
        if fitted is not None:
            edit.mode = "fitted-rrr"
        new_nodes: list[ir.Node] = []
        init = partial(_add_initializer, graph, edit)
        w_v, b_v = m.w_v, m.b_v
        w_o = const_array(m.w_o)
        if fitted is not None:
            w_v = init(f"{prefix}.v_proj.weight_fitted", np.ascontiguousarray(fitted["v"].T.astype(w_o.dtype)))
            b_v = init(f"{prefix}.v_proj.bias_fitted", fitted["vb"].astype(w_o.dtype)) if "vb" in fitted else None
            w_o = np.ascontiguousarray(fitted["o"].T.astype(w_o.dtype))
        elif m.v_cols is not None:  # packed QKV: keep only V's columns
            lo, hi = m.v_cols
            w_v = init(f"{prefix}.v_proj.weight", np.ascontiguousarray(const_array(m.w_v)[:, lo:hi]))
            if b_v is not None:
                b_v = init(f"{prefix}.v_proj.bias", np.ascontiguousarray(const_array(m.b_v)[lo:hi]))
        v = add_node(graph, new_nodes, "MatMul", [m.x, w_v], f"{prefix}/v_proj/MatMul")
        if b_v is not None:
            v = add_node(graph, new_nodes, "Add", [v, b_v], f"{prefix}/v_proj/Add")
        w_fold = fold_o_proj(w_o, m.num_heads, m.num_kv_heads, m.head_dim)
        o_scale = alpha if m.post_norm is None else 1.0
        if o_scale != 1.0:
            w_fold = (w_fold.astype(np.float64) * o_scale).astype(w_o.dtype)
        w_fold_v = init(f"{prefix}.o_proj.weight_vo_fold", np.ascontiguousarray(w_fold))
        o = add_node(graph, new_nodes, "MatMul", [v, w_fold_v], f"{prefix}/o_proj/MatMul")
        if m.b_o is not None and fitted is None:  # a fitted map was fitted to the whole output, o bias included
            b_o = const_array(m.b_o)
            if o_scale != 1.0:
                b_o = (b_o.astype(np.float64) * o_scale).astype(b_o.dtype)
            o = add_node(graph, new_nodes, "Add", [o, init(f"{prefix}.o_proj.bias_scaled", b_o)], f"{prefix}/o_proj/Add")
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
                mul.outputs[0].name = unique_name(graph, f"{prefix}/alpha/Mul_output_0")
                graph.insert_after(m.post_norm, [mul])
                m.residual_node.replace_input_with(list(m.residual_node.inputs).index(out), mul.outputs[0])
                new_nodes.append(mul)
        edit.nodes_added = [n.name for n in new_nodes]
        return edit


    def _rewrite_linear(self, graph: ir.Graph, m: AttentionMatch, fitted: Mapping[str, np.ndarray],
                        prefix: str) -> LayerEdit:
        """``lmmse`` (NBL, arXiv 2505.21077): the block's output is ``x W^T + b``, one hidden x hidden
        GEMM of the normed input ``x`` and a bias, where HARP has V.O (a post-attention norm, Gemma2's,
        still follows it, as ``HarpAttention.harp_linear`` does)."""
        edit = LayerEdit(mode="fitted-lmmse")
        dtype = const_array(m.w_o).dtype
        init = partial(_add_initializer, graph, edit)
        new_nodes: list[ir.Node] = []
        w = init(f"{prefix}.harp_linear.weight", np.ascontiguousarray(fitted["w"].T.astype(dtype)))
        out = add_node(graph, new_nodes, "MatMul", [m.x, w], f"{prefix}/harp_linear/MatMul")
        if "b" in fitted:
            b = init(f"{prefix}.harp_linear.bias", np.ascontiguousarray(fitted["b"].astype(dtype)))
            out = add_node(graph, new_nodes, "Add", [out, b], f"{prefix}/harp_linear/Add")
        graph.insert_after(m.o_node, new_nodes)
        m.o_out.replace_all_uses_with(out)
        edit.nodes_added = [n.name for n in new_nodes]
        return edit


def _add_initializer(graph: ir.Graph, edit: LayerEdit, name: str, arr: np.ndarray) -> ir.Value:
    """``arr`` as a new initializer of ``graph`` (a unique name from ``name``), counted in ``edit``."""
    val = ir.Value(name=unique_name(graph, name), const_value=ir.tensor(arr, name=None))
    val.const_value.name = val.name
    graph.register_initializer(val)
    edit.initializers_added.append(val.name)
    edit.params_added += int(arr.size)
    return val


def describe(m: AttentionMatch) -> dict[str, Any]:
    return {"rule": m.rule, "locator": m.locator, "core": m.core.name, "x": m.x.name,
            "v_weight": m.w_v.name, "v_bias": m.b_v.name if m.b_v is not None else None,
            "o_weight": m.w_o.name, "o_bias": m.b_o.name if m.b_o is not None else None,
            "post_norm": m.post_norm.name if m.post_norm is not None else None,
            "heads": m.num_heads, "kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
            "qk_projections": [n.name for n in m.qk_nodes]}
