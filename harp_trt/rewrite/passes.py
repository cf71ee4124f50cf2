"""The HARP rewrite pass: match every pruned layer first (so a layer that cannot be matched
fails the pass before anything changes), then rewrite each layer, drop its KV-cache inputs and
outputs, and sweep what became dead, recording per layer what was matched and changed.

``HarpRewritePass`` is an ``onnx_ir.passes.InPlacePass`` (``requires`` / ``call`` / ``ensures``,
composable in an ``onnx_ir.passes.PassManager``); its ``RewriteResult`` is a ``PassResult``.
Its pre- and postcondition errors are both harp-trt's typed ``GraphError`` /
``PostconditionError`` and onnx_ir's ``PreconditionError`` / ``PostconditionError``."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes as ir_passes

from ..errors import GraphError, PostconditionError
from ..graph_rules import RuleResult
from ..onnx_io import parse_any_kv_name
from .graph import STAGE, DeadCode, remove_dead
from .rules import DEFAULT_RULES, AttentionMatch, AttentionRule, describe
from .rules.tracing import is_bias_add

__all__ = ["HarpRewritePass", "LayerReport", "RewriteResult", "RewritePreconditionError",
           "RewritePostconditionError", "count_attention_layers"]

log = logging.getLogger(__name__)


@dataclass
class LayerReport:
    layer: int
    alpha: float
    rule: str
    locator: str
    mode: str
    match: dict[str, Any]
    nodes_removed: int
    removed_ops: dict[str, int]
    nodes_added: list[str]
    initializers_removed: list[str]
    initializers_added: list[str]
    params_removed: int             # every initializer parameter the layer's sweep removed
    params_added: int
    kv_inputs_removed: list[str]
    kv_outputs_removed: list[str]
    harp_params_removed: int = 0    # HARP's own: Q/K weights+biases (all of the block at alpha 0)
    params_replaced: int = 0        # constants the edit replaced by folded ones (o_proj, norm gain)
    cleanup_initializers: list[str] = field(default_factory=list)  # swept, not the block's
    cleanup_params: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RewritePreconditionError(GraphError, ir_passes.PreconditionError):
    """The graph and the plan do not fit (layer range, attention-layer count)."""


class RewritePostconditionError(PostconditionError, ir_passes.PostconditionError):
    """The pass left a pruned layer's KV-cache I/O or attention core in the graph."""


@dataclass
class RewriteResult(RuleResult):
    """``PassResult`` (``model``, ``modified``) plus what was matched and changed per layer; as a
    ``RuleResult`` its ``report`` (under ``harp``) is ``to_dict()``, which ``run_passes`` hands back."""

    layers: list[LayerReport] = field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    params_before: int = 0
    params_after: int = 0
    kv_inputs_before: int = 0
    kv_inputs_after: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def params_removed(self) -> int:
        return self.params_before - self.params_after

    @property
    def kv_inputs_removed(self) -> list[str]:
        return [n for r in self.layers for n in r.kv_inputs_removed]

    @property
    def harp_params_removed(self) -> int:
        return sum(r.harp_params_removed for r in self.layers)

    def to_dict(self) -> dict[str, Any]:
        """``params_removed`` is what HARP removed (Q/K projections of the pruned layers, the
        whole block at alpha 0); ``harp`` details it with the KV I/O, ``cleanup`` lists what the
        dead-code sweep took that was not the block's, ``params_net_change`` is before - after."""
        layers = self.layers
        return {"layers": [r.to_dict() for r in layers], "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "params_before": self.params_before,
                "params_after": self.params_after, "params_removed": self.harp_params_removed,
                "params_net_change": self.params_removed,
                "harp": {"params_removed": self.harp_params_removed,
                         "params_replaced": sum(r.params_replaced for r in layers),
                         "params_added": sum(r.params_added for r in layers),
                         "kv_inputs_removed": [n for r in layers for n in r.kv_inputs_removed],
                         "kv_outputs_removed": [n for r in layers for n in r.kv_outputs_removed]},
                "cleanup": {"initializers": [n for r in layers for n in r.cleanup_initializers],
                            "params": sum(r.cleanup_params for r in layers)},
                "kv_inputs_before": self.kv_inputs_before, "kv_inputs_after": self.kv_inputs_after,
                **self.extra}


def _params(graph: ir.Graph) -> int:
    total = 0
    for v in graph.initializers.values():
        t = v.const_value
        if t is not None and t.shape is not None:
            n = 1
            for d in t.shape:
                n *= int(d)
            total += n
    return total


def _block_constants(m: AttentionMatch, removed_block: bool) -> tuple[dict[str, int], set[str]]:
    """The layer's constants by what the rewrite does to them: ``harp`` maps the initializers HARP
    removes (Q/K projection weights and biases; V, o_proj and the norm gains too when the block
    goes at alpha 0) to how many of their parameters are HARP's (-1: all; a packed QKV weight: all
    but V's columns); ``replaced`` names the ones the edit swaps for folded copies (o_proj, the
    post-norm gain). Only what the sweep really removes is counted: a constant another layer
    still reads (the optimizer shares bitwise-equal initializers) stays out of the count."""
    harp: dict[str, int] = {}
    for node in m.qk_nodes:
        w = node.inputs[1]
        if w is not None and w.name:
            harp[w.name] = -1  # all of it
        harp.update({g.name: -1 for g in _qk_norm_gains(node)})
        for use in node.outputs[0].uses():
            b = is_bias_add(use.node, node.outputs[0])
            if b is not None and b.name:
                harp[b.name] = -1
    replaced = {v.name for v in (m.w_o, m.b_o) if v is not None and v.name}
    if m.post_norm is not None:
        replaced |= {v.name for v in m.post_norm.inputs[1:] if v is not None and v.name and v.const_value is not None}
    if removed_block:  # the whole sublayer goes: V, o_proj, its norms' gains
        norm = m.x.producer()
        gains = [v for v in norm.inputs[1:] if v is not None and v.const_value is not None] if norm else []
        harp.update({n: -1 for n in replaced | {v.name for v in (m.w_v, m.b_v, *gains) if v is not None and v.name}})
        replaced = set()
    elif m.v_cols is not None:  # packed QKV: the packed constants go, V's columns are re-added
        lo, hi = m.v_cols
        for v in (m.w_v, m.b_v):
            if v is not None and v.name and v.const_value is not None:
                shape = [int(d) for d in v.const_value.shape]
                harp[v.name] = int(np.prod(shape)) - (hi - lo) * (shape[0] if len(shape) == 2 else 1)
    return harp, replaced


_QK_NORMS = ("RMSNormalization", "SimplifiedLayerNormalization")


def _qk_norm_gains(proj: ir.Node, hops: int = 3) -> list[ir.Value]:
    """A QK-norm family's per-head norm gain behind a Q/K projection (Qwen3 ``q_norm``: Reshape, then
    RMSNormalization), within a few nodes of data movement: Q/K parameters, so HARP's to remove."""
    frontier, gains = [proj.outputs[0]], []
    for _ in range(hops):
        nxt = []
        for v in frontier:
            for use in v.uses():
                n = use.node
                if n.op_type in _QK_NORMS and use.idx == 0:
                    gains += [g for g in n.inputs[1:] if g is not None and g.name and g.const_value is not None]
                elif n.op_type in ("Reshape", "Transpose", "Add", "Split"):   # Split: a packed QKV (genai)
                    nxt.extend(n.outputs)
        frontier = nxt
    return gains


def _classify(dead: DeadCode, harp: Mapping[str, int], replaced: set[str]) -> tuple[int, int, list[str], int]:
    """Split what the sweep removed: (HARP params, replaced params, clean-up names, clean-up params)."""
    h = r = c = 0
    cleanup = []
    for name in dead.initializers:
        n = dead.sizes.get(name, 0)
        if name in harp:
            h += n if harp[name] < 0 else harp[name]
            r += 0 if harp[name] < 0 else n - harp[name]
        elif name in replaced:
            r += n
        else:
            cleanup.append(name)
            c += n
    return h, r, cleanup, c


def _kv_inputs(graph: ir.Graph) -> list[ir.Value]:
    return [v for v in graph.inputs if _is_past(v.name)]


def _is_past(name: str | None) -> bool:
    k = parse_any_kv_name(name)
    return k is not None and k.direction == "past"


def count_attention_layers(graph: ir.Graph, rules: Sequence[AttentionRule] = DEFAULT_RULES) -> int:
    """Number of attention cores of the first rule kind the graph has (0 if none)."""
    for rule in rules:
        n = sum(1 for node in graph if rule.is_core(node))
        if n:
            return n
    return 0


def _reroute_shape_reads(graph: ir.Graph, v: ir.Value, matches: Mapping[int, AttentionMatch]) -> None:
    """Exporters read batch size or past length with ``Shape(past_key_values.i.*)`` for the
    whole graph. Before dropping that input, point such reads at a KV input that stays (same
    layout), or derive them from ``input_ids`` / ``attention_mask`` when every layer is pruned."""
    pruned = {id(k) for mm in matches.values() for k in mm.kv_inputs}
    kept = [k for k in graph.inputs if _is_past(k.name) and id(k) not in pruned
            and k.shape is not None and v.shape is not None and len(k.shape) == len(v.shape)]
    by_name = {k.name: k for k in graph.inputs}
    for use in list(v.uses()):
        node = use.node
        if node.op_type != "Shape":
            continue
        if kept:
            node.replace_input_with(use.idx, kept[0])
            continue
        rank = len(v.shape) if v.shape is not None else 4
        start = node.attributes.get_int("start", 0) % rank if node.attributes.get_int("start", 0) < 0 \
            else node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", rank)
        end = end % rank if end < 0 else min(end, rank)
        if (start, end) == (0, 1) and "input_ids" in by_name:
            node.replace_input_with(use.idx, by_name["input_ids"])
        elif (start, end) == (2, 3) and {"input_ids", "attention_mask"} <= set(by_name):
            # past length = total length - new tokens
            total = ir.node("Shape", [by_name["attention_mask"]], attributes={"start": 1, "end": 2},
                            name=f"harp/past_len/{v.name}/total")
            new = ir.node("Shape", [by_name["input_ids"]], attributes={"start": 1, "end": 2},
                          name=f"harp/past_len/{v.name}/new")
            sub = ir.node("Sub", [total.outputs[0], new.outputs[0]], name=f"harp/past_len/{v.name}/Sub")
            for n in (total, new, sub):
                n.outputs[0].name = n.name + "_output_0"
            graph.insert_before(node, [total, new, sub])
            node.outputs[0].replace_all_uses_with(sub.outputs[0])
        elif rank == 4 and {"input_ids", "attention_mask"} <= set(by_name):
            # the whole shape [batch, kv_heads, past, head_dim] (optimum reads Shape(past) and
            # Gathers from it), then the slice the Shape node asked for
            m = next((mm for mm in matches.values() if any(k is v for k in mm.kv_inputs)), None)
            if m is None:
                continue
            tag = f"harp/past_shape/{v.name}"
            heads_dim = [ir.Value(name=f"{tag}/{n}", const_value=ir.tensor(np.array([d], np.int64), name=f"{tag}/{n}"))
                         for n, d in (("kv_heads", m.num_kv_heads), ("head_dim", m.head_dim))]
            for c in heads_dim:
                graph.register_initializer(c)
            batch = ir.node("Shape", [by_name["input_ids"]], attributes={"start": 0, "end": 1}, name=f"{tag}/batch")
            total = ir.node("Shape", [by_name["attention_mask"]], attributes={"start": 1, "end": 2}, name=f"{tag}/total")
            new = ir.node("Shape", [by_name["input_ids"]], attributes={"start": 1, "end": 2}, name=f"{tag}/new")
            past = ir.node("Sub", [total.outputs[0], new.outputs[0]], name=f"{tag}/past")
            full = ir.node("Concat", [batch.outputs[0], heads_dim[0], past.outputs[0], heads_dim[1]],
                           attributes={"axis": 0}, name=f"{tag}/Concat")
            added = [batch, total, new, past, full]
            out = full.outputs[0]
            if (start, end) != (0, rank):
                bounds = [ir.Value(name=f"{tag}/{n}", const_value=ir.tensor(np.array([b], np.int64), name=f"{tag}/{n}"))
                          for n, b in (("start", start), ("end", end))]
                for c in bounds:
                    graph.register_initializer(c)
                sl = ir.node("Slice", [out, *bounds], name=f"{tag}/Slice")
                added.append(sl)
                out = sl.outputs[0]
            for n in added:
                n.outputs[0].name = n.name + "_output_0"
            graph.insert_before(node, added)
            node.outputs[0].replace_all_uses_with(out)


class HarpRewritePass(ir_passes.InPlacePass):
    """Rewrite the pruned layers of ``model`` in place (HARP Eq. 4-5, ``rules/``).

    ``alphas`` maps layer index -> alpha; ``fitted`` layer index -> a fitted map's V/O weights
    (``fitted_weights``) used there instead of the layer's own. ``num_layers`` is the model's decoder depth (the plan's);
    the graph must have exactly that many attention cores. ``head_dim`` is an optional hint for
    graphs whose head size cannot be read from the graph.

    ``requires``: plan layers in range, one attention core per decoder layer. ``call``: match
    every pruned layer (nothing changes if one fails), then rewrite. ``ensures``: no pruned
    layer keeps a KV-cache input/output or an attention core."""

    def __init__(self, alphas: Mapping[int, float], num_layers: int,
                 rules: Sequence[AttentionRule] = DEFAULT_RULES, head_dim: int | None = None,
                 fitted: Mapping[int, Mapping[str, Any]] | None = None):
        super().__init__()
        self.alphas = {int(k): float(v) for k, v in alphas.items()}
        self.fitted = {int(k): v for k, v in (fitted or {}).items()}  # layer -> fitted V/O (rules/base.py rewrite)
        self.num_layers = int(num_layers)
        self.rules = tuple(rules)
        self.head_dim = head_dim
        self._removed: dict[int, tuple[list[ir.Value], list[ir.Value], list[ir.Node]]] = {}

    # -- matching ---------------------------------------------------------------------------
    def match_layer(self, graph: ir.Graph, layer: int) -> AttentionMatch:
        reasons = []
        for rule in self.rules:
            cores, locator = rule.pattern(graph, layer, self.num_layers)
            if not cores:
                reasons.append(f"{rule.name}: no {rule.description} nodes")
                continue
            if locator == "ambiguous":
                reasons.append(f"{rule.name}: {len(cores)} candidate cores and none tied to layer "
                               f"{layer} by KV-cache inputs, node names or position")
                continue
            res = rule.check(graph, cores[0], layer, locator, self.head_dim)
            if res:
                return res.match
            reasons.append(f"{rule.name}: {res.reason}")
        raise GraphError(STAGE, f"layer {layer}: no attention block recognised ({'; '.join(reasons)})",
                         "the graph must hold one attention core per layer (Attention, "
                         "GroupQueryAttention or MatMul-Softmax-MatMul) fed by constant-weight projections")

    def check_layers(self, graph: ir.Graph) -> None:
        bad = sorted(l for l in self.alphas if not 0 <= l < self.num_layers)
        if bad:
            raise RewritePreconditionError(STAGE, f"plan layers {bad} out of range 0..{self.num_layers - 1}")
        found = count_attention_layers(graph, self.rules)
        if found != self.num_layers:
            raise RewritePreconditionError(
                STAGE, f"graph has {found} attention layers but the plan is for a {self.num_layers}-layer model",
                "the plan belongs to a different model than this graph" if found else
                "no attention core was recognised (Attention, GroupQueryAttention, MatMul-Softmax-MatMul)")

    # -- the pass -----------------------------------------------------------------------------
    def requires(self, model: ir.Model) -> None:
        self.check_layers(model.graph)

    def ensures(self, model: ir.Model) -> None:
        names_in = {v.name for v in model.graph.inputs}
        names_out = {v.name for v in model.graph.outputs}
        for layer, (ins, outs, cores) in self._removed.items():
            left = [v.name for v in ins if v.name in names_in] + [v.name for v in outs if v.name in names_out]
            if left or any(n.graph is not None for n in cores):
                raise RewritePostconditionError(
                    STAGE, f"layer {layer}: KV-cache I/O {left} or its attention core survived the rewrite")

    def call(self, model: ir.Model) -> RewriteResult:
        graph = model.graph
        matches = {layer: self.match_layer(graph, layer) for layer in sorted(self.alphas)}
        nodes_before, params_before, kv_before = len(graph), _params(graph), len(_kv_inputs(graph))
        reports = []
        self._removed = {}
        for layer, m in matches.items():
            alpha = self.alphas[layer]
            rule = next(r for r in self.rules if r.name == m.rule)
            harp, replaced = _block_constants(m, alpha == 0.0)
            edit = rule.rewrite(graph, m, alpha, self.fitted.get(layer))
            outs = [v for v in m.kv_outputs if v in list(graph.outputs)]
            for v in outs:
                graph.outputs.remove(v)
            dead = remove_dead(model)
            ins = []
            for v in m.kv_inputs:
                if v not in list(graph.inputs):
                    continue
                _reroute_shape_reads(graph, v, matches)
                dead.extend(remove_dead(model))
                if v.uses():
                    raise GraphError(STAGE, f"layer {layer}: KV input {v.name!r} is still used after "
                                            f"the rewrite by {[u.node.name for u in v.uses()]}")
                graph.inputs.remove(v)
                ins.append(v)
            if m.core.graph is not None or any(n.graph is not None for n in m.qk_nodes):
                raise GraphError(STAGE, f"layer {layer}: the attention core or Q/K projections are "
                                        f"still reachable after the rewrite")
            self._removed[layer] = (list(m.kv_inputs), list(m.kv_outputs), [m.core])
            harp_params, replaced_params, cleanup, cleanup_params = _classify(dead, harp, replaced)
            rep = LayerReport(
                layer=layer, alpha=alpha, rule=m.rule, locator=m.locator, mode=edit.mode,
                match=describe(m), nodes_removed=len(dead.nodes), removed_ops=dead.node_ops,
                nodes_added=edit.nodes_added, initializers_removed=dead.initializers,
                initializers_added=edit.initializers_added, params_removed=dead.params,
                params_added=edit.params_added, kv_inputs_removed=[v.name for v in ins],
                kv_outputs_removed=[v.name for v in outs], harp_params_removed=harp_params,
                params_replaced=replaced_params, cleanup_initializers=cleanup, cleanup_params=cleanup_params)
            log.info("layer %d: %s via %s, alpha=%.4g (%s): -%d nodes, -%d HARP params, %d replaced by %d, "
                     "-%d clean-up params, -%d KV inputs", layer, m.rule, m.locator, alpha, edit.mode,
                     len(dead.nodes), harp_params, replaced_params, edit.params_added, cleanup_params, len(ins))
            reports.append(rep)
        graph.meta.pop("harp_names", None)
        result = RewriteResult(model=model, modified=bool(reports), key="harp", layers=reports,
                               nodes_before=nodes_before, nodes_after=len(graph), params_before=params_before,
                               params_after=_params(graph), kv_inputs_before=kv_before,
                               kv_inputs_after=len(_kv_inputs(graph)))
        result.report = result.to_dict()
        return result
