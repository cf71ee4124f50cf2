"""The rewrite on graphs it did not export, built here with onnx.helper from numpy weights:

* an optimum-style Llama/Qwen2 graph (``/model/layers.{i}/self_attn/...`` names, decomposed
  RMSNorm and rotary, MatMul-Softmax-MatMul, repeat_kv by Unsqueeze/Expand/Reshape, residual Add);
* an onnxruntime-genai-style graph whose attention is ``com.microsoft::GroupQueryAttention``
  (packed or separate QKV, past_key/past_value, seqlens_k, total_sequence_length, cos/sin caches).

Each graph is first checked against a numpy forward pass of the same weights (so the builder is
right), then rewritten and checked against numpy HARP (arXiv 2507.01900 Eq. 4-5) computed from the
*unfolded* weights, through prefill and decode steps with the KV cache (graphs, numpy reference and
step runner: ``_rewrite_graphs.py``)."""
from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from onnx import helper as oh

from _rewrite_graphs import IDS, MASK, build_gqa, build_optimum, make_weights, rewrite_proto, run_steps, session_of
from harp_trt.errors import GraphError
from harp_trt.rewrite.passes import HarpRewritePass


@pytest.mark.parametrize("bias,sdpa", [(False, "plain"), (True, "plain"), (False, "split-guard"),
                                       (True, "split-notguard")],
                         ids=["llama", "qwen2", "llama-split-guard", "qwen2-split-notguard"])
def test_optimum_style_graph(bias, sdpa):
    w = make_weights(bias=bias)
    proto = build_optimum(w, sdpa=sdpa)
    onnx.checker.check_model(proto, full_check=True)
    base, n_kv = run_steps(session_of(proto), w, IDS, MASK, {})
    assert base < 1e-4 and n_kv == 6
    alphas = {1: 0.6}
    model, result = rewrite_proto(proto, alphas, 3)
    diff, n_kv = run_steps(session_of(model), w, IDS, MASK, alphas)
    assert diff < 1e-4, diff
    assert n_kv == 4
    rep = result.layers[0]
    assert (rep.rule, rep.locator) == ("softmax-attention", "kv-input")
    assert rep.kv_inputs_removed == ["past_key_values.1.key", "past_key_values.1.value"]
    assert rep.kv_outputs_removed == ["present.1.key", "present.1.value"]
    names = set(model.graph.initializers)
    assert not {f"model.layers.1.self_attn.{n}_proj.weight" for n in "qko"} & names
    assert "model.layers.1.self_attn.v_proj.weight" in names  # W_V is reused as is
    assert ("model.layers.1.self_attn.v_proj.bias" in names) == bias  # v bias kept (Qwen2)
    assert not any(n.name and n.name.startswith("/model/layers.1/self_attn/") for n in model.graph)
    # removed: W_Q, W_K, W_O (+ q/k biases); added: the folded W_O (kv_dim x D)
    c = w["cfg"]
    assert rep.params_added == c["KV"] * c["hd"] * c["D"]
    assert rep.params_removed >= 2 * c["D"] * c["H"] * c["hd"] + c["D"] * c["KV"] * c["hd"]  # W_Q, W_O, W_K
    qk = (c["D"] + bias) * (c["H"] + c["KV"]) * c["hd"]  # HARP's own: W_Q, W_K (+ their biases)
    assert (rep.harp_params_removed, rep.params_replaced) == (qk, c["H"] * c["hd"] * c["D"])
    assert result.to_dict()["params_removed"] == qk


@pytest.mark.parametrize("stored,mode", [("gain", "alpha-in-norm-gain"), ("offset", "alpha-mul")])
def test_post_attention_norm_graph(stored, mode):
    """Gemma2-like: h <- h + alpha * norm(o_proj(...)); alpha folds into a constant gain, or is
    applied by a Mul after the norm when the graph computes the gain (1 + w) at run time."""
    w = make_weights()
    proto = build_optimum(w, post_attn=stored)
    base, _ = run_steps(session_of(proto), w, IDS, MASK, {}, post_attn=True)
    assert base < 1e-4
    alphas = {0: 0.45, 2: 0.0}
    model, result = rewrite_proto(proto, alphas, 3)
    diff, n_kv = run_steps(session_of(model), w, IDS, MASK, alphas, post_attn=True)
    assert diff < 1e-4, diff
    assert n_kv == 2
    assert [r.mode for r in result.layers] == [mode, "removed"]
    assert result.layers[0].match["post_norm"] == "/model/layers.0/post_attention_norm/Mul_1"
    # alpha = 0 removes the whole post-norm branch of layer 2
    assert not any(n.name.startswith("/model/layers.2/post_attention_norm/") for n in model.graph)


@pytest.mark.parametrize("packed,skip_norm", [(True, False), (False, False), (True, True)],
                         ids=["packed", "separate", "packed-skipnorm"])
def test_group_query_attention_graph(packed, skip_norm):
    w = make_weights(bias=packed, hd=16)  # ORT's CPU kernel wants head_size % 16 == 0
    proto = build_gqa(w, packed=packed, skip_norm=skip_norm)
    onnx.checker.check_model(proto, full_check=True)
    ids, mask = IDS[:1].repeat(2, 0), MASK[:1].repeat(2, 0)  # GQA's prompt path wants no left padding
    ids[1] = [3, 1, 4, 1, 5, 9]
    base, _ = run_steps(session_of(proto), w, ids, mask, {}, use_pos=False)
    assert base < 1e-4
    alphas = {0: 0.8, 2: 0.0}  # non-contiguous, one removed entirely
    model, result = rewrite_proto(proto, alphas, 3)
    diff, n_kv = run_steps(session_of(model), w, ids, mask, alphas, use_pos=False)
    assert diff < 1e-4, diff
    assert n_kv == 2
    assert [r.rule for r in result.layers] == ["group-query-attention"] * 2
    assert [r.mode for r in result.layers] == ["alpha-in-o_proj", "removed"]
    assert not any(n.op_type == "GroupQueryAttention" and "layers.0/" in n.name for n in model.graph)
    assert sum(n.op_type == "GroupQueryAttention" for n in model.graph) == 1
    c = w["cfg"]
    q, k, v = ((c["D"] + packed) * n * c["hd"] for n in (c["H"], c["KV"], c["KV"]))  # bias with packed
    # at alpha 0 the whole sublayer: + V, W_O and the input norm's gain
    assert [r.harp_params_removed for r in result.layers] == [q + k, q + k + v + c["H"] * c["hd"] * c["D"] + c["D"]]
    if packed:  # only V's columns of the packed weight survive
        assert result.layers[0].initializers_added[0] == "harp.layers.0.v_proj.weight"
        assert model.graph.initializers["harp.layers.0.v_proj.weight"].const_value.shape == (32, 2 * 16)


def test_unrecognised_block_names_layer_and_reason():
    w = make_weights()
    proto = build_optimum(w)
    # put a non-linear op on layer 2's V path: no longer a per-token linear map
    for idx, node in enumerate(proto.graph.node):
        if node.name == "/model/layers.2/self_attn/Transpose_v":
            relu = oh.make_node("Relu", [node.output[0]], ["v_relu"], name="/model/layers.2/self_attn/Relu")
            for other in proto.graph.node:
                for j, inp in enumerate(other.input):
                    if inp == node.output[0]:
                        other.input[j] = "v_relu"
            proto.graph.node.insert(idx + 1, relu)
            break
    onnx.checker.check_model(proto)
    model = ir.from_proto(proto)
    with pytest.raises(GraphError, match=r"layer 2: no attention block recognised .*Relu"):
        HarpRewritePass({0: 0.5, 2: 0.5}, 3)(model)
    # nothing was changed: the pass matches every layer before rewriting any
    assert sum(1 for n in model.graph if n.op_type == "Softmax") == 3


def test_layers_out_of_range_and_depth_mismatch():
    proto = build_optimum(make_weights())
    with pytest.raises(GraphError, match=r"out of range 0..2"):
        HarpRewritePass({3: 0.5}, 3)(ir.from_proto(proto))
    with pytest.raises(GraphError, match=r"graph has 3 attention layers but the plan is for a 4-layer model"):
        HarpRewritePass({1: 0.5}, 4)(ir.from_proto(proto))
