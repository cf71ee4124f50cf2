"""The HARP rewrite on Qwen3 and Gemma3 graphs written by optimum (``optimum-cli export onnx
--task text-generation-with-past``, optimum-onnx 0.1.0 with transformers 4.57 in its own venv), not by
this project.

The fixtures (``fixtures/real_exports/{qwen3,gemma3}``, made by ``make_fixtures.py --family``; versions
and commands in each ``VERSIONS.json``) are tiny random models of each family: Qwen3 with its own
``head_dim`` (4 x 32 != hidden 64) and the per-head Q/K RMSNorm, Gemma3 with the QK-norm, the sandwich
norms, an 8-token sliding window on layers 0, 1 and 3 and a global layer 2 (RoPE bases 1e4 and 1e6).
optimum decomposes the QK-norms into Pow / ReduceMean / Sqrt / Div / Mul under ``self_attn/q_norm`` and
``k_norm``. Each graph is rewritten with a plan pruning layers 2 and 3 (Gemma3: the global and a local
layer) and checked as the Llama exports are in test_rewrite_real_exports.py: the pruned layers' KV
inputs and outputs gone and no others, their QK-norms gone with Q and K, the graph valid, and in ONNX
Runtime its logits equal to the PyTorch HARP model's on prefill (12-token prompts, longer than the
window) and 4 decode steps within ``1e-4 x max(1, max|logits|)`` (fp32), with 8 identical greedy tokens.

onnxruntime-genai's builder is the other exporter users run. Its 0.18 builder writes Qwen3 (rewritten
live in test_qk_norm_families.py) but not Gemma3 under the transformers 5 it requires: it reads
``config.rope_parameters["rope_type"]`` (``builders/base.py`` ``Model.make_rope_init``) where Gemma3's
config keys ``rope_parameters`` by layer type. ``make_fixtures.py`` records that outcome in
``gemma3/VERSIONS.json`` and the first test reads it."""
from __future__ import annotations

import json
import shutil

import onnx
import onnx_ir as ir
import pytest

from harp_trt.errors import VerificationError
from harp_trt.plan import Plan
from harp_trt.rewrite.graph import check_onnx
from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage, graph_facts, rewrite_onnx
from harp_trt.store import ArtifactStore
from harp_trt.verify import VerifyConfig, verify_rewrite
from test_rewrite_real_exports import FIXTURES, _io_names

RTOL = 1e-4
LAYERS, ALPHAS = (2, 3), (0.3, 0.7)
# family -> (graph facts, the rewrite mode of a pruned layer: Gemma's alpha sits after its
# post-attention norm, so it scales that norm's gain; families/gemma3.py)
FAMILIES = {
    "qwen3": ({"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32},
              "alpha-in-o_proj"),
    "gemma3": ({"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
               "alpha-in-norm-gain"),
}


def _norm_scopes(path, layer) -> set[str]:
    g = onnx.load(str(path), load_external_data=False).graph
    return {n.name.rsplit("/", 1)[0] for n in g.node
            if n.name.startswith(f"/model/layers.{layer}/self_attn/") and n.name.split("/")[4] in ("q_norm", "k_norm")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def export(request, tmp_path_factory):
    """(family, weights folder, ResolvedModel of a copy, an artifact store)."""
    from harp_trt.models import resolve_model

    family = request.param
    root = tmp_path_factory.mktemp(f"real-exports-{family}")
    folder = shutil.copytree(FIXTURES / family / "weights", root / "weights")
    return family, FIXTURES / family, resolve_model(str(folder), root), ArtifactStore(root / "store")


def _plan(family, resolved, layers=LAYERS, alphas=ALPHAS) -> Plan:
    return Plan(model_ref=str(resolved.folder), model_digest=resolved.digest, family=family, num_layers=4,
                strategy="given", layers=tuple(layers), alphas=tuple(alphas))


def test_fixtures_are_what_the_exporters_wrote():
    for family, (facts, _) in FAMILIES.items():
        versions = json.loads((FIXTURES / family / "VERSIONS.json").read_text())
        assert versions["exports"]["optimum"]["versions"]["optimum-onnx"] == "0.1.0"
        assert versions["exports"]["optimum"]["versions"]["transformers"].startswith("4.57")
        path = FIXTURES / family / "optimum" / "model.onnx"
        m = onnx.load(str(path))
        ops = [n.op_type for n in m.graph.node]
        assert m.opset_import[0].version == 18 and ops.count("Softmax") == 4 and "Attention" not in ops
        assert graph_facts(ir.load(str(path)).graph) == facts
        for layer in range(4):   # the QK-norm, decomposed, in every layer
            assert _norm_scopes(path, layer) == {f"/model/layers.{layer}/self_attn/{n}" for n in ("q_norm", "k_norm")}
        cfg = json.loads((FIXTURES / family / "weights" / "config.json").read_text())
        assert cfg["tie_word_embeddings"]
    qwen3 = json.loads((FIXTURES / "qwen3" / "weights" / "config.json").read_text())
    assert qwen3["num_attention_heads"] * qwen3["head_dim"] != qwen3["hidden_size"]
    gemma = json.loads((FIXTURES / "gemma3" / "VERSIONS.json").read_text())
    assert gemma["config"]["layer_types"][2] == "full_attention" and gemma["config"]["sliding_window"] == 8
    genai = gemma["exports"]["genai"]
    assert genai["exit_code"] != 0 and genai["outcome"] == "failed: KeyError: 'rope_type'"
    assert genai["versions"]["onnxruntime-genai"] == "0.18.0" and genai["versions"]["transformers"].startswith("5.")
    qwen = json.loads((FIXTURES / "qwen3" / "VERSIONS.json").read_text())["exports"]["genai"]
    assert qwen["exit_code"] == 0
    assert sum(p.stat().st_size for f in FAMILIES for p in (FIXTURES / f).rglob("*") if p.is_file()) < 4 * 2 ** 20


def test_dense_graph_equals_pytorch(export):
    """The feeding is right before any rewrite (optimum's Gemma3 graph takes no ``position_ids``, so
    its prompts are not left-padded)."""
    family, root, _, _ = export
    res = verify_rewrite(root / "optimum" / "model.onnx", root / "weights", {},
                         VerifyConfig(rtol=RTOL, decode_steps=2, greedy_steps=4))
    assert res.max_abs_diff <= res.tolerance and res.tolerance >= RTOL
    assert res.max_abs_diff < 1e-4  # fp32 at logits of ~30, measured ~2-3e-5
    assert res.pad == (3 if family == "qwen3" else 0)


def test_rewrite_real_export(export):
    family, root, resolved, store = export
    facts, mode = FAMILIES[family]
    src = root / "optimum" / "model.onnx"
    ins_before, outs_before = _io_names(src)
    art = RewriteStage().execute(store, RewriteConfig(rtol=RTOL, decode_steps=4, greedy_steps=8),
                                 {"plan": _plan(family, resolved), "onnx": src, "model": resolved}, force=True)
    out = art.path / "model.onnx"
    report = json.loads((art.path / REPORT).read_text())
    gone_in = [f"past_key_values.{i}.{k}" for i in LAYERS for k in ("key", "value")]
    gone_out = [f"present.{i}.{k}" for i in LAYERS for k in ("key", "value")]
    ins, outs = _io_names(out)
    assert art.manifest["kv_inputs_removed"] == gone_in and art.manifest["kv_inputs"] == 4
    assert ins == [n for n in ins_before if n not in gone_in]
    assert outs == [n for n in outs_before if n not in gone_out]
    assert [(r["layer"], r["alpha"], r["rule"], r["locator"], r["mode"]) for r in report["layers"]] == \
        [(l, a, "softmax-attention", "kv-input", mode) for l, a in zip(LAYERS, ALPHAS)]
    assert all((r["match"]["heads"], r["match"]["kv_heads"], r["match"]["head_dim"]) ==
               (4, 2, facts["head_dim"]) for r in report["layers"])
    assert report["source"] == {"harp_export": False, "graph_facts": facts}
    # Q, K and their norms are gone from the pruned layers; the kept layers keep theirs
    assert [bool(_norm_scopes(out, layer)) for layer in range(4)] == [True, True, False, False]
    check_onnx(out, full_check=True, strict_shapes=True)
    ver = report["verification"]
    assert ver["max_abs_diff"] <= ver["tolerance"] and ver["rtol"] == RTOL
    assert len(ver["per_step"]) == 5 and len(ver["tokens"][0]) == 8
    assert ver["max_abs_diff"] < 1e-4


def test_verification_fails_for_other_alphas(export, tmp_path):
    """The check can fail: the same graph against a HARP model with another alpha."""
    family, root, resolved, _ = export
    out = tmp_path / "model.onnx"
    rewrite_onnx(root / "optimum" / "model.onnx", _plan(family, resolved), out)
    with pytest.raises(VerificationError, match=r"output 'logits' at prefill: max \|diff\| .* > tolerance"):
        verify_rewrite(out, root / "weights", {2: 0.3, 3: 0.9}, VerifyConfig(rtol=RTOL, decode_steps=1, greedy_steps=1))
