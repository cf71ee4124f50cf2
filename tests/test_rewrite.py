"""The rewrite stage on real exports of tiny random Llama, Mistral, Qwen2 and Gemma2 models:
rewrite, verify in ONNX Runtime against the PyTorch HARP model, KV I/O, dead Q/K, alpha = 0,
non-contiguous layers, the GQA fold, caching, external data, the CLI and the error paths."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import ALL_FAMILIES, FAMILY_NAMES, make_tiny, save_tiny
from harp_trt.errors import (ConfigError, GraphError, PreconditionError, VerificationError)
from harp_trt.plan import Plan
from harp_trt.fold import fold_o_proj
from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage, rewrite_onnx
from harp_trt.store import ArtifactStore

# per family: pruned layers and alphas (non-contiguous sets, alpha = 0 and alpha = 1 included)
PLANS = {
    "llama": ((0, 2), (0.5, 1.0)),
    "mistral": ((1, 3), (0.7, 0.0)),
    "qwen2": ((1, 2), (0.4, 0.9)),
    "gemma2": ((0, 3), (0.6, 0.0)),
    "qwen3": ((1, 3), (0.8, 0.0)),
    "gemma3": ((2, 3), (0.6, 1.0)),   # a pruned global layer (2) and a pruned local one (3)
}
NUM_LAYERS = 4


def _perturb_biases(folder: Path, family: str, seed: int) -> None:
    """Qwen2's random init leaves q/k/v biases at 0; give them values so the kept v bias matters."""
    if family != "qwen2":
        return
    model = make_tiny(family, seed=seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("proj.bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models run fastest single-threaded; on a busy 2-core machine OpenMP spinning made
    each 64-wide linear cost ~15 ms."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """family -> (store, export artifact, resolved model); one export per family per module."""
    from harp_trt.models import resolve_model
    from harp_trt.export.export import ExportConfig, ExportStage

    root = tmp_path_factory.mktemp("rewrite")
    store = ArtifactStore(root / "cache")
    out = {}

    def get(family):
        if family not in out:
            # distinct seeds: same-shaped Llama and Mistral weights would share a weight digest
            seed = ALL_FAMILIES.index(family)
            folder = save_tiny(family, root / family, seed=seed)
            _perturb_biases(folder, family, seed)
            resolved = resolve_model(str(folder), store.root)
            art = ExportStage().execute(store, ExportConfig(), {"model": resolved})
            out[family] = (store, art, resolved)
        return out[family]

    return get


def _plan(resolved, family, layers, alphas, num_layers=NUM_LAYERS) -> Plan:
    return Plan(model_ref=str(resolved.folder), model_digest=resolved.digest, family=family,
                num_layers=num_layers, strategy="top", layers=tuple(layers), alphas=tuple(alphas))


def _qk_weights(path: Path, layers) -> set[str]:
    """Names of the 2-D Q/K projection weights of ``layers`` in an exported graph, from torch's
    name-scope metadata (independent of the rules, which locate blocks structurally)."""
    m = onnx.load(str(path))
    inits = {i.name: i for i in m.graph.initializer}
    out = set()
    for node in m.graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
        for l in layers:
            if f"layers.{l}.self_attn.q_proj'" in scopes or f"layers.{l}.self_attn.k_proj'" in scopes:
                out |= {i for i in node.input if i in inits and len(inits[i].dims) == 2}
    return out


def _harp_params(folder, family: str, alpha: float) -> tuple[int, int]:
    """(parameters HARP removes, parameters the edit replaces by folded copies) in one pruned
    layer, from the model's config.json alone: Q and K projections (+ biases for Qwen2); at
    alpha = 0 also V, o_proj, the input norm gain and Gemma2's post-attention norm gain; otherwise
    o_proj is replaced
    (and Gemma2's post-attention norm gain when alpha != 1)."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // h
    bias = family == "qwen2"
    q, k, v, o = d * h * hd + bias * h * hd, d * kv * hd + bias * kv * hd, d * kv * hd + bias * kv * hd, h * hd * d
    from harp_trt.families import FAMILIES

    q += hd if FAMILIES.get(family).qk_norm else 0   # the per-head Q/K RMSNorm gains go with Q and K
    k += hd if FAMILIES.get(family).qk_norm else 0
    sandwich = FAMILIES.get(family).alpha_after_post_attn_norm   # Gemma2, Gemma3
    gain = d if sandwich else 0
    if alpha == 0.0:
        return q + k + v + o + d + gain, 0
    return q + k, o + (gain if alpha != 1.0 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_rewrite_and_verify(exports, family):
    store, export, resolved = exports(family)
    layers, alphas = PLANS[family]
    plan = _plan(resolved, family, layers, alphas)
    art = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": plan, "model": resolved})
    assert not art.cached
    man = art.manifest
    # verification: fp32 logits within rtol * max(1, max|logits|), 32 identical greedy tokens
    assert man["max_abs_diff"] <= man["tolerance"] <= 1e-4 * 10
    assert man["max_abs_diff"] < 1e-5
    report = json.loads((art.path / REPORT).read_text())
    ver = report["verification"]
    assert ver["decode_steps"] == 16 and len(ver["per_step"]) == 17 and ver["greedy_steps"] == 32
    assert len(ver["tokens"][0]) == 32
    # KV I/O: the pruned layers' inputs and outputs are gone, the others stay
    g = onnx.load(str(art.path / "model.onnx"))
    kv_in = sorted(i.name for i in g.graph.input if i.name.startswith("past_key_values"))
    kv_out = sorted(o.name for o in g.graph.output if o.name.startswith("present"))
    kept = [l for l in range(NUM_LAYERS) if l not in layers]
    assert kv_in == sorted(f"past_key_values.{l}.{t}" for l in kept for t in ("key", "value"))
    assert kv_out == sorted(f"present.{l}.{t}" for l in kept for t in ("key", "value"))
    assert man["kv_inputs"] == 2 * len(kept)
    # no Q/K projection weights of pruned layers remain; the kept layers' are untouched
    src = export.path / "model.onnx"
    names = {i.name for i in g.graph.initializer}
    assert _qk_weights(src, layers) and not (_qk_weights(src, layers) & names)
    assert _qk_weights(src, kept) <= names
    cores = sum(n.op_type in ("Attention", "Softmax") for n in g.graph.node)
    assert cores == len(kept)
    # report: per layer rule, mode, removed/added
    by_layer = {r["layer"]: r for r in report["layers"]}
    assert sorted(by_layer) == list(layers)
    for l, a in zip(layers, alphas):
        r = by_layer[l]
        assert r["locator"] == "kv-input"
        assert r["rule"] == ("softmax-attention" if family == "gemma2" else "onnx-attention")
        assert r["kv_inputs_removed"] == [f"past_key_values.{l}.key", f"past_key_values.{l}.value"]
        if a == 0.0:
            assert r["mode"] == "removed" and r["params_added"] == 0
        else:
            sandwich = family in ("gemma2", "gemma3")   # alpha after the post-attention norm
            assert r["mode"] == ("alpha-in-norm-gain" if sandwich else "alpha-in-o_proj")
            hd = 32 if family == "qwen3" else 16   # Qwen3's head_dim is its own (tiny: 4 x 32 != hidden 64)
            assert r["match"]["heads"] == 4 and r["match"]["kv_heads"] == 2 and r["match"]["head_dim"] == hd
            # folded W_O is kv_dim x hidden = 2 hd x 64 (+ the Gemma2 gain of 64)
            assert r["params_added"] == 2 * hd * 64 + (64 if sandwich and a != 1.0 else 0)
        assert r["params_removed"] > 0 and r["nodes_removed"] > 10
        # HARP's own removals counted from the config; what else the sweep took is counted apart
        assert (r["harp_params_removed"], r["params_replaced"]) == _harp_params(resolved.folder, family, a)
        assert r["params_removed"] == r["harp_params_removed"] + r["params_replaced"] + r["cleanup_params"]
        assert r["cleanup_params"] < 64, r["cleanup_initializers"]  # shape constants, never a weight
    harp = sum(_harp_params(resolved.folder, family, a)[0] for a in alphas)
    assert report["params_removed"] == report["harp"]["params_removed"] == man["removed_params"] == harp
    assert report["harp"]["kv_inputs_removed"] == [f"past_key_values.{l}.{t}" for l in layers for t in ("key", "value")]
    assert report["params_net_change"] == report["params_before"] - report["params_after"] == \
        harp + report["harp"]["params_replaced"] + report["cleanup"]["params"] - report["harp"]["params_added"]
    # the artifact carries the plan and the tokenizer; a second run is a cache hit
    assert Plan.load(art.path / "plan.json") == plan
    assert (art.path / "tokenizer.json").is_file()
    again = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": plan, "model": resolved})
    assert again.cached and again.key == art.key


def test_fold_is_exact_for_gqa():
    """o_proj(repeat_kv(v)) == v @ fold(W_O) for every grouping (harp_trt/fold.py)."""
    rng = np.random.default_rng(0)
    for heads, kv, hd in [(4, 4, 8), (4, 2, 8), (9, 3, 64), (8, 1, 4)]:
        w_o = rng.standard_normal((heads * hd, 24))
        v = rng.standard_normal((5, kv * hd))
        v_rep = np.repeat(v.reshape(5, kv, 1, hd), heads // kv, axis=2).reshape(5, heads * hd)
        folded = fold_o_proj(w_o, heads, kv, hd)
        assert folded.shape == (kv * hd, 24)
        np.testing.assert_allclose(v @ folded, v_rep @ w_o, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="not a multiple"):
        fold_o_proj(np.zeros((32, 8)), 4, 3, 8)
    with pytest.raises(ValueError, match="expected 4 heads x 4"):
        fold_o_proj(np.zeros((32, 8)), 4, 2, 4)


@pytest.mark.slow
def test_external_data_round_trip(exports, tmp_path):
    """A graph stored with external data is read with it, and a large result is written with it."""
    import onnx_ir as ir

    from harp_trt.verify import verify_rewrite

    store, export, resolved = exports("llama")
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    ir.save(ir.load(str(export.path / "model.onnx")), str(src), external_data="model.onnx.data")
    assert (src.parent / "model.onnx.data").stat().st_size > 100_000
    plan = _plan(resolved, "llama", (1, 2), (0.3, 0.8))
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    report = rewrite_onnx(src, plan, out, external_data_mb=0)  # force external data
    assert report["external_data"] and (out.parent / "model.onnx.data").is_file()
    proto = onnx.load(str(out), load_external_data=False)
    external = [i for i in proto.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
    assert sum(np.prod(i.dims) for i in external) * 4 == (out.parent / "model.onnx.data").stat().st_size
    assert "harp.layers.1.o_proj.weight_vo_fold" in {i.name for i in external}
    model = make_tiny("llama", seed=FAMILY_NAMES.index("llama"))
    res = verify_rewrite(out, model, plan.alpha_map)
    assert res.max_abs_diff <= res.tolerance


@pytest.mark.slow
def test_verification_failure_names_output_step_and_diff(exports, tmp_path):
    from harp_trt.verify import verify_rewrite

    store, export, resolved = exports("llama")
    plan = _plan(resolved, "llama", (1,), (0.5,))
    out = tmp_path / "model.onnx"
    rewrite_onnx(export.path / "model.onnx", plan, out)
    with pytest.raises(VerificationError, match=r"output 'logits' at prefill: max \|diff\| [0-9.e-]+ > tolerance"):
        verify_rewrite(out, make_tiny("llama", seed=FAMILY_NAMES.index("llama")), {1: 0.9})  # the reference uses another alpha


@pytest.mark.slow
def test_stage_failure_leaves_no_artifact(exports):
    store, export, resolved = exports("mistral")
    plan = _plan(resolved, "mistral", (2,), (0.5,))
    before = {a.key for a in store.list()}
    with pytest.raises(VerificationError, match=r"'logits' at prefill"):
        # 1e-12 x max|logits| is below fp32 rounding: the check must fail, and nothing be kept
        RewriteStage().execute(store, RewriteConfig(rtol=1e-12), {"export": export, "plan": plan, "model": resolved})
    assert {a.key for a in store.list()} == before
    assert not any((store.root / ".tmp").iterdir())


@pytest.mark.slow
def test_bad_inputs_are_typed_errors(exports, tmp_path):
    store, export, resolved = exports("llama")
    stage = RewriteStage()
    inputs = {"export": export, "model": resolved}
    other = _plan(resolved, "llama", (1,), (0.5,)).to_dict() | {"model_digest": "0" * 64}
    with pytest.raises(PreconditionError, match=r"\[rewrite\] the graph's model \(digest [0-9a-f]{12}\.\.\.\) is not the model the plan was calibrated on \(digest 000000000000\.\.\.\)"):
        stage.execute(store, RewriteConfig(verify=False), {**inputs, "plan": Plan.from_dict(other)})
    deeper = _plan(resolved, "llama", (4,), (0.5,), num_layers=6)
    with pytest.raises(PreconditionError, match=r"plan is for a 6-layer model but the graph has 4 layers"):
        stage.execute(store, RewriteConfig(verify=False), {**inputs, "plan": deeper})
    with pytest.raises(ConfigError, match=r"out of range 0..3"):
        _plan(resolved, "llama", (4,), (0.5,))
    # a truncated file, and a graph without the export's metadata whose depth does not match
    broken = tmp_path / "broken.onnx"
    data = (export.path / "model.onnx").read_bytes()
    broken.write_bytes(data[: len(data) // 3])
    plan = _plan(resolved, "llama", (1,), (0.5,))
    with pytest.raises(GraphError, match=r"broken.onnx"):
        stage.execute(store, RewriteConfig(verify=False), {"onnx": broken, "plan": plan})
    m = onnx.load(str(export.path / "model.onnx"))
    del m.metadata_props[:]
    bare = tmp_path / "bare.onnx"
    onnx.save(m, str(bare))
    with pytest.raises(PreconditionError, match=r"graph has 4 attention layers but the plan is for a 5-layer model"):
        stage.execute(store, RewriteConfig(verify=False),
                      {"onnx": bare, "plan": _plan(resolved, "llama", (1,), (0.5,), num_layers=5)})
    assert not [a for a in store.list() if a.stage == "rewrite" and a.manifest["layers"] == [4]]
    # without the metadata there is no digest to compare: the graph's own facts against --model's
    # config decide, and the plan's model is not refused
    art = stage.execute(store, RewriteConfig(verify=False), {"onnx": bare, "plan": plan, "model": resolved})
    src = json.loads((art.path / REPORT).read_text())["source"]
    assert src["harp_export"] is False
    assert src["graph_facts"] == {"num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
                                  "head_dim": 16}
    assert art.manifest["kv_inputs_removed"] == ["past_key_values.1.key", "past_key_values.1.value"]


@pytest.mark.slow
def test_cli_model_and_onnx_paths(exports, tmp_path, capsys):
    from harp_trt.cli import main

    store, export, resolved = exports("qwen2")
    plan_path = tmp_path / "plan.json"
    _plan(resolved, "qwen2", (0, 3), (0.25, 0.75)).save(plan_path)
    argv = ["rewrite", "--model", str(resolved.folder), "--plan", str(plan_path), "--workdir",
            str(store.root), "--json", "--greedy-steps", "8", "--decode-steps", "4"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) >= {"artifact", "onnx", "layers", "alphas", "kv_inputs", "removed_params", "max_abs_diff", "cached"}
    assert out["layers"] == [0, 3] and out["alphas"] == [0.25, 0.75] and out["kv_inputs"] == 4
    assert out["max_abs_diff"] < 1e-5 and out["removed_params"] > 0 and not out["cached"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cached"] is True
    # a user's own graph
    mine = tmp_path / "mine" / "model.onnx"
    mine.parent.mkdir()
    shutil.copy(export.path / "model.onnx", mine)
    assert main(["rewrite", "--onnx", str(mine), "--plan", str(plan_path), "--workdir", str(store.root),
                 "--json", "--greedy-steps", "4", "--decode-steps", "2"]) == 0
    out2 = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out2["kv_inputs"] == 4 and out2["artifact"] != out["artifact"]
    # a plan for other weights: one-line error, exit code 2
    bad = tmp_path / "bad.json"
    Plan.from_dict(Plan.load(plan_path).to_dict() | {"model_digest": "f" * 64}).save(bad)
    assert main(["rewrite", "--model", str(resolved.folder), "--plan", str(bad), "--workdir", str(store.root)]) == 2
    assert "is not the model the plan was calibrated on (digest ffffffffffff...)" in capsys.readouterr().err


@pytest.mark.slow
def test_every_layer_pruned(exports, tmp_path):
    """With no KV cache left, the export's Shape(past_key_values.*) reads of batch size and past
    length are re-derived from input_ids / attention_mask; the graph needs no past inputs."""
    import onnxruntime as ort

    from harp_trt.harp import apply_harp

    store, export, resolved = exports("llama")
    alphas = (0.5, 0.0, 0.25, 1.0)
    plan = _plan(resolved, "llama", range(NUM_LAYERS), alphas)
    out = tmp_path / "model.onnx"
    report = rewrite_onnx(export.path / "model.onnx", plan, out)
    assert report["kv_inputs"] == 0
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "position_ids"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    ids = np.array([[5, 6, 7, 8, 9], [0, 0, 1, 2, 3]], np.int64)
    mask = np.array([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], np.int64)
    pos = (mask.cumsum(-1) - 1).clip(min=0)
    got = sess.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": pos})[0]
    model = apply_harp(make_tiny("llama", seed=FAMILY_NAMES.index("llama")), dict(enumerate(alphas)))
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                    position_ids=torch.from_numpy(pos), use_cache=False).logits.numpy()
    assert np.abs(got - ref)[mask > 0].max() < 1e-5
