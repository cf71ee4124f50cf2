"""Triton repository for the ONNX Runtime engine: a tiny HARP model exported with the real export
(pruned layers have no KV I/O), written as a Triton model, every config.pbtxt parsed with Triton's
``model_config_pb2``, tensors compared to the ONNX graph, the written client's greedy loop run
against the written model in ONNX Runtime and compared with PyTorch, and every bad-input path."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil

import numpy as np
import onnx
import pytest
import torch

from harp_trt.builders.triton import TritonRepoConfig, model_metadata, parse_model_config, write_repository
from harp_trt.builders.triton.pbtxt import TRITON_TO_NUMPY
from harp_trt.cli import main
from harp_trt.errors import HarpError, PostconditionError, PreconditionError
from harp_trt.harp import apply_harp
from harp_trt.store import ArtifactStore

from conftest import _tiny_tokenizer, make_tiny

ONNX = TritonRepoConfig(serving="onnx")  # Triton's onnxruntime backend (test_triton_server.py: python serving)
ALPHAS = {1: 0.6, 3: 0.0}  # layers 1 and 3 pruned, 0 and 2 keep attention
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(folder laid out like an export artifact, HARP PyTorch model): model.onnx, tokenizer, manifest."""
    from harp_trt.export.export import export_dense

    folder = tmp_path_factory.mktemp("export")
    model = apply_harp(make_tiny("llama"), ALPHAS)
    export_dense(model, folder)
    _tiny_tokenizer().save_pretrained(folder)
    ArtifactStore.write_manifest(folder, {"stage": "export", "key": "export-test", "onnx": "model.onnx"})
    return folder, model


def _graph_io(path):
    g = onnx.load(str(path), load_external_data=False).graph
    def one(v):
        t = v.type.tensor_type
        return (v.name, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim])
    return [one(v) for v in g.input], [one(v) for v in g.output]


def _config_io(cfg):
    from tritonclient.grpc import model_config_pb2 as pb

    def one(t):
        return (t.name, TRITON_TO_NUMPY[pb.DataType.Name(t.data_type)], list(t.dims))
    return [one(t) for t in cfg.input], [one(t) for t in cfg.output]


@pytest.mark.slow
def test_config_tensors_equal_the_graph(engine, tmp_path):
    folder, _ = engine
    report = write_repository(folder, tmp_path / "repo", ONNX)
    repo = tmp_path / "repo"
    cfg = parse_model_config(repo / "harp" / "config.pbtxt")
    assert cfg.name == "harp" and cfg.backend == "onnxruntime" and cfg.max_batch_size == 0
    assert cfg.default_model_filename == "model.onnx"
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(2, 1)]  # KIND_CPU, one instance

    want_in, want_out = _graph_io(repo / "harp" / "1" / "model.onnx")
    got_in, got_out = _config_io(cfg)
    assert got_in == want_in and got_out == want_out  # names, dtypes, dims (-1 where symbolic), order
    names = [n for n, _, _ in got_in + got_out]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    for layer in (0, 2):
        for t in ("key", "value"):
            assert f"past_key_values.{layer}.{t}" in names and f"present.{layer}.{t}" in names
    for layer in ALPHAS:
        assert not [n for n in names if n.startswith((f"past_key_values.{layer}.", f"present.{layer}."))]
    kv = dict((n, d) for n, _, d in got_in)["past_key_values.0.key"]
    assert kv == [-1, 2, -1, 16]  # batch, kv_heads, past, head_dim
    assert dict((n, d) for n, _, d in got_out)["logits"] == [-1, -1, 128]
    assert report["kv_layers"] == [0, 2] and report["pruned_layers"] == [1, 3]

    assert (repo / "harp" / "1" / "model.onnx").read_bytes() == (folder / "model.onnx").read_bytes()
    assert (repo / "harp" / "tokenizer" / "tokenizer.json").is_file()
    for f in repo.rglob("*"):
        if f.is_file() and f.suffix in (".pbtxt", ".py", ".md", ".json"):
            assert "${" not in f.read_text(), f
    readme = (repo / "README.md").read_text()
    assert "tritonserver --model-repository=" in readme and "nvcr.io/nvidia/tritonserver:" in readme
    assert "python client.py" in readme and "[1, 3]" in readme
    saved = json.loads((repo / "harp_triton.json").read_text())
    assert saved["artifact"]["stage"] == "export" and saved["pruned_layers"] == [1, 3]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".repo")]  # temp folder renamed away


@pytest.mark.slow
def test_gpu_instances_and_threads(engine, tmp_path):
    folder, _ = engine
    write_repository(folder, tmp_path / "r", TritonRepoConfig(serving="onnx", device="gpu", instances=2, threads=3,
                                                              model_name="smol-harp", link=False))
    cfg = parse_model_config(tmp_path / "r" / "smol-harp" / "config.pbtxt")
    assert cfg.name == "smol-harp"
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(1, 2)]  # KIND_GPU x2
    assert cfg.parameters["intra_op_thread_count"].string_value == "3"
    assert "--gpus all" in (tmp_path / "r" / "README.md").read_text()


def _load_client(repo):
    spec = importlib.util.spec_from_file_location("written_client", repo / "client.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_written_client_greedy_loop_matches_pytorch(engine, tmp_path):
    """client.py's KV-cache loop, fed the metadata Triton derives from the written config and run on
    the written model.onnx in ONNX Runtime (what the onnxruntime backend executes), generates the
    same greedy tokens as the PyTorch HARP model recomputing the whole sequence each step."""
    import onnxruntime as ort

    folder, model = engine
    repo = tmp_path / "repo"
    write_repository(folder, repo, ONNX)
    client = _load_client(repo)
    assert client.DEFAULTS == {"model": "harp", "tokenizer": "harp/tokenizer", "url": "localhost:8001",
                               "max_tokens": 32}
    meta = model_metadata(parse_model_config(repo / "harp" / "config.pbtxt"))
    sess = ort.InferenceSession(str(repo / "harp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]

    def infer(feed):
        assert set(feed) == {m["name"] for m in meta["inputs"]}  # exactly the config's inputs
        for m in meta["inputs"]:
            assert feed[m["name"]].dtype.name == {"INT64": "int64", "FP32": "float32"}[m["datatype"]]
            assert feed[m["name"]].ndim == len(m["shape"])
        return dict(zip(outs, sess.run(None, feed)))

    prompt = [5, 17, 99, 3, 64, 8]
    got = client.greedy_generate(infer, meta, prompt, max_new_tokens=10)

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]
    # eos stops the loop after emitting it
    assert client.greedy_generate(infer, meta, prompt, 10, eos_ids={got[1]}) == got[:2]


@pytest.mark.slow
def test_external_data_travels_with_the_model(engine, tmp_path):
    import onnxruntime as ort

    folder, _ = engine
    ext = tmp_path / "ext"
    ext.mkdir()
    m = onnx.load(str(folder / "model.onnx"))
    onnx.save_model(m, str(ext / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    report = write_repository(ext, tmp_path / "repo", ONNX)
    assert report["files"] == ["model.onnx", "model.onnx.data"] and report["artifact"]["stage"] is None
    feed = {"input_ids": np.array([[1, 2, 3]], np.int64), "attention_mask": np.ones((1, 3), np.int64),
            "position_ids": np.arange(3)[None].astype(np.int64)}
    feed.update({f"past_key_values.{i}.{t}": np.zeros((1, 2, 0, 16), np.float32) for i in (0, 2)
                 for t in ("key", "value")})
    a = ort.InferenceSession(str(folder / "model.onnx")).run(["logits"], feed)[0]
    b = ort.InferenceSession(str(tmp_path / "repo" / "harp" / "1" / "model.onnx")).run(["logits"], feed)[0]
    np.testing.assert_array_equal(a, b)

    (ext / "model.onnx.data").unlink()
    with pytest.raises(PreconditionError, match="model.onnx.data"):
        write_repository(ext, tmp_path / "repo2", ONNX)
    assert not (tmp_path / "repo2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".repo2")]


# ---- bad input ----------------------------------------------------------------------------------
def test_wrong_artifact_kind_is_refused(tmp_path, capsys):
    calib = tmp_path / "calibrate-0123"
    calib.mkdir()
    ArtifactStore.write_manifest(calib, {"stage": "calibrate", "key": "calibrate-0123"})
    (calib / "plan.json").write_text("{}")
    with pytest.raises(PreconditionError, match="is a 'calibrate' artifact.*export, rewrite, build-ort, trtllm"):
        write_repository(calib, tmp_path / "repo", ONNX)
    rc = main(["deploy", "triton", "--serving", "onnx", "--artifact", str(calib), "--out", str(tmp_path / "repo")])
    err = capsys.readouterr().err
    assert rc == 2 and "calibrate" in err and len(err.strip().splitlines()) <= 2
    assert not (tmp_path / "repo").exists()


@pytest.mark.slow
def test_missing_model_onnx(engine, tmp_path, capsys):
    folder, _ = engine
    art = tmp_path / "rewrite-abc"
    art.mkdir()
    ArtifactStore.write_manifest(art, {"stage": "rewrite", "key": "rewrite-abc", "onnx": "model.onnx"})
    with pytest.raises(PreconditionError, match="'rewrite' artifact .* has no model.onnx"):
        write_repository(art, tmp_path / "repo", ONNX)
    eng = tmp_path / "ort-engine"
    eng.mkdir()
    (eng / "engine.json").write_text(json.dumps({"format": "harp-engine/1", "backend": "ort", "model": "model.onnx",
                                                 "providers": ["CPUExecutionProvider"], "intra_op_threads": 2}))
    assert main(["deploy", "triton", "--serving", "onnx", "--artifact", str(eng), "--out", str(tmp_path / "repo")]) == 2
    assert "has no model.onnx" in capsys.readouterr().err
    shutil.copy2(folder / "model.onnx", eng / "model.onnx")  # an ORT engine folder with its graph is fine
    r = write_repository(eng, tmp_path / "repo", ONNX)
    assert r["artifact"]["stage"] == "ort-engine" and r["engine_providers"] == ["CPUExecutionProvider"]
    cfg = parse_model_config(tmp_path / "repo" / "harp" / "config.pbtxt")
    assert cfg.parameters["intra_op_thread_count"].string_value == "2"  # the engine's thread count
    assert main(["deploy", "triton", "--serving", "onnx", "--artifact", str(tmp_path / "nope"), "--out", str(tmp_path / "r")]) == 2


@pytest.mark.slow
def test_existing_output_needs_force(engine, tmp_path, capsys):
    folder, _ = engine
    out = tmp_path / "repo"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(PreconditionError, match="exists and is not empty.*\n.*--force"):
        write_repository(folder, out, ONNX)
    assert main(["deploy", "triton", "--serving", "onnx", "--artifact", str(folder), "--out", str(out), "--json"]) == 2
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert main(["deploy", "triton", "--serving", "onnx", "--artifact", str(folder), "--out", str(out), "--force", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["kind"] == "onnx" and last["pruned_layers"] == [1, 3] and last["instance_kind"] == "KIND_CPU"
    assert not (out / "keep.txt").exists() and (out / "harp" / "config.pbtxt").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    write_repository(folder, empty, ONNX)  # an existing empty folder needs no --force
    assert (empty / "harp" / "1" / "model.onnx").is_file()


def test_bad_config_values_and_unparsable_pbtxt():
    with pytest.raises(HarpError, match="device must be 'cpu' or 'gpu'"):
        TritonRepoConfig.from_dict({"device": "tpu"})
    with pytest.raises(HarpError, match="unknown key.*valid keys: model_name, serving, device"):
        TritonRepoConfig.from_dict({"gpus": 2})
    with pytest.raises(HarpError, match="not a usable Triton model name"):
        TritonRepoConfig(serving="onnx", model_name="ensemble").validate()
    with pytest.raises(PostconditionError, match="not a valid Triton ModelConfig.*bogus_field"):
        parse_model_config('name: "x"\nbogus_field: 3\n')
    with pytest.raises(PostconditionError, match="not a valid Triton ModelConfig"):
        parse_model_config('name: "x"\ninput [ { name: "a" data_type: TYPE_FLOAT99 dims: [ 1 ] } ]\n')
    with pytest.raises(PostconditionError, match=r"template key \(\$\{engine_dir\}"):
        parse_model_config('name: "x"\nparameters { key: "p" value { string_value: "${engine_dir}" } }\n')


@pytest.mark.slow
def test_ort_engine_folder_from_the_ort_builder(engine, tmp_path, capsys):
    """An engine folder written by harp_trt.builders.ort (GroupQueryAttention graph saved by this ONNX
    Runtime) cannot go to Triton's onnxruntime backend, whose ORT is older (exit 2, with the
    versions); it becomes the text-in/text-out Python-backend model instead, whose config parses."""
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.triton.compat import required_ort
    from harp_trt.builders.triton.releases import DEFAULT_TRITON_RELEASE, TRITON_ORT

    folder, model = engine
    spec = OrtBuilder().build(folder / "model.onnx", tmp_path / "engine")
    assert spec["kv"]["layers"] == [0, 2]
    need, why = required_ort(tmp_path / "engine" / "model.onnx", spec)
    assert need == spec["versions"]["onnxruntime"] and "saved by ONNX Runtime" in why[0]
    default = re.escape(f"Triton {DEFAULT_TRITON_RELEASE} ships ONNX Runtime {TRITON_ORT[DEFAULT_TRITON_RELEASE]}")
    with pytest.raises(HarpError, match=default + r", but .*needs ONNX Runtime >= "):
        write_repository(tmp_path / "engine", tmp_path / "repo", ONNX)
    assert main(["deploy", "triton", "--serving", "onnx", "--artifact", str(tmp_path / "engine"), "--out",
                 str(tmp_path / "repo")]) == 2
    assert "needs ONNX Runtime" in capsys.readouterr().err and not (tmp_path / "repo").exists()
    # the export artifact (standard opset-23 ops) needs ORT 1.22: Triton 25.05 and newer
    assert required_ort(folder / "model.onnx")[0] == "1.22.0"
    with pytest.raises(HarpError, match=r"Triton 24.10 ships ONNX Runtime 1.19.2.*ONNX opset 23"):
        write_repository(folder, tmp_path / "old", TritonRepoConfig(serving="onnx", triton_release="24.10"))
    assert TRITON_ORT["25.05"] == "1.22.0"
    r = write_repository(tmp_path / "engine", tmp_path / "py", TritonRepoConfig(serving="python"))
    cfg = parse_model_config(tmp_path / "py" / "harp" / "config.pbtxt")
    assert cfg.backend == "python" and cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0
    assert [t.name for t in cfg.input] == ["text_input", "stream", "sampling_parameters", "exclude_input_in_output"]
    assert [t.name for t in cfg.output] == ["text_output"]
    assert (tmp_path / "py" / "harp" / "1" / "model.py").is_file()
    assert (tmp_path / "py" / "harp" / "1" / "engine" / "model.onnx").is_file() and r["serving"] == "python"
    from _exported import engine as gqa_engine
    from harp_trt.builders.triton.llm_repo import check_gpu_graph

    gqa = gqa_engine("llama")  # attention fused to com.microsoft GroupQueryAttention, fp32
    with pytest.raises(HarpError, match="fp32 GroupQueryAttention graph"):
        check_gpu_graph(gqa / "model.onnx", "gpu")
    check_gpu_graph(gqa / "model.onnx", "cpu")


@pytest.mark.slow
def test_stage_execute_caches_the_repository(engine, tmp_path):
    """The pipeline's path: TritonRepoStage().execute(store, config, {"engine": Artifact})."""
    from harp_trt.builders.triton import TritonRepoStage

    folder, _ = engine
    store = ArtifactStore(tmp_path / "cache")
    art = store.open(folder)
    first = TritonRepoStage().execute(store, ONNX, {"engine": art})
    assert not first.cached and first.manifest["stage"] == "triton" and first.manifest["kind"] == "onnx"
    assert first.manifest["artifact"]["key"] == "export-test" and first.manifest["pruned_layers"] == [1, 3]
    assert parse_model_config(first.path / "harp" / "config.pbtxt").max_batch_size == 0
    assert TritonRepoStage().execute(store, ONNX, {"engine": art}).cached
    other = TritonRepoStage().execute(store, TritonRepoConfig(serving="onnx", device="gpu"), {"engine": art})
    assert other.key != first.key and not other.cached
    with pytest.raises(PreconditionError, match="needs one of the inputs artifact, engine, onnx, trtllm"):
        TritonRepoStage().execute(store, ONNX, {})


@pytest.mark.slow
def test_bf16_graph_is_refused_for_onnx_serving(tmp_path):
    from conftest import save_tiny
    from harp_trt.export.export import export_folder

    folder = save_tiny("llama", tmp_path / "m")
    export_folder(folder, tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(HarpError, match="bfloat16 graph"):
        write_repository(tmp_path / "bf16", tmp_path / "repo", ONNX)


@pytest.mark.slow
def test_kv_budget_admission_in_the_repository(engine, tmp_path, capsys):
    """``deploy triton --kv-budget``: the model's parameters carry the budget (max_active 0: the budget
    decides), harp_triton.json and the repository README give the sequences admitted at the model's
    context for this HARP engine and its dense shape (L/(L-P) = 2 here); a share of free memory is
    left to the server's log; a malformed budget exits 2 before anything is written."""
    from harp_trt.builders.ort.builder import OrtBuilder

    folder, _ = engine
    spec = OrtBuilder().build(folder / "model.onnx", tmp_path / "engine")
    per, dense = spec["kv"]["bytes_per_token"], spec["kv"]["dense_bytes_per_token"]
    assert dense == 2 * per
    budget = 3 * 2048 * dense + 1   # three dense sequences of 2048 tokens, six HARP ones
    assert main(["deploy", "triton", "--artifact", str(tmp_path / "engine"), "--out", str(tmp_path / "repo"),
                 "--kv-budget", str(budget), "--context-limit", "2048"]) == 0
    cfg = parse_model_config(tmp_path / "repo" / "harp" / "config.pbtxt")
    assert cfg.parameters["kv_budget"].string_value == str(budget) and cfg.parameters["max_active"].string_value == "0"
    readme = (tmp_path / "repo" / "README.md").read_text()
    assert f"a KV budget of `{budget}`" in readme
    assert "| 1152 | 10 | 5 |" in readme and "| 2048 | 6 | 3 |" in readme
    r = write_repository(tmp_path / "engine", tmp_path / "none", TritonRepoConfig(serving="python"))
    assert r["admission"][0]["admits"] == 8 and r["parameters"]["max_active"] == "8"  # no budget: 8, as before
    for share in ("40%", "0.4"):
        r = write_repository(tmp_path / "engine", tmp_path / f"share{share}", TritonRepoConfig(serving="python",
                                                                                         kv_budget=share))
        assert r["admission"][0]["admits"] is None and r["parameters"]["kv_budget"] == share
        assert "the server log says what it admits" in (tmp_path / f"share{share}" / "README.md").read_text()
    capsys.readouterr()
    assert main(["deploy", "triton", "--artifact", str(tmp_path / "engine"), "--out", str(tmp_path / "bad"),
                 "--kv-budget", "lots"]) == 2
    assert "--kv-budget" in capsys.readouterr().err and not (tmp_path / "bad").exists()
