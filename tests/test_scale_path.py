"""The quantized large-model ORT path on tiny models: per-weight packing byte-equal to ONNX
Runtime's MatMulNBitsQuantizer, exact compact storage, the probe check (numeric and structural),
pruning of consumed intermediates and the preflight refusal."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

from tests.conftest import save_tiny


def _mlp_model(seed: int = 0, k: int = 64, n: int = 128) -> ir.Model:
    """x [B, k] -> MatMul(W1 [k, n]) -> Relu -> MatMul(W2 [n, k]): two named weight MatMuls."""
    rng = np.random.default_rng(seed)
    x = ir.Value(name="x", shape=ir.Shape(["B", k]), type=ir.TensorType(ir.DataType.FLOAT))
    w1 = ir.Value(name="w1", const_value=ir.tensor(rng.standard_normal((k, n)).astype(np.float32), name="w1"))
    w2 = ir.Value(name="w2", const_value=ir.tensor(rng.standard_normal((n, k)).astype(np.float32), name="w2"))
    a = ir.node("MatMul", [x, w1], name="mm1")
    r = ir.node("Relu", [a.outputs[0]], name="relu")
    b = ir.node("MatMul", [r.outputs[0], w2], name="mm2")
    b.outputs[0].name = "y"
    b.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], [b.outputs[0]], nodes=[a, r, b], initializers=[w1, w2], opset_imports={"": 21})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("mode,symmetric,level", [("int4", True, 4), ("int8", True, 0), ("int4", False, 4)])
def test_per_weight_packing_equals_ort_quantizer(mode, symmetric, level):
    """Every initializer byte, name, node input and attribute equals MatMulNBitsQuantizer's."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from harp_trt.builders.ort.config import QuantSpec
    from harp_trt.builders.ort.quant import quantize_weights

    spec = QuantSpec(mode, 32, symmetric, level)
    ref = MatMulNBitsQuantizer(ir.serde.serialize_model(_mlp_model()), bits=spec.bits, block_size=32,
                               is_symmetric=symmetric, accuracy_level=level)
    ref.process()
    want = ref.model.model
    ours, report = quantize_weights(_mlp_model(), spec)
    got = ir.serde.serialize_model(ours)
    assert report["matmuls"] == 2
    init_w = {t.name: onnx.numpy_helper.to_array(t) for t in want.graph.initializer}
    init_g = {t.name: onnx.numpy_helper.to_array(t) for t in got.graph.initializer}
    assert sorted(init_g) == sorted(init_w)
    for name, arr in init_w.items():
        assert init_g[name].dtype == arr.dtype and init_g[name].shape == arr.shape, name
        assert init_g[name].tobytes() == arr.tobytes(), name
    nodes_w = [(n.op_type, n.domain, list(n.input), list(n.output), sorted(onnx.helper.printable_attribute(a)
                                                                           for a in n.attribute))
               for n in want.graph.node if n.op_type == "MatMulNBits"]
    nodes_g = [(n.op_type, n.domain, list(n.input), list(n.output), sorted(onnx.helper.printable_attribute(a)
                                                                           for a in n.attribute))
               for n in got.graph.node if n.op_type == "MatMulNBits"]
    assert nodes_g == nodes_w and len(nodes_g) == 2


def test_compact_storage_is_exact(tmp_path):
    """bf16-exact weights stored at half width behind Cast: the saved file runs in ORT with
    outputs bit-equal to the fp32 graph's, expands back to the same fp32 values, and a marked
    weight that is not exact refuses to save."""
    import onnxruntime as ort
    import ml_dtypes

    from harp_trt.compact import compact, expand, mark
    from harp_trt.errors import GraphError

    def model(exact: bool) -> ir.Model:
        m = _mlp_model()
        for v in m.graph.initializers.values():
            arr = v.const_value.numpy()
            if exact:
                arr = arr.astype(ml_dtypes.bfloat16).astype(np.float32)
            v.const_value = ir.tensor(arr, name=v.name)
            mark(v, "bfloat16")
        return m

    full, small = tmp_path / "full.onnx", tmp_path / "small.onnx"
    ir.save(model(True), full)
    m = model(True)
    assert compact(m) == 2
    ir.save(m, small)
    assert small.stat().st_size < 0.6 * full.stat().st_size
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    y_full = ort.InferenceSession(str(full), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    y_small = ort.InferenceSession(str(small), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.array_equal(y_full, y_small)  # tolerance 0: the cast is exact
    back = ir.load(small)
    assert expand(back) == 2 and not any(n.op_type == "Cast" for n in back.graph)
    ref = model(True)
    for name in ("w1", "w2"):
        assert np.array_equal(back.graph.initializers[name].const_value.numpy(),
                              ref.graph.initializers[name].const_value.numpy())
    bad = model(False)
    compact(bad)
    with pytest.raises(Exception) as err:  # onnx-ir's saver wraps it in SerdeError
        ir.save(bad, tmp_path / "bad.onnx")
    cause = err.value
    while cause is not None and not isinstance(cause, GraphError):
        cause = cause.__cause__
    assert cause is not None and "marked exact in bfloat16 but is not" in cause.message


def _layered(num_layers: int, vocab: int, odd: int | None = None) -> ir.Model:
    """A chain of per-layer MatMul+Add blocks named like an export (``model.layers.i``) between an
    embedding Gather and a head MatMul; ``odd``: that layer gets a Relu more."""
    d = 8
    ids = ir.Value(name="ids", shape=ir.Shape(["B"]), type=ir.TensorType(ir.DataType.INT64))
    emb = ir.Value(name="embed", const_value=ir.tensor(np.zeros((vocab, d), np.float32), name="embed"))
    nodes, inits = [ir.node("Gather", [emb, ids], name="model.embed_tokens/Gather")], [emb]
    h = nodes[-1].outputs[0]
    for i in range(num_layers):
        w = ir.Value(name=f"model.layers.{i}.w", const_value=ir.tensor(np.zeros((d, d), np.float32)))
        inits.append(w)
        mm = ir.node("MatMul", [h, w], name=f"model.layers.{i}.mlp/MatMul")
        add = ir.node("Add", [h, mm.outputs[0]], name=f"model.layers.{i}/Add")
        nodes += [mm, add]
        h = add.outputs[0]
        if i == odd:
            nodes.append(ir.node("Relu", [h], name=f"model.layers.{i}/Relu"))
            h = nodes[-1].outputs[0]
    head = ir.Value(name="head", const_value=ir.tensor(np.zeros((d, vocab), np.float32), name="head"))
    inits.append(head)
    nodes.append(ir.node("MatMul", [h, head], name="lm_head/MatMul"))
    return ir.Model(ir.Graph([ids], [nodes[-1].outputs[0]], nodes=nodes, initializers=inits,
                             opset_imports={"": 21}), ir_version=10)


def test_structure_check_catches_a_differing_layer():
    from harp_trt.errors import VerificationError
    from harp_trt.probe import check_structure, layer_signatures, probe_layers

    layers = probe_layers(12, {})
    assert layers == [0, 1, 11]
    probe = layer_signatures(_layered(len(layers), 64), 64)
    report = check_structure(_layered(12, 1000), probe, layers, {}, 12, 1000, "rewrite")
    assert report["layers_checked"] == 12 and report["by_form"] == {"kept": list(range(12))}
    with pytest.raises(VerificationError, match="layer 7 of the full graph differs in structure"):
        check_structure(_layered(12, 1000, odd=7), probe, layers, {}, 12, 1000, "rewrite")


@pytest.mark.slow
def test_probe_verifies_and_catches_a_broken_layer(tmp_path):
    """A bf16 tiny model's compact probe (layers 0, 1, 4, 5 of 6: kept first/middle, alpha 0.5 and
    alpha 0 pruned), rewritten by the same pass: within 1e-4 of PyTorch HARP; one folded weight
    off by 1 % fails the same check."""
    from harp_trt.errors import VerificationError
    from harp_trt.export.export import export_folder
    from harp_trt.plan import Plan
    from harp_trt.probe import probe_alphas, probe_layers, write_probe_folder
    from harp_trt.rewrite.stage import rewrite_onnx
    from harp_trt.verify import VerifyConfig, verify_rewrite

    folder = save_tiny("qwen2", tmp_path / "m", num_hidden_layers=6)
    from safetensors.torch import load_file, save_file

    f = next(folder.glob("*.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    alphas = {3: 0.5, 4: 0.0, 5: 0.5}
    layers = probe_layers(6, alphas)
    assert layers == [0, 1, 3, 4, 5]
    write_probe_folder(folder, layers, tmp_path / "probe", vocab=100)
    path = export_folder(tmp_path / "probe", tmp_path / "export", storage="compact")
    assert json.loads(ir.load(path).metadata_props["harp_trt.export"])["storage"] == "compact"
    pa = probe_alphas(layers, alphas)
    plan = Plan("m", "d", "qwen2", len(layers), "test", tuple(sorted(pa)), tuple(pa[k] for k in sorted(pa)))
    out = tmp_path / "rw" / "model.onnx"
    out.parent.mkdir()
    rewrite_onnx(path, plan, out)
    cfg = VerifyConfig(decode_steps=2, greedy_steps=2, prompt_len=6, pad=2)
    res = verify_rewrite(out, tmp_path / "probe", pa, cfg)
    assert res.max_abs_diff <= res.tolerance
    broken = ir.load(out)
    folded = [v for n, v in broken.graph.initializers.items() if n.startswith("harp.layers.2")]
    assert folded, "the alpha-0.5 layer has a folded weight"
    folded[0].const_value = ir.tensor(folded[0].const_value.numpy() * 1.01, name=folded[0].name)
    ir.save(broken, tmp_path / "broken.onnx")
    with pytest.raises(VerificationError, match="logits"):
        verify_rewrite(tmp_path / "broken.onnx", tmp_path / "probe", pa, cfg)


def test_pruned_artifact_is_kept_as_a_key_and_rebuilt_when_needed(tmp_path):
    from harp_trt.config import StageConfig
    from harp_trt.stage import Stage
    from harp_trt.store import ArtifactStore

    runs = []

    class Weights(Stage[StageConfig]):
        name = "toy"
        outputs = ("model.onnx",)
        intermediate = ("model.onnx",)

        def run(self, config, inputs, out_dir):
            runs.append(1)
            (Path(out_dir) / "model.onnx").write_bytes(b"w" * 100)
            (Path(out_dir) / "model.onnx.data").write_bytes(b"d" * 1000)
            return {}

    store = ArtifactStore(tmp_path / "cache")
    art = Weights().execute(store, StageConfig(), {})
    pruned = store.prune(art, Weights.intermediate)
    assert pruned.pruned and pruned.key == art.key
    assert not (art.path / "model.onnx").exists() and not (art.path / "model.onnx.data").exists()
    assert store.get(art.key).manifest["pruned"] == ["model.onnx", "model.onnx.data"]
    # the pipeline takes the pruned artifact as a hit (its key); anyone needing the files rebuilds
    assert Weights().execute(store, StageConfig(), {}, allow_pruned=True).pruned and len(runs) == 1
    again = Weights().execute(store, StageConfig(), {})
    assert len(runs) == 2 and not again.pruned and (again.path / "model.onnx.data").stat().st_size == 1000


def test_preflight_refuses_before_any_work(tmp_path, monkeypatch):
    """The estimate is computed from the model's real shapes; only the machine's free figures are
    replaced. Exit 2, a one-line reason, and nothing in the cache."""
    import harp_trt.preflight as pf
    from harp_trt.cli import main

    folder = save_tiny("qwen2", tmp_path / "m", num_hidden_layers=4)
    shapes = pf.read_shapes(folder)
    est = pf.estimate_onnx_build(shapes, 4, 32, compact=False, keep_intermediates=False)
    assert est.peak_disk > 2 * 4 * shapes.params  # export and rewrite at fp32 (the model is fp32)
    monkeypatch.setattr(pf, "free_resources", lambda cache: (64 << 30, est.peak_disk // 2))
    cache = tmp_path / "cache"
    code = main(["build", "--model", str(folder), "--quant", "int4", "--workdir", str(cache), "--json"])
    assert code == 2
    assert not list(cache.glob("*/manifest.json")) and not list((cache / ".tmp").iterdir())  # no artifact
    monkeypatch.setattr(pf, "free_resources", lambda cache: (est.peak_rss // 2, 1 << 50))
    assert main(["build", "--model", str(folder), "--quant", "int4", "--workdir", str(cache), "--json"]) == 2


@pytest.mark.slow
def test_second_quantized_build_drops_the_rebuilt_export_before_the_engine(tmp_path, capsys, monkeypatch):
    """An int4 build drops the export's and rewrite's weights once the engine is built; an int8 build
    of the same plan rebuilds both (same keys) and drops the export's again as soon as the rewrite is
    rebuilt, so the cache never holds export, rewrite and engine at once (at 7B: 15 + 15 + 10 GB).
    The rewrite checks its probe before writing the full graph and removes the probe's rewrite first;
    the build drops the rewrite's weights once its staged graph is written."""
    from harp_trt.builders.ort.builder import OrtBuildStage
    from test_calibrate_cli import run_json, write_corpus

    from safetensors.torch import load_file, save_file

    folder = save_tiny("qwen2", tmp_path / "tiny", seed=5)
    f = next(folder.glob("*.safetensors"))  # a bf16 checkpoint takes the compact (pruning) path
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    cmd = ["build", "--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
           "--corpus", str(write_corpus(tmp_path / "c.txt")), "--alpha-grid", "0,1",
           "--workdir", str(tmp_path / "cache"), "--json"]
    import harp_trt.rewrite.stage as rewrite_stage

    writes = []   # (graph written, whether a probe rewrite then sits in the cache)
    real_rewrite = rewrite_stage.rewrite_onnx

    def rewrite(src, plan, out, *a, **k):
        writes.append((Path(out).parent.name, any(Path(out).parents[1].glob("*/.probe/*"))))
        return real_rewrite(src, plan, out, *a, **k)

    monkeypatch.setattr(rewrite_stage, "rewrite_onnx", rewrite)
    from harp_trt.builders.ort.builder import OrtBuilder

    optimized = []   # whether the rewrite's weights were still in the cache when the engine was written
    real_optimize = OrtBuilder._optimize

    def optimize(src, *a, **k):
        optimized.append(any((tmp_path / "cache").glob("rewrite-*/model.onnx")))
        return real_optimize(src, *a, **k)

    monkeypatch.setattr(OrtBuilder, "_optimize", staticmethod(optimize))
    code, first, err = run_json(capsys, *cmd, "--quant", "int4")
    assert code == 0, err
    # the probe is rewritten and checked first; its rewrite is gone before the full graph is written
    assert [w[0] == ".probe" for w in writes] == [True, False] and writes[1][1] is False
    export, rewrite = (Path(first["stages"][s]["artifact"]) for s in ("export", "rewrite"))
    assert not (export / "model.onnx").exists() and not (rewrite / "model.onnx").exists()
    seen = {}
    real_run = OrtBuildStage.run

    def run(self, config, inputs, out_dir):
        seen["export"], seen["rewrite"] = (export / "model.onnx").exists(), (rewrite / "model.onnx").exists()
        return real_run(self, config, inputs, out_dir)

    monkeypatch.setattr(OrtBuildStage, "run", run)
    code, second, err = run_json(capsys, *cmd, "--quant", "int8")
    assert code == 0, err
    assert {"export:rebuilt", "rewrite:rebuilt"} <= set(second["stages"])
    assert seen == {"export": False, "rewrite": True}
    # the build released the rewrite once its staged graph was written (Hooks.release): both engines
    # were written with the rewrite's weights gone
    assert optimized == [False, False]
    assert not (export / "model.onnx").exists() and not (rewrite / "model.onnx").exists()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_optimize_without_prepacking_saves_the_same_engine(mode, tmp_path):
    """The build's optimize-and-save session runs with ``session.disable_prepacking`` (it never
    computes, so copying weights into kernel layouts is waste): the saved graph and weights are
    byte-identical to those of a session that prepacks (accuracy level 4, external weights)."""
    import onnxruntime as ort

    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig, QuantSpec
    from harp_trt.builders.ort.quant import quantize_weights

    model, _ = quantize_weights(_mlp_model(k=256, n=512), QuantSpec(mode, 32, True, 4))
    staged = tmp_path / "staged.onnx"
    ir.save(model, staged, external_data="staged.onnx.data")
    ours = tmp_path / "ours"
    ours.mkdir()
    OrtBuilder._optimize(staged, staged, ours / "model.onnx", OrtBuildConfig(), ["CPUExecutionProvider"], True)
    ref = tmp_path / "ref"
    ref.mkdir()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(ref / "model.onnx")
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "model.onnx.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(staged), so, providers=["CPUExecutionProvider"])
    for f in ("model.onnx", "model.onnx.data"):
        assert (ours / f).read_bytes() == (ref / f).read_bytes(), f
    assert (ref / "model.onnx.data").stat().st_size > 0
