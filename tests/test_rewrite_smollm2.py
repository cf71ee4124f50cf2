"""End to end on the real SmolLM2-135M (Llama architecture, 9 heads / 3 KV heads): export, rewrite
the top 4 layers with arbitrary alphas (one of them 0), verify in ONNX Runtime against PyTorch
HARP, and generate text from the rewritten graph."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from harp_trt.plan import Plan
from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage

pytestmark = pytest.mark.slow


def test_smollm2_rewrite_verify_generate(smollm2, smollm2_export):
    from harp_trt.harp import apply_harp
    from harp_trt.models import load_model, load_tokenizer
    from harp_trt.ort_session import OrtCausalLM

    resolved, _, family = smollm2
    store, export = smollm2_export
    n = 30
    layers, alphas = (26, 27, 28, 29), (0.6, 0.35, 0.8, 0.0)
    plan = Plan(model_ref="smollm2-135m", model_digest=resolved.digest, family=family.name, num_layers=n,
                strategy="top", layers=layers, alphas=alphas)
    art = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": plan, "model": resolved},
                                 force=True)
    man = art.manifest
    report = json.loads((art.path / REPORT).read_text())
    # fp32: within 1e-4 x max(1, max|logits|) over prefill + 16 decode steps, 32 greedy tokens equal
    assert man["max_abs_diff"] <= man["tolerance"]
    assert report["verification"]["greedy_steps"] == 32 and len(report["verification"]["tokens"][1]) == 32
    assert man["kv_inputs"] == 2 * (n - len(layers))
    g = onnx.load(str(art.path / "model.onnx"), load_external_data=False)
    assert sum(node.op_type == "Attention" for node in g.graph.node) == n - len(layers)
    # 9 query heads read 3 KV heads: W_O folds to 192 x 576; W_Q, W_K, W_O (576x576, 576x192,
    # 576x576) go for each pruned layer, W_V too where alpha = 0
    by_layer = {r["layer"]: r for r in report["layers"]}
    for l, a in zip(layers, alphas):
        r = by_layer[l]
        assert (r["match"]["heads"], r["match"]["kv_heads"], r["match"]["head_dim"]) == (9, 3, 64)
        assert r["params_added"] == (0 if a == 0 else 192 * 576)
        assert r["params_removed"] >= 576 * 576 * 2 + 576 * 192 + (576 * 192 if a == 0 else 0)
    # generate: the rewritten graph's greedy text equals PyTorch HARP's
    tok = load_tokenizer(art.path)
    prompt = "The capital of France is"
    ids = np.array([tok(prompt, add_special_tokens=False)["input_ids"]], dtype=np.int64)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    out = OrtCausalLM(art.path / "model.onnx").generate(ids, max_new_tokens=16, stop_token_ids=stop)
    import torch

    ref_model, _ = load_model(resolved)
    apply_harp(ref_model, plan.alpha_map)
    with torch.no_grad():
        ref = ref_model.generate(torch.from_numpy(ids), attention_mask=torch.ones_like(torch.from_numpy(ids)),
                                 max_new_tokens=16, do_sample=False).numpy()
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert out.shape[1] > ids.shape[1] and text.strip()
    np.testing.assert_array_equal(out, ref)  # both stop at the same end-of-turn token, or run 16
