"""Fitted maps through the ONNX rewrite: rrr's two GEMMs and lmmse's one GEMM and bias,
the rewritten graph against the PyTorch HARP model with the same map (the rewrite's own
verification: fp32 logits within 1e-4 of the logit scale, 32 equal greedy tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import FAMILY_NAMES, make_tiny
from harp_trt.calib.fit import FittedMap, hf_tensors
from harp_trt.dims import ModelDims
from harp_trt.errors import PreconditionError, VerificationError
from harp_trt.families import FAMILIES
from harp_trt.plan import FITTED_FILE, Plan
from harp_trt.rewrite.stage import REPORT, RewriteConfig, RewriteStage
from harp_trt.verify import verify_rewrite
from test_rewrite import _plan, exports  # noqa: F401  (a fixture)

FITTED_LAYER = 3


def _fitted_plan(folder: Path, resolved, family: str, method: str = "rrr", seed: int = 0, **shape) -> Plan:
    """A plan pruning layers 1 (alpha 0.7) and 3 (a random fitted map of ``method``), saved with its
    tensors as a calibrate artifact would be, and loaded back."""
    spec = FAMILIES.get(family)()
    d = ModelDims.from_config(make_tiny(family, seed=FAMILY_NAMES.index(family), **shape).config)
    r = d.kv_heads * d.head_dim
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: 0.08 * torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    fmap = (FittedMap("rrr", rnd(r, d.hidden), rnd(d.hidden, r), None, 0.0, 0.0, 0.0) if method == "rrr" else
            FittedMap("lmmse", rnd(d.hidden, d.hidden), None, rnd(d.hidden), 0.0, 0.0, 0.0))
    folder.mkdir(parents=True)
    save_file(hf_tensors(fmap, spec, d, FITTED_LAYER, torch.float32), str(folder / FITTED_FILE))
    base = _plan(resolved, family, (1, FITTED_LAYER), (0.7, 1.0))
    plan = Plan(**{**base.__dict__, "extra": {"replacement": {"method": method, "layers": [FITTED_LAYER],
                                                              "file": FITTED_FILE}}})
    plan.save(folder / "plan.json")
    return Plan.load(folder)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_rrr_rewrite_equals_pytorch_with_the_fitted_map(exports, family, tmp_path):  # noqa: F811
    """GQA (llama), a v bias (qwen2, zeroed by the map), the post-attention norm (gemma2): the
    rewrite's verification against PyTorch HARP with the map passes, the layer's mode says so, the
    rewrite artifact carries the tensors beside its plan.json, the graph has HARP's ops and weight
    shapes; and (llama) the same graph against HARP
    without the map fails verification (the map is really in the graph)."""
    store, export, resolved = exports(family)
    plan = _fitted_plan(tmp_path / "plan", resolved, family)
    art = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": plan, "model": resolved})
    man = art.manifest
    assert man["max_abs_diff"] <= man["tolerance"], man
    report = json.loads((art.path / REPORT).read_text())
    modes = {r["layer"]: r["mode"] for r in report["layers"]}
    assert modes[FITTED_LAYER] == "fitted-rrr" and modes[1] != "fitted-rrr"
    assert (art.path / FITTED_FILE).is_file() and Plan.load(art.path).fitted_tensors().keys() == plan.fitted_tensors().keys()
    # the same graph as HARP's for the same layers: op types in order and every weight's shape (so the
    # same cost in every engine built from it)
    import onnx_ir as ir
    from harp_trt.rewrite.stage import rewrite_onnx

    plain = tmp_path / "plain" / "model.onnx"
    plain.parent.mkdir()
    rewrite_onnx(export.path / "model.onnx", _plan(resolved, family, (1, FITTED_LAYER), (0.7, 1.0)), plain)
    shape = lambda g: ([n.op_type for n in g.graph], sorted(tuple(v.shape) for v in g.graph.initializers.values()))  # noqa: E731
    assert shape(ir.load(str(art.path / "model.onnx"))) == shape(ir.load(str(plain)))
    if family != "llama":
        return
    with pytest.raises(VerificationError):  # once: the map is in the graph, not HARP's V.O
        verify_rewrite(art.path / "model.onnx", make_tiny(family, seed=FAMILY_NAMES.index(family)), plan.alpha_map)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_lmmse_rewrite_equals_pytorch_with_the_fitted_map(exports, family, tmp_path):  # noqa: F811
    """lmmse (a hidden x hidden map with a bias) through the rewrite: one MatMul and one Add where HARP
    has V.O (before Gemma2's post-attention norm, as ``HarpAttention.harp_linear`` runs it), within
    the rewrite's own verification against PyTorch HARP with the map; and (llama) the graph against
    HARP without the map fails it."""
    import onnx_ir as ir

    store, export, resolved = exports(family)
    plan = _fitted_plan(tmp_path / "lm", resolved, family, method="lmmse")
    art = RewriteStage().execute(store, RewriteConfig(), {"export": export, "plan": plan, "model": resolved})
    assert art.manifest["max_abs_diff"] <= art.manifest["tolerance"], art.manifest
    report = json.loads((art.path / REPORT).read_text())
    layer = next(r for r in report["layers"] if r["layer"] == FITTED_LAYER)
    hidden = ModelDims.from_config(make_tiny(family).config).hidden
    assert layer["mode"] == "fitted-lmmse" and layer["params_added"] == hidden * hidden + hidden, layer
    graph = ir.load(str(art.path / "model.onnx")).graph
    ops = [n.op_type for n in graph if n.name.startswith(f"harp.layers.{FITTED_LAYER}/")]
    assert ops == ["MatMul", "Add"], ops
    if family != "llama":
        return
    with pytest.raises(VerificationError):
        verify_rewrite(art.path / "model.onnx", make_tiny(family, seed=FAMILY_NAMES.index(family)), plan.alpha_map)
    # the engines built from that graph: int8 ORT, then a genai folder whose greedy tokens the deploy
    # checks against that engine's own
    from harp_trt.builders.genai.stage import deploy_genai
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig

    OrtBuilder().build(art.path / "model.onnx", tmp_path / "engine", OrtBuildConfig(quant="int8", intra_op_threads=2))
    deploy_genai(tmp_path / "engine", tmp_path / "genai")
    assert json.loads((tmp_path / "genai" / "harp_genai.json").read_text())["verify"]["equal"]


def test_a_missing_map_is_refused(exports, tmp_path):  # noqa: F811
    """A plan whose map file is gone fails in one line (the GGUF and TensorRT-LLM writers refuse
    lmmse: tests/test_fit_targets.py)."""
    store, export, resolved = exports("llama")
    _fitted_plan(tmp_path / "rrr", resolved, "llama")
    (tmp_path / "rrr" / FITTED_FILE).unlink()
    from harp_trt.errors import ConfigError

    with pytest.raises(ConfigError, match=f"{FITTED_FILE} is missing"):
        Plan.load(tmp_path / "rrr").fitted_tensors()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rrr", "lmmse"])
def test_fitted_map_through_the_probe_path(tmp_path, method):
    """Quantized builds check a probe (harp_trt.probe: a few layers renumbered, bf16 compact export):
    the fitted map of original layer 4 is renamed onto probe layer 3 (``probe_fitted``) and the probe's
    rewrite equals PyTorch HARP with it (1e-4 of the logit scale), as ``check_probe`` runs them."""
    import onnx_ir as ir
    from safetensors.torch import load_file

    from conftest import save_tiny
    from harp_trt.export.export import export_folder
    from harp_trt.probe import probe_alphas, probe_fitted, probe_layers, write_probe_folder
    from harp_trt.rewrite.stage import rewrite_onnx
    from harp_trt.verify import VerifyConfig

    folder = save_tiny("qwen2", tmp_path / "m", num_hidden_layers=6)
    f = next(folder.glob("*.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    spec = FAMILIES.get("qwen2")()
    d = ModelDims.from_config(make_tiny("qwen2", num_hidden_layers=6).config)
    g = torch.Generator().manual_seed(3)
    r = d.kv_heads * d.head_dim
    rnd = lambda *shape: 0.08 * torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    fmap = (FittedMap("rrr", rnd(r, d.hidden), rnd(d.hidden, r), None, 0.0, 0.0, 0.0) if method == "rrr" else
            FittedMap("lmmse", rnd(d.hidden, d.hidden), None, rnd(d.hidden), 0.0, 0.0, 0.0))
    alphas = {3: 0.5, 4: 1.0, 5: 0.5}
    layers = probe_layers(6, alphas)
    fitted = probe_fitted(layers, hf_tensors(fmap, spec, d, 4, torch.float32), spec.layer_prefix)
    assert layers == [0, 1, 3, 4, 5] and all(k.startswith("model.layers.3.") for k in fitted)
    write_probe_folder(folder, layers, tmp_path / "probe", vocab=100)
    path = export_folder(tmp_path / "probe", tmp_path / "export", storage="compact")
    pa = probe_alphas(layers, alphas)
    plan = Plan("m", "d", "qwen2", len(layers), "test", tuple(sorted(pa)), tuple(pa[k] for k in sorted(pa)),
                extra={"replacement": {"method": method, "layers": [3], "file": FITTED_FILE}})
    out = tmp_path / "rw" / "model.onnx"
    out.parent.mkdir()
    report = rewrite_onnx(path, plan, out, fitted=fitted)
    assert {r["layer"]: r["mode"] for r in report["layers"]}[3] == f"fitted-{method}"
    weight = "harp.layers.3.v_proj.weight_fitted" if method == "rrr" else "harp.layers.3.harp_linear.weight"
    assert ir.load(out).graph.initializers[weight].const_value.dtype == ir.DataType.FLOAT
    cfg = VerifyConfig(decode_steps=2, greedy_steps=2, prompt_len=6, pad=2)
    res = verify_rewrite(out, tmp_path / "probe", pa, cfg, fitted=fitted)
    assert res.max_abs_diff <= res.tolerance
