"""Structural tracing shared by the attention rules: from an attention core back to the V
projection, forward to o_proj and the residual add, and the KV-cache inputs around it. Each trace
follows data movement only and raises ``TraceError`` with the reason when the graph leaves the
shape a rule can rewrite."""
from __future__ import annotations

import onnx_ir as ir

from ...onnx_io import parse_any_kv_name
from ..graph import const_array, const_ndim, consumers, is_const, only_consumer

__all__ = ["LAYOUT_OPS", "NORM_OPS", "SKIP_NORM_OPS", "NORM_PIECES", "TraceError", "const_weight", "is_bias_add",
           "describe_node", "is_kv_name", "cache_root", "forward_cores", "trace_projection", "trace_o_proj",
           "trace_residual", "const_like", "infer_head_dim"]

# ops that only move data: a V path made of these keeps V's values per token and head
LAYOUT_OPS = {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Identity", "Cast", "Flatten"}
NORM_OPS = {"RMSNormalization", "SimplifiedLayerNormalization", "LayerNormalization"}
SKIP_NORM_OPS = {"SkipSimplifiedLayerNormalization", "SkipLayerNormalization"}
# ops that may sit between a post-attention norm's input and its output (decomposed RMSNorm)
NORM_PIECES = NORM_OPS | {"Pow", "ReduceMean", "Add", "Sqrt", "Div", "Reciprocal", "Mul", "Cast"}


class TraceError(Exception):
    """A trace left the shape a rule can rewrite; the message says where (a rule's ``check``
    turns it into a failed ``MatchResult``)."""


def const_weight(node: ir.Node) -> ir.Value | None:
    """B of a MatMul whose B is a 2-D constant."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    w = node.inputs[1]
    return w if is_const(w) and const_ndim(w) == 2 else None


def is_bias_add(node: ir.Node, data: ir.Value) -> ir.Value | None:
    """If ``node`` is ``Add(data, const 1-D)`` return the constant."""
    if node.op_type != "Add" or len(node.inputs) != 2:
        return None
    other = node.inputs[1] if node.inputs[0] is data else node.inputs[0]
    return other if is_const(other) and const_ndim(other) == 1 else None


def describe_node(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node"


def is_kv_name(name: str | None, layer: int, kind: str) -> bool:
    k = parse_any_kv_name(name)
    return k is not None and k.layer == layer and k.direction == kind


def cache_root(v: ir.Value) -> ir.Value | None:
    """The graph input a KV-cache operand comes from (directly, or sliced to a sliding window)."""
    for _ in range(4):
        if v.is_graph_input():
            return v
        node = v.producer()
        if node is None or node.op_type not in {"Slice", "Identity", "Cast", "Reshape", "Transpose"}:
            return None
        v = node.inputs[0]
    return v if v.is_graph_input() else None


def forward_cores(seeds: list[ir.Value], core_ids: set[int], depth: int) -> list[ir.Node]:
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


def trace_projection(value: ir.Value, what: str) -> tuple[ir.Value, ir.Value, ir.Value | None, list[ir.Node]]:
    """Back from a core input through data movement (and the past-cache Concat) to
    ``MatMul(x, W)`` [+ bias]. Returns (x, W, bias, path)."""
    v, path, bias = value, [], None
    for _ in range(16):
        node = v.producer()
        if node is None:
            raise TraceError(f"{what} path reaches graph input {v.name!r} without a projection")
        path.append(node)
        if const_weight(node) is not None:
            return node.inputs[0], node.inputs[1], bias, path
        if node.op_type == "Add":
            data = [i for i in node.inputs if i is not None and not is_const(i)]
            cst = [i for i in node.inputs if i is not None and is_const(i)]
            prod = data[0].producer() if len(data) == 1 else None
            if bias is None and len(cst) == 1 and const_ndim(cst[0]) == 1 and prod is not None \
                    and const_weight(prod) is not None:
                bias, v = cst[0], data[0]
                continue
            raise TraceError(f"{what} path passes through {describe_node(node)} that is not a projection bias")
        if node.op_type == "Concat":
            data = [i for i in node.inputs if i is not None and not is_const(i) and cache_root(i) is None]
            if len(data) != 1:
                raise TraceError(f"{what} path meets {describe_node(node)} with {len(data)} computed inputs; "
                            f"expected a KV-cache concat with one")
            v = data[0]
            continue
        if node.op_type in LAYOUT_OPS and node.domain in ("", "ai.onnx"):
            v = node.inputs[0]
            continue
        raise TraceError(f"{what} path passes through {describe_node(node)}; only data movement "
                    f"({', '.join(sorted(LAYOUT_OPS))}, Concat) may sit between v_proj and attention")
    raise TraceError(f"{what} path is longer than 16 nodes")


def trace_o_proj(core: ir.Node) -> tuple[ir.Node, list[ir.Node]]:
    v, path = core.outputs[0], []
    for _ in range(8):
        node = only_consumer(v)
        if node is None:
            raise TraceError(f"attention output {v.name!r} has {len(consumers(v))} consumers; "
                        f"expected one path to o_proj")
        path.append(node)
        if const_weight(node) is not None and node.inputs[0] is v:
            return node, path
        if node.op_type in LAYOUT_OPS:
            v = node.outputs[0]
            continue
        raise TraceError(f"attention output reaches {describe_node(node)} before any constant-weight MatMul (o_proj)")
    raise TraceError("no o_proj within 8 nodes of the attention output")


def trace_residual(o_out: ir.Value) -> tuple[ir.Node, ir.Value, ir.Node | None, int | None]:
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
                outside = [i for i in ins if id(i) not in inside and not const_like(i)]
                if not outside:
                    if n.op_type not in NORM_PIECES:
                        raise TraceError(f"o_proj output reaches {describe_node(n)}, neither a residual add nor "
                                    f"part of a post-attention norm")
                    chain.append(n)
                    inside.update(id(o) for o in n.outputs)
                    nxt.extend(n.outputs)
                    continue
                if n.op_type == "Add" and len(ins) == 2 and len(outside) == 1:
                    mine = ins[0] if outside[0] is ins[1] else ins[1]
                    last = mine.producer()
                    if last is None or last not in chain:
                        raise TraceError(f"o_proj output joins {describe_node(n)} before any post-attention norm")
                    _check_closed(chain, last)
                    return n, outside[0], last, _gain_index(last)
                if n.op_type not in NORM_PIECES:
                    raise TraceError(f"o_proj output reaches {describe_node(n)}, neither a residual add nor part "
                                f"of a post-attention norm")
                # a norm node also reading a value the chain has not reached yet: revisit then
        frontier = nxt
    raise TraceError("no residual add found after o_proj (looked 16 nodes ahead)")


def const_like(v: ir.Value, depth: int = 4) -> bool:
    """A constant, or computed from constants only (e.g. a gain ``1 + w`` built at run time)."""
    if is_const(v):
        return True
    node = v.producer()
    if node is None or depth == 0 or v.is_graph_input():
        return False
    return all(i is None or const_like(i, depth - 1) for i in node.inputs)


def _check_closed(chain: list[ir.Node], last: ir.Node) -> None:
    """Every value the post-norm computes is used only inside it (else removing it is unsafe)."""
    for n in chain:
        for out in n.outputs:
            if out is last.outputs[0]:
                continue
            for c in consumers(out):
                if c not in chain:
                    raise TraceError(f"post-attention norm value {out.name!r} escapes to {describe_node(c)}")


def _gain_index(node: ir.Node) -> int | None:
    if node.op_type in NORM_OPS and len(node.inputs) > 1 and is_const(node.inputs[1]):
        return 1
    if node.op_type == "Mul":
        for i, v in enumerate(node.inputs):
            if is_const(v) and const_array(v).ndim <= 1:
                return i
    return None


def infer_head_dim(q_dim: int, kv_dim: int, num_heads: int | None, num_kv: int | None,
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
    raise TraceError(f"cannot tell the head size (q_dim {q_dim}, kv_dim {kv_dim}): no head-count "
                f"attributes, static KV shapes or constant reshapes on the V path")
