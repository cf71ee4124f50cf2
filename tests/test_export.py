"""Dense ONNX export: the I/O contract, numerics vs PyTorch for every family, HARP-patched models,
metadata, the cached ExportStage and typed errors."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from _export_check import verify_export
from _exported import HARP_ALPHAS, exported, head_dim, tiny
from conftest import save_tiny
from harp_trt.errors import ConfigError, GraphError, PreconditionError
from harp_trt.export.config import ExportConfig
from harp_trt.export.export import ExportStage, export_dense
from harp_trt.onnx_io import EXPORT_META_KEY, input_names, output_names, read_export_meta
from harp_trt.store import ArtifactStore

ATOL = 1e-4  # fp32 logits of tiny models: ORT vs PyTorch differ by ~3e-7; 1e-4 leaves headroom


def _dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.mark.slow
def test_io_contract(family):
    m = onnx.load(str(exported(family)), load_external_data=False)
    layers = list(range(4))
    assert [i.name for i in m.graph.input] == input_names(layers)
    assert [o.name for o in m.graph.output] == output_names(layers)
    ins = {i.name: i for i in m.graph.input}
    outs = {o.name: o for o in m.graph.output}
    assert _dims(ins["input_ids"]) == ["batch", "seq"]
    assert ins["input_ids"].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert _dims(ins["attention_mask"])[0] == "batch" and isinstance(_dims(ins["attention_mask"])[1], str)
    assert _dims(ins["position_ids"]) == ["batch", "seq"]
    assert _dims(ins["past_key_values.2.value"]) == ["batch", 2, "past", head_dim(family)]
    assert _dims(outs["logits"]) == ["batch", "seq", 128]
    pk = _dims(outs["present.3.key"])
    assert pk[0] == "batch" and pk[1:2] == [2] and pk[3] == head_dim(family) and isinstance(pk[2], str)
    assert not (exported(family).parent / "model.onnx.data").exists()  # small: self-contained


def test_prefill_logits_match_torch(family):
    """Prefill (no past) and a chunk after a past, including batch 2."""
    report = verify_export(tiny(family), exported(family), atol=ATOL)
    assert report["logits"] <= ATOL and report["present"] <= ATOL


def test_left_padded_prefill_matches_hf(family):
    import onnxruntime as ort

    model = tiny(family)
    sess = ort.InferenceSession(str(exported(family)), providers=["CPUExecutionProvider"])
    ids = torch.tensor([[1, 1, 1, 40, 41, 42, 43], [50, 51, 52, 53, 54, 55, 56]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.numpy()
    feed = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy()}
    for n in input_names(list(range(4)))[3:]:
        feed[n] = np.zeros((2, 2, 0, head_dim(family)), np.float32)
    got = sess.run(["logits"], feed)[0]
    valid = mask.numpy().astype(bool)
    assert np.abs(got - ref)[valid].max() <= ATOL


def test_metadata_and_name_scopes():
    path = exported("llama")
    meta = read_export_meta(path)
    assert meta["kv_layers"] == [0, 1, 2, 3]
    assert (meta["num_layers"], meta["num_heads"], meta["kv_heads"], meta["head_dim"]) == (4, 4, 2, 16)
    assert meta["model_type"] == "llama" and meta["harp_alphas"] == {}
    m = onnx.load(str(path), load_external_data=False)
    scopes = {p.value for n in m.graph.node for p in n.metadata_props if p.key == "pkg.torch.onnx.name_scopes"}
    assert any("model.layers.2.self_attn.q_proj" in s for s in scopes)
    assert sum(n.op_type == "Attention" for n in m.graph.node) == 4


def test_harp_model_exports_without_pruned_kv():
    path = exported("llama", harp=True)
    m = onnx.load(str(path), load_external_data=False)
    names = {i.name for i in m.graph.input} | {o.name for o in m.graph.output}
    for i in HARP_ALPHAS:
        assert not any(n.startswith((f"past_key_values.{i}.", f"present.{i}.")) for n in names)
    for i in (0, 2):
        assert f"past_key_values.{i}.key" in names and f"present.{i}.value" in names
    meta = json.loads(next(p.value for p in m.metadata_props if p.key == EXPORT_META_KEY))
    assert meta["kv_layers"] == [0, 2] and meta["harp_alphas"] == {"1": 0.5, "3": 1.0}
    assert sum(n.op_type == "Attention" for n in m.graph.node) == 2
    report = verify_export(tiny("llama", harp=True), path, atol=ATOL)
    assert report["logits"] <= ATOL


def test_bad_inputs_raise_typed_errors(tmp_path):
    with pytest.raises(ConfigError, match="opset 18 is too old"):
        export_dense(tiny("llama"), tmp_path, opset=18)
    with pytest.raises(ConfigError, match="fp32"):
        export_dense(tiny("llama").to(torch.float16), tmp_path)
    bad = tmp_path / "model.onnx"
    bad.write_bytes(exported("llama").read_bytes()[:5000])
    with pytest.raises(GraphError, match=r"\[export\] .* is not a readable ONNX model"):
        read_export_meta(bad)
    with pytest.raises(ConfigError, match="unknown key"):
        ExportConfig.from_dict({"opsett": 23})
    with pytest.raises(PreconditionError, match=r"\[export\] needs inputs"):
        ExportStage().execute(ArtifactStore(tmp_path / "cache"), ExportConfig(), {})


@pytest.mark.slow
def test_export_stage_caches_by_weight_digest(tmp_path):
    from harp_trt.models import resolve_model

    store = ArtifactStore(tmp_path / "cache")
    a = save_tiny("qwen2", tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)                                  # same weights, other path
    c = save_tiny("qwen2", tmp_path / "c", seed=1)         # other weights
    ra, rb, rc = (resolve_model(str(p), store.root) for p in (a, b, c))
    stage, cfg = ExportStage(), ExportConfig()
    key = lambda r, c_=cfg: store.make_key(stage.name, stage.key_material(c_, {"model": r}))  # noqa: E731
    assert key(ra) == key(rb) != key(rc)
    assert key(ra) != key(ra, ExportConfig(verify_atol=1e-3))

    art = stage.execute(store, cfg, {"model": ra})
    assert not art.cached and art.key == key(ra)
    assert {"model.onnx", "config.json", "tokenizer.json", "manifest.json"} <= {p.name for p in art.path.iterdir()}
    assert art.manifest["kv_layers"] == [0, 1, 2, 3] and art.manifest["verify"]["logits"] <= ATOL
    assert art.manifest["model"]["digest"] == ra.digest
    again = stage.execute(store, cfg, {"model": rb})
    assert again.cached and again.path == art.path


@pytest.mark.slow
@pytest.mark.parametrize("fam", ["qwen2", "gemma2"])
def test_streamed_export_equals_in_memory_export(tmp_path, fam):
    """export_folder traces a meta skeleton and streams initializers from safetensors: the graph
    computes what the in-memory export computes, bit for bit, on prefill and with a past."""
    import onnxruntime as ort

    from harp_trt.export.export import _example, export_folder

    folder = save_tiny(fam, tmp_path / "m", tie_word_embeddings=(fam == "gemma2"))
    streamed = export_folder(folder, tmp_path / "streamed")
    model = tiny(fam) if fam != "gemma2" else None
    from harp_trt.models import load_model_folder

    model = load_model_folder(folder)
    ref = export_dense(model, tmp_path / "ref")
    assert read_export_meta(streamed)["kv_layers"] == [0, 1, 2, 3]
    layers = list(range(4))
    s1, s2 = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (streamed, ref))
    for b, s, p in ((1, 6, 0), (2, 3, 4)):
        args = _example(model, layers, b, s, p, seed=7)
        feed = {n: t.numpy() for n, t in zip(input_names(layers), [args[0], args[1], args[2], *args[3]])}
        for x, y in zip(s1.run(None, feed), s2.run(None, feed)):
            np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_streamed_export_in_bfloat16(tmp_path):
    """A bf16 graph for GPU engines: bf16 initializers and KV I/O, the fp32 export's structure."""
    from harp_trt.export.export import export_folder

    folder = save_tiny("llama", tmp_path / "m")
    path = export_folder(folder, tmp_path / "bf16", dtype="bfloat16")
    m = onnx.load(str(path), load_external_data=False)
    assert {i.data_type for i in m.graph.initializer if len(i.dims) == 2} == {onnx.TensorProto.BFLOAT16}
    kv = next(i for i in m.graph.input if i.name == "past_key_values.0.key")
    assert kv.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert read_export_meta(path)["dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        export_folder(folder, tmp_path / "x", dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("path", ["in-memory", "streamed"])
def test_export_stores_each_weight_once(tmp_path, tied, path):
    """Every initializer is read by the graph, and together they are the model's parameter bytes
    (a tied embedding once) plus a few small constants: no weight beside its transposed copy."""
    from conftest import make_tiny
    from harp_trt.export.export import export_folder

    model = make_tiny("qwen2", tie_word_embeddings=tied)
    with torch.no_grad():  # random init leaves the biases at 0: equal tensors the optimizer would share
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_()
    if path == "streamed":
        model.save_pretrained(tmp_path / "m", safe_serialization=True)
        onnx_path = export_folder(tmp_path / "m", tmp_path / "x")
    else:
        onnx_path = export_dense(model, tmp_path / "x")
    g = onnx.load(str(onnx_path)).graph
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    assert [t.name for t in g.initializer if t.name not in read] == []
    init_bytes = sum(onnx.numpy_helper.to_array(t).nbytes for t in g.initializer)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # shared tensors once
    assert param_bytes <= init_bytes <= param_bytes + 4096, (init_bytes, param_bytes)
    verify_export(model, onnx_path, atol=ATOL)
