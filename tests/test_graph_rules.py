"""The graph-rule protocol and the pass plumbing around it (``harp_trt/graph_rules.py``,
``harp_trt/rewrite/graph.py: remove_dead``, ``builders/ort/passes.py``), on graphs of a few nodes
built here. The rules' matching and numerics are tested on whole graphs in test_rewrite_graphs.py,
test_rewrite_real_exports.py and test_ort_engine.py."""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes as ir_passes
import pytest
from onnx_ir.passes.common import RemoveUnusedNodesPass

from harp_trt.builders.ort.config import OrtBuildConfig
from harp_trt.builders.ort.gqa import FuseGroupQueryAttention
from harp_trt.builders.ort.passes import (FuseGroupQueryAttentionPass, FuseSiblingMatMulsPass, LogitsToKeepPass,
                                         QuantizeEmbeddingPass, QuantizeWeightsPass, graph_passes, run_passes)
from harp_trt.errors import ConfigError, GraphError
from harp_trt.graph_rules import GraphRule, MatchResult, RulePass
from harp_trt.rewrite.graph import remove_dead
from harp_trt.rewrite.rules import DEFAULT_RULES

META = {"num_heads": 4, "kv_heads": 2, "head_dim": 8, "num_layers": 1}


def _value(name: str, shape: tuple[int, ...], dtype=ir.DataType.FLOAT) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype))


def _model(nodes: list[ir.Node], inputs: list[ir.Value], outputs: list[ir.Value],
           initializers: list[ir.Value] = ()) -> ir.Model:
    graph = ir.Graph(inputs, outputs, nodes=nodes, initializers=initializers, opset_imports={"": 23})
    return ir.Model(graph, ir_version=10)


def test_every_rule_follows_the_protocol():
    rules = [*DEFAULT_RULES, FuseGroupQueryAttention.from_export_meta(META)]
    assert all(isinstance(r, GraphRule) and r.name and r.description for r in rules)
    assert [r.name for r in DEFAULT_RULES] == ["onnx-attention", "group-query-attention", "softmax-attention"]
    assert FuseGroupQueryAttention.from_export_meta({"num_heads": 4}) is None  # no export metadata
    assert not MatchResult.fail("why") and MatchResult.fail("why").reason == "why" and MatchResult(object())


def test_gqa_check_says_why_an_attention_does_not_match():
    """An Attention whose Q is no RotaryEmbedding does not match, and the check says why; in a graph
    with harp-trt's export metadata every attention must fuse (only sliding-window layers stay), so
    the pass refuses the graph with that reason rather than leaving the layer slow and quiet."""
    q, k, v = (_value(n, (1, 4, 3, 8)) for n in "qkv")
    mask = _value("mask", (1, 1, 3, 3), ir.DataType.BOOL)
    att = ir.node("Attention", [q, k, v, mask], name="attn")
    att.outputs[0].name = "y"
    model = _model([att], [q, k, v, mask], [att.outputs[0]])
    rule = FuseGroupQueryAttention.from_export_meta(META)
    assert rule.pattern(model.graph) == [att]
    found = rule.check(model.graph, att)
    assert not found and found.reason == "Q is not RotaryEmbedding(x, cos, sin)"
    with pytest.raises(GraphError, match=r"no match at attn: Q is not RotaryEmbedding\(x, cos, sin\)"):
        FuseGroupQueryAttentionPass(META)(model)


def test_remove_dead_accounts_for_what_the_library_pass_took():
    """onnx-ir's RemoveUnusedNodesPass does the removal; remove_dead lists it: nodes last first, op
    counts, initializers with their sizes. Graph inputs stay even when nothing reads them."""
    x, unused_in = _value("x", (2, 3)), _value("unused", (2, 3))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones((3, 4), np.float32), name="w"))
    b = ir.Value(name="b", const_value=ir.tensor(np.ones(4, np.float32), name="b"))
    keep = ir.node("Relu", [x], name="keep")
    mm = ir.node("MatMul", [x, w], name="dead_mm")
    add = ir.node("Add", [mm.outputs[0], b], name="dead_add")
    model = _model([keep, mm, add], [x, unused_in], [keep.outputs[0]], [w, b])
    dead = remove_dead(model)
    assert dead.nodes == ["dead_add", "dead_mm"] and dead.node_ops == {"Add": 1, "MatMul": 1}
    assert dead.initializers == ["w", "b"] and dead.sizes == {"w": 12, "b": 4}
    assert (dead.params, dead.bytes) == (16, 64)
    assert [n.name for n in model.graph] == ["keep"] and not model.graph.initializers
    assert [v.name for v in model.graph.inputs] == ["x", "unused"]
    assert remove_dead(model).nodes == []


def test_the_build_orders_its_passes_from_the_config():
    kinds = lambda cfg: [type(p) for p in graph_passes(cfg, META, "build-ort")]  # noqa: E731
    gqa, fuse = [FuseGroupQueryAttentionPass, RemoveUnusedNodesPass], [FuseSiblingMatMulsPass, RemoveUnusedNodesPass]
    keep = [LogitsToKeepPass]
    assert kinds(OrtBuildConfig()) == gqa + fuse + keep
    assert kinds(OrtBuildConfig(quant="int8")) == gqa + fuse + keep + [QuantizeWeightsPass]
    assert kinds(OrtBuildConfig(quant="int4", quant_embedding=True)) == gqa + fuse + keep + [
        QuantizeWeightsPass, QuantizeEmbeddingPass, RemoveUnusedNodesPass]
    assert kinds(OrtBuildConfig(attention="onnx", quant="int4", fuse_matmuls=False)) == keep + [QuantizeWeightsPass]
    assert kinds(OrtBuildConfig(attention="onnx", fuse_matmuls=False, logits_to_keep=False)) == []


class _Raise(ir_passes.InPlacePass):
    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def call(self, model):
        raise self.error


def test_run_passes_keeps_harp_errors_typed():
    """Sequential wraps every error in PassError; a harp-trt error comes out as itself."""
    x = _value("x", (2,))
    relu = ir.node("Relu", [x], name="r")
    model = _model([relu], [x], [relu.outputs[0]])
    assert run_passes([], model) == (model, {})
    with pytest.raises(ConfigError, match="^bad block$"):
        run_passes([RemoveUnusedNodesPass(), _Raise(ConfigError("bad block"))], model)
    with pytest.raises(ir_passes.PassError):
        run_passes([_Raise(ValueError("a bug"))], model)


class _ReluToSigmoid(GraphRule):
    """A toy rule: a Relu named ``ok*`` becomes a Sigmoid; others are left with a reason."""

    name, description, key = "ReluToSigmoid", "Relu nodes", "toy"

    def pattern(self, graph):
        return [n for n in graph if n.op_type == "Relu"]

    def check(self, graph, node):
        return MatchResult(node) if node.name.startswith("ok") else MatchResult.fail("not ok")

    def rewrite(self, graph, node):
        new = ir.node("Sigmoid", [node.inputs[0]], name=node.name + "/sigmoid")
        graph.insert_before(node, [new])
        node.outputs[0].replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        return new


def _relus(*names):
    x = _value("x", (2,))
    nodes = [ir.node("Relu", [x], name=n) for n in names]
    for n in nodes:
        n.outputs[0].name = n.name + "_y"
    return _model(nodes, [x], [n.outputs[0] for n in nodes])


def test_the_driver_checks_every_candidate_and_reports_in_the_result():
    """RulePass: pattern -> check -> rewrite for each candidate; the PassResult carries the rule's
    report (matched, and each candidate left alone with its reason); run_passes hands back every
    report by key, in order, with the model the passes left."""
    model = _relus("ok1", "bad", "ok2")
    out, reports = run_passes([RulePass(_ReluToSigmoid()), RemoveUnusedNodesPass()], model)
    assert [(n.name, n.op_type) for n in out.graph] == [("ok1/sigmoid", "Sigmoid"), ("bad", "Relu"), ("ok2/sigmoid", "Sigmoid")]
    assert list(reports) == ["toy"] and reports["toy"]["rule"] == "ReluToSigmoid"
    assert reports["toy"]["skipped"] == {"bad": "not ok"}
    assert [n.name for n in reports["toy"]["matched"]] == ["ok1", "ok2"]  # describe: the match by default
    first = type("First", (_ReluToSigmoid,), {"first_only": True})()
    result = RulePass(first)(_relus("ok1", "ok2"))
    assert result.modified and len(result.report["matched"]) == 1 and result.key == "toy"
    strict = type("Strict", (_ReluToSigmoid,), {"must_match": True, "fail_hint": "teach it"})()
    with pytest.raises(GraphError, match="ReluToSigmoid found no match at bad: not ok") as e:
        run_passes([RulePass(strict, "build")], _relus("ok1", "bad"))
    assert e.value.hint == "teach it"
    unmatched = RulePass(_ReluToSigmoid())(_relus("bad"))
    assert not unmatched.modified and unmatched.report["skipped"] == {"bad": "not ok"}
