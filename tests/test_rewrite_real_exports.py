"""The HARP rewrite on graphs written by the exporters users run, not by this project:

* ``optimum``: ``optimum-cli export onnx --task text-generation-with-past`` (optimum-onnx 0.1.0,
  transformers 4.57: opset 18, torch SDPA decomposed with ``sqrt(scale)`` on Q and on K^T,
  ``IsNaN``/``Where`` guards after the softmax, constants as ``Constant`` nodes);
* ``genai``: the onnxruntime-genai 0.18 model builder, fp32 CPU (``com.microsoft::GroupQueryAttention``
  with packed QKV and rotary inside the op, ``SkipSimplifiedLayerNormalization`` residuals,
  no ``position_ids``, weights in ``model.onnx.data``).

Both export the same tiny random Llama (``fixtures/real_exports``, made by ``make_fixtures.py``;
versions and commands in its ``VERSIONS.json``). Each graph is rewritten with a plan pruning the
top two layers (alphas 0.3, 0.7), and the result is checked: the pruned layers' KV inputs and
outputs are gone and no others, the graph passes ``onnx.checker`` (full) and strict shape
inference, and in ONNX Runtime its logits equal the PyTorch HARP model's (``harp.apply_harp``)
on prefill and 4 decode steps within ``1e-4 x max(1, max|logits|)`` (fp32), with 8 identical
greedy tokens."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest

from harp_trt.errors import PreconditionError, VerificationError
from harp_trt.plan import Plan
from harp_trt.rewrite.graph import check_onnx
from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage, check_foreign_graph, graph_facts
from harp_trt.verify import VerifyConfig, verify_rewrite
from harp_trt.store import ArtifactStore

FIXTURES = Path(__file__).parent / "fixtures" / "real_exports"
WEIGHTS = FIXTURES / "tiny-llama"
LAYERS, ALPHAS = (2, 3), (0.3, 0.7)
RTOL = 1e-4
FACTS = {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
# exporter -> (rule that must match, how the cores were located, KV tensors' order in the graph)
EXPORTERS = {"optimum": ("softmax-attention", "kv-input"), "genai": ("group-query-attention", "kv-input")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ResolvedModel of a copy of the fixture weights, an artifact store). A copy: resolving a
    folder writes its digest file there, and the fixtures stay as committed."""
    from harp_trt.models import resolve_model

    root = tmp_path_factory.mktemp("real-exports")
    folder = shutil.copytree(WEIGHTS, root / "tiny-llama")
    return resolve_model(str(folder), root), ArtifactStore(root / "store")


def _plan(resolved, layers=LAYERS, alphas=ALPHAS, num_layers=4) -> Plan:
    return Plan(model_ref=str(resolved.folder), model_digest=resolved.digest, family="llama",
                num_layers=num_layers, strategy="given", layers=tuple(layers), alphas=tuple(alphas))


def _io_names(path: Path) -> tuple[list[str], list[str]]:
    g = onnx.load(str(path), load_external_data=False).graph
    return [i.name for i in g.input], [o.name for o in g.output]


def test_fixtures_are_what_the_exporters_wrote():
    """The fixtures keep the features that made the rewrite fail on real exports (if a re-made
    fixture lost them, the tests below would no longer test those forms)."""
    versions = json.loads((FIXTURES / "VERSIONS.json").read_text())
    assert versions["exports"]["optimum"]["versions"]["optimum-onnx"] == "0.1.0"
    assert versions["exports"]["genai"]["versions"]["onnxruntime-genai"] == "0.18.0"
    opt = onnx.load(str(FIXTURES / "optimum" / "model.onnx"))
    ops = [n.op_type for n in opt.graph.node]
    assert opt.opset_import[0].version == 18 and ops.count("Softmax") == 4 and ops.count("IsNaN") == 4
    assert "Attention" not in ops and ops.count("Constant") > 100
    assert not any(p.key.startswith("harp_trt") for p in opt.metadata_props)
    gen = onnx.load(str(FIXTURES / "genai" / "model.onnx"), load_external_data=False)
    gqa = [n for n in gen.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 4 and all(n.input[1] == "" and n.input[2] == "" for n in gqa)  # packed QKV
    assert all(n.input[7] == "cos_cache" for n in gqa)                                 # rotary inside
    assert "position_ids" not in [i.name for i in gen.graph.input]
    llama = [p for d in ("tiny-llama", "optimum", "genai") for p in (FIXTURES / d).rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in llama) < 5 * 2 ** 20


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
def test_dense_graph_equals_pytorch(exporter):
    """The feeding is right before any rewrite: the exported graph equals the dense model."""
    res = verify_rewrite(FIXTURES / exporter / "model.onnx", WEIGHTS, {},
                         VerifyConfig(rtol=RTOL, decode_steps=2, greedy_steps=4))
    assert res.max_abs_diff <= res.tolerance and res.tolerance >= RTOL
    assert res.max_abs_diff < 1e-5  # fp32, measured ~4e-6
    assert res.pad == (3 if exporter == "optimum" else 0)  # GQA graphs take no left padding


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
def test_rewrite_real_export(exporter, tiny):
    resolved, store = tiny
    rule, locator = EXPORTERS[exporter]
    src = FIXTURES / exporter / "model.onnx"
    assert graph_facts(ir.load(str(src)).graph) == FACTS
    ins_before, outs_before = _io_names(src)
    art = RewriteStage().execute(store, RewriteConfig(rtol=RTOL, decode_steps=4, greedy_steps=8),
                                 {"plan": _plan(resolved), "onnx": src, "model": resolved}, force=True)
    out = art.path / "model.onnx"
    report = json.loads((art.path / REPORT).read_text())
    man = art.manifest
    # the pruned layers' KV I/O, and nothing else, is gone
    gone_in = [f"past_key_values.{i}.{k}" for i in LAYERS for k in ("key", "value")]
    gone_out = [f"present.{i}.{k}" for i in LAYERS for k in ("key", "value")]
    ins, outs = _io_names(out)
    assert man["kv_inputs_removed"] == gone_in
    assert [n for r in report["layers"] for n in r["kv_outputs_removed"]] == gone_out
    assert ins == [n for n in ins_before if n not in gone_in]
    assert outs == [n for n in outs_before if n not in gone_out]
    assert man["kv_inputs"] == 4
    assert [(r["layer"], r["alpha"], r["rule"], r["locator"], r["mode"]) for r in report["layers"]] == \
        [(l, a, rule, locator, "alpha-in-o_proj") for l, a in zip(LAYERS, ALPHAS)]
    assert all((r["match"]["heads"], r["match"]["kv_heads"], r["match"]["head_dim"]) == (4, 2, 16)
               for r in report["layers"])
    assert report["source"] == {"harp_export": False, "graph_facts": FACTS}
    # no attention core left for the pruned layers, the kept ones untouched
    g = onnx.load(str(out), load_external_data=False).graph
    cores = [n.name for n in g.node if n.op_type in ("Softmax", "GroupQueryAttention")]
    assert len(cores) == 2 and not any(f"layers.{l}/" in n for n in cores for l in LAYERS)
    check_onnx(out, full_check=True, strict_shapes=True)
    # ORT vs PyTorch HARP, prefill + 4 decode steps, 8 greedy tokens (RewriteStage ran it too)
    ver = report["verification"]
    assert ver["max_abs_diff"] <= ver["tolerance"] and ver["rtol"] == RTOL
    assert len(ver["per_step"]) == 5 and len(ver["tokens"][0]) == 8
    assert 0.1 < ver["tolerance"] / RTOL < 100  # the logit scale the tolerance is relative to
    assert ver["max_abs_diff"] < 1e-5           # what fp32 gives here (measured ~4e-6)


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
def test_every_layer_pruned(exporter, tiny, tmp_path):
    """No KV cache left: optimum's ``Shape(past_key_values.0.key)`` -> ``Gather`` reads of the
    past length are re-derived from ``input_ids``/``attention_mask``; alpha 0 and 1 included."""
    resolved, _ = tiny
    from harp_trt.rewrite.stage import rewrite_onnx

    alphas = {0: 0.5, 1: 0.0, 2: 1.0, 3: 0.25}
    out = tmp_path / "model.onnx"
    report = rewrite_onnx(FIXTURES / exporter / "model.onnx", _plan(resolved, alphas, alphas.values()), out)
    assert report["kv_inputs"] == 0 and report["kv_inputs_after"] == 0
    assert [r["mode"] for r in report["layers"]] == ["alpha-in-o_proj", "removed", "alpha-in-o_proj",
                                                     "alpha-in-o_proj"]
    ins, outs = _io_names(out)
    assert outs == ["logits"] and not [n for n in ins if n.startswith("past")]
    res = verify_rewrite(out, WEIGHTS, alphas, VerifyConfig(rtol=RTOL, decode_steps=3, greedy_steps=4))
    assert res.max_abs_diff <= res.tolerance and res.max_abs_diff < 1e-5


@pytest.mark.parametrize("exporter", sorted(EXPORTERS))
def test_verification_fails_for_other_alphas(exporter, tiny, tmp_path):
    """The check can fail: the same graph against a HARP model with another alpha."""
    resolved, _ = tiny
    from harp_trt.rewrite.stage import rewrite_onnx

    out = tmp_path / "model.onnx"
    rewrite_onnx(FIXTURES / exporter / "model.onnx", _plan(resolved), out)
    with pytest.raises(VerificationError, match=r"output 'logits' at prefill: max \|diff\| .* > tolerance"):
        verify_rewrite(out, WEIGHTS, {2: 0.3, 3: 0.9}, VerifyConfig(rtol=RTOL, decode_steps=1, greedy_steps=1))


def test_foreign_plan_check(tiny, tmp_path):
    """Without harp-trt metadata the graph's depth, width and heads decide against the plan and
    the model's config; a matching model passes (previous behaviour: refused as 'a different model')."""
    resolved, store = tiny
    cfg = json.loads((WEIGHTS / "config.json").read_text())
    check_foreign_graph(_plan(resolved), FACTS, cfg, "tiny")  # the right model: no error
    with pytest.raises(PreconditionError, match=r"graph has 4 attention layers but the plan is for a 6-layer model"):
        check_foreign_graph(_plan(resolved, (5,), (0.5,), num_layers=6), FACTS, None)
    with pytest.raises(PreconditionError, match=r"not an export of other: graph has hidden_size 64 \(model: 128\), "
                                                 r"head_dim 16 \(model: 32\)"):
        check_foreign_graph(_plan(resolved), FACTS, {**cfg, "hidden_size": 128, "head_dim": 32}, "other")
    # through the stage: a plan and --model of another model (its own digest, so the plan-vs-model
    # check passes) with this graph are refused by what the graph tells, before any rewrite
    other = tmp_path / "other"
    shutil.copytree(WEIGHTS, other)
    (other / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 4}))
    from harp_trt.models import resolve_model

    wrong = resolve_model(str(other), tmp_path)
    before = {a.key for a in store.list()}
    with pytest.raises(PreconditionError, match=r"num_kv_heads 2 \(model: 4\)"):
        RewriteStage().execute(store, RewriteConfig(verify=False),
                               {"plan": _plan(wrong), "onnx": FIXTURES / "genai" / "model.onnx", "model": wrong})
    assert {a.key for a in store.list()} == before


def test_cli_rewrites_a_real_export(tiny, tmp_path, capsys):
    """``harp-trt rewrite --onnx FILE --plan PLAN`` on optimum's export: the command of the issue
    report, which printed 'the plan belongs to a different model' and exited 2."""
    from harp_trt.cli import main

    resolved, store = tiny
    plan_path = tmp_path / "plan.json"
    _plan(resolved).save(plan_path)
    argv = ["rewrite", "--onnx", str(FIXTURES / "optimum" / "model.onnx"), "--plan", str(plan_path),
            "--workdir", str(store.root), "--json", "--greedy-steps", "4", "--decode-steps", "2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["layers"] == list(LAYERS) and out["alphas"] == list(ALPHAS) and out["kv_inputs"] == 4
    assert out["max_abs_diff"] <= out["tolerance"] and out["max_abs_diff"] < 1e-5
    # the plan of a 6-layer model with this 4-layer graph: one-line error, exit code 2
    Plan.from_dict(_plan(resolved).to_dict() | {"num_layers": 6}).save(plan_path)
    assert main(argv) == 2
    assert "graph has 4 attention layers but the plan is for a 6-layer model" in capsys.readouterr().err
