"""onnxruntime-genai (the PyPI wheel, ``.[genai]``) runs our ORT engines from ``deploy genai``:
greedy tokens from ``og.Generator`` equal our OrtCausalLM's on dense, top-layer and middle-layer
HARP engines, a concatenating (opset-23 Attention) engine and int8 / int4 engines; the KV memory a
generator allocates, measured as resident bytes in a fresh process, is (L-P)/L of dense; the
pipeline's ``build --backend genai``; bad input exits 2 and writes nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny, save_tiny
from test_calibrate_cli import run_json, write_corpus

import onnxruntime_genai  # noqa: F401  (the test extra installs it: a missing runtime fails, never skips)

CONTEXT = 131072  # tiny models with a long context, so one generator's KV is tens of MiB
PLANS = {"dense": {}, "top": {2: 0.5, 3: 1.0}, "middle": {1: 0.5, 2: 1.0}}
PROMPT = [40, 41, 42, 43, 44, 45, 46]
KV_TOLERANCE = 0.05  # measured RSS delta vs the kept layers' KV bytes (it also holds the prompt's activations)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: ORT engine folder} for the dense and HARP plans (fp32, GQA), plus the middle plan as
    int8 and int4 engines and as a concatenating (attention='onnx') engine; every engine has the tokenizer
    and config files a build copies."""
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.harp import apply_harp
    from harp_trt.onnx_io import copy_tokenizer
    from harp_trt.export.export import export_dense

    root = tmp_path_factory.mktemp("genai")
    hf = save_tiny("llama", root / "hf", max_position_embeddings=CONTEXT)
    out = {"root": root}
    for name, alphas in PLANS.items():
        model = make_tiny("llama", max_position_embeddings=CONTEXT)
        if alphas:
            apply_harp(model, dict(alphas))
        graph = export_dense(model, root / f"export-{name}")
        copy_tokenizer(hf, graph.parent)
        out[name] = root / f"engine-{name}"
        OrtBuilder().build(graph, out[name], OrtBuildConfig(intra_op_threads=2))
        out[f"export-{name}"] = graph.parent
    mid = out["export-middle"] / "model.onnx"
    out["int4"] = root / "engine-int4"
    OrtBuilder().build(mid, out["int4"], OrtBuildConfig(quant="int4", quant_block_size=16, intra_op_threads=2))
    out["int8"] = root / "engine-int8"
    OrtBuilder().build(mid, out["int8"], OrtBuildConfig(quant="int8", quant_block_size=16, intra_op_threads=2))
    out["concat"] = root / "engine-concat"
    OrtBuilder().build(mid, out["concat"], OrtBuildConfig(attention="onnx", intra_op_threads=2))
    return out


def _deploy(built, name: str) -> tuple[dict, Path]:
    from harp_trt.builders.genai.stage import deploy_genai

    folder = built["root"] / f"genai-{name}"
    if not folder.exists():
        deploy_genai(built[name], folder)
    return json.loads((folder / "harp_genai.json").read_text()), folder


def _ours(engine: Path, n: int) -> list[int]:
    from harp_trt.ort_session import OrtCausalLM

    lm = OrtCausalLM.from_engine(engine)
    return [int(t) for t in lm.generate(np.asarray([PROMPT]), max_new_tokens=n)[0, len(PROMPT):]]


@pytest.mark.slow
@pytest.mark.parametrize("name,kept,share", [("dense", [0, 1, 2, 3], True), ("top", [0, 1], True),
                                             ("middle", [0, 3], True), ("concat", [0, 3], False),
                                             ("int8", [0, 3], True), ("int4", [0, 3], True)])
def test_genai_greedy_equals_ort(built, name, kept, share):
    from harp_trt.builders.genai.probe import genai_greedy

    report, folder = _deploy(built, name)
    cfg = json.loads((folder / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert (dec["num_hidden_layers"], dec["num_attention_heads"], dec["num_key_value_heads"], dec["head_size"],
            dec["hidden_size"]) == (4, 4, 2, 16, 64)
    assert report["kv_layers"] == kept and cfg["search"]["past_present_share_buffer"] is share
    assert report["verify"]["equal"] and (folder / "tokenizer.json").is_file()
    got = genai_greedy(folder, PROMPT, 24)
    assert got == _ours(built[name], 24)
    assert len(set(got)) > 1  # a real continuation, not one token repeated
    if name in ("int8", "int4"):
        import onnx

        ops = {n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node}
        assert report["quant"] == name and "MatMulNBits" in ops


@pytest.mark.slow
def test_genai_kv_memory_is_kept_layers_only(built):
    """Resident bytes one generator of CONTEXT tokens adds, per engine, against the kept layers'
    K+V bytes (2 * kv_heads * head_dim * 4 B per token and layer, from engine.json)."""
    from harp_trt.builders.genai.probe import measure_kv_rss

    figures = {}
    for name in PLANS:
        report, folder = _deploy(built, name)
        spec = json.loads((built[name] / "engine.json").read_text())["kv"]
        expected = spec["bytes_per_token"] * CONTEXT
        got = measure_kv_rss(folder, CONTEXT)["delta_bytes"]
        figures[name] = got
        assert abs(got - expected) <= KV_TOLERANCE * expected, (name, got, expected)
    for name in ("top", "middle"):
        ratio = figures[name] / figures["dense"]
        assert abs(ratio - 2 / 4) <= 0.03, (name, ratio)  # (L-P)/L with L=4, P=2


@pytest.mark.slow
def test_genai_folder_reopens_as_an_engine(built):
    """The genai folder keeps engine.json: `harp-trt generate` and OrtCausalLM open it too."""
    from harp_trt.ort_session import OrtCausalLM

    _, folder = _deploy(built, "top")
    assert OrtCausalLM.from_engine(folder).kv_layers == [0, 1]


@pytest.mark.slow
def test_bench_genai_engine_times_whole_genai_calls(built, monkeypatch):
    """The one genai timing engine (``bench/_genai_baseline.genai_engine``; vs_genai.py and
    prefill_profile.py time genai through it): ``generate`` is our greedy continuation up to EOS;
    ``prefill_seconds`` is one append of the whole prompt and the first pick, inside the call's wall
    time; ``decode_tokens_per_s`` counts exactly the n steps it ran after that."""
    import time
    from types import SimpleNamespace

    import onnxruntime_genai as og

    from harp_trt.bench._genai_baseline import genai_engine

    _, folder = _deploy(built, "top")
    engine = genai_engine(folder, 2)
    n = 12
    got = engine.generate(PROMPT, n)
    assert got and got == _ours(built["top"], n)[:len(got)] and (len(got) == n or got[-1] in engine.eos), got
    calls: list[tuple[str, object]] = []

    class Recorded:   # og.Generator, each call written down with its argument
        def __init__(self, model, params):
            self.gen = og.Generator(model, params)

        def append_tokens(self, ids):
            calls.append(("append", len(ids)))
            self.gen.append_tokens(ids)

        def generate_next_token(self):
            calls.append(("next", None))
            self.gen.generate_next_token()

    monkeypatch.setattr(engine, "og", SimpleNamespace(GeneratorParams=og.GeneratorParams, Generator=Recorded))
    t0 = time.perf_counter()
    seconds = engine.prefill_seconds(PROMPT)
    assert 0 < seconds <= time.perf_counter() - t0
    assert calls == [("append", len(PROMPT)), ("next", None)], calls
    calls.clear()
    assert engine.decode_tokens_per_s(PROMPT, 5) > 0
    assert calls == [("append", len(PROMPT))] + [("next", None)] * 6, calls


def _strip_metadata(src: Path, dst: Path) -> Path:
    import onnx

    shutil.copytree(src, dst)
    m = onnx.load(str(dst / "model.onnx"))
    del m.metadata_props[:]
    onnx.save(m, str(dst / "model.onnx"))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "random", "export", "no-metadata", "bad-json", "context"])
def test_genai_deploy_bad_input(built, tmp_path, capsys, case):
    artifact, extra = tmp_path / "nothing", []
    if case == "random":
        artifact.mkdir()
        (artifact / "notes.txt").write_text("hello")
    elif case == "export":
        artifact = built["export-top"]
    elif case == "no-metadata":
        artifact = _strip_metadata(built["top"], tmp_path / "stripped")
    elif case == "bad-json":
        artifact = shutil.copytree(built["top"], tmp_path / "badjson")
        (artifact / "engine.json").write_text("{not json")
    elif case == "context":
        artifact, extra = built["top"], ["--context-length", str(CONTEXT + 1)]
    out = tmp_path / "out"
    code, res, err = run_json(capsys, "deploy", "genai", "--artifact", str(artifact), "--out", str(out),
                              "--workdir", str(tmp_path / "cache"), "--json", *extra)
    assert code == 2 and res is None, err
    first = err.strip().splitlines()[0]
    assert first.startswith("harp-trt deploy: error:") and len(first) < 240, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
def test_genai_deploy_refuses_a_non_empty_out(built, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_json(capsys, "deploy", "genai", "--artifact", str(built["top"]), "--out", str(out), "--json")
    assert code == 2 and "not empty" in err and [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_build_backend_genai_then_deploy_is_cached(tmp_path, capsys):
    """`build --backend genai`: the ORT steps then the genai folder (a cached genai-<key>/
    artifact); `deploy genai --artifact <engine>` without --out returns that same artifact."""
    folder = save_tiny("qwen2", tmp_path / "tiny-qwen2", seed=7, max_position_embeddings=1024)
    corpus = write_corpus(tmp_path / "corpus.txt")
    cache = tmp_path / "cache"
    code, res, err = run_json(capsys, "build", "--model", str(folder), "--layers", "2", "--tokens", "256",
                              "--seq-len", "64", "--corpus", str(corpus), "--alpha-grid", "0,0.5,1",
                              "--workdir", str(cache), "--backend", "genai", "--json")
    assert code == 0, err
    assert list(res["stages"]) == ["calibrate", "export", "rewrite", "build", "build:genai"]
    art = Path(res["stages"]["build:genai"]["artifact"])
    assert art.name.startswith("genai-") and (art / "genai_config.json").is_file()
    report = json.loads((art / "harp_genai.json").read_text())
    assert report["verify"]["equal"] and report["pruned_layers"] == res["layers"]
    code, dep, err = run_json(capsys, "deploy", "genai", "--artifact", Path(res["engine"]).name,
                              "--workdir", str(cache), "--json")
    assert code == 0, err
    assert dep["folder"] == str(art) and dep["cached"] and dep["verified"]


# ---- --last-logits: the graph returns the last position's logits only (genai's prune_lm_head) -----
@pytest.mark.slow
@pytest.mark.parametrize("name", ["top", "int4", "external"])
def test_last_logits_folder_runs_in_genai(built, name, monkeypatch):
    """genai runs the edited graph unchanged: its greedy tokens equal our session's on the engine,
    its prefill logits are [B, 1, V] and equal the all-position folder's last row; external weights
    stay the engine's file (hard-linked; "external": the top plan's engine built with its weights in
    model.onnx.data, as every engine above 1 GiB is) and the bench engine reads the folder as "last"."""
    import onnxruntime_genai as og

    if name == "external" and name not in built:
        from harp_trt.builders.ort import builder
        from harp_trt.builders.ort.config import OrtBuildConfig

        monkeypatch.setattr(builder, "EXTERNAL_DATA_THRESHOLD", 0)
        built[name] = built["root"] / "engine-external"
        builder.OrtBuilder().build(built["export-top"] / "model.onnx", built[name], OrtBuildConfig(intra_op_threads=2))

    from harp_trt.bench.stage.engine_genai import GenaiBenchEngine
    from harp_trt.builders.genai.config import GenaiConfig
    from harp_trt.builders.genai.probe import genai_greedy
    from harp_trt.builders.genai.stage import deploy_genai
    from harp_trt.errors import PreconditionError

    folder = built["root"] / f"genai-last-{name}"
    deploy_genai(built[name], folder, GenaiConfig(last_logits=True))
    report = json.loads((folder / "harp_genai.json").read_text())
    assert report["logits"] == "last" and report["verify"]["equal"]
    assert genai_greedy(folder, PROMPT, 24) == _ours(built[name], 24)
    data = [p for p in folder.iterdir() if p.name.startswith("model.onnx.")]
    assert len(data) == (name == "external")
    assert all(p.stat().st_ino == (built[name] / p.name).stat().st_ino for p in data)
    assert (folder / "model.onnx").stat().st_ino != (built[name] / "model.onnx").stat().st_ino

    _, full = _deploy(built, name)
    rows = []
    for f in (folder, full):
        model = og.Model(str(f))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=16, batch_size=2)
        gen = og.Generator(model, params)
        gen.append_tokens(np.asarray([PROMPT, PROMPT[::-1]], dtype=np.int32))
        rows.append(np.asarray(gen.get_output("logits")))
    assert rows[0].shape == (2, 1, 128) and rows[1].shape == (2, len(PROMPT), 128)
    np.testing.assert_allclose(rows[0][:, 0], rows[1][:, -1], rtol=0, atol=1e-5)

    import torch

    ids = torch.tensor([PROMPT])
    engine = GenaiBenchEngine(folder, "harp", 2, 8, CONTEXT)
    assert engine.prefill_logits == "last"
    with pytest.raises(PreconditionError, match="every position"):
        engine.logits(ids)
    assert GenaiBenchEngine(full, "harp", 2, 8, CONTEXT).logits(ids).shape == (1, len(PROMPT), 128)


@pytest.mark.slow
def test_deploy_genai_last_logits_flag(built, tmp_path, capsys):
    """`harp-trt deploy genai --last-logits --json` as a user runs it: the folder's graph returns one
    position and the JSON says so."""
    import onnx

    out = tmp_path / "genai"
    code, dep, err = run_json(capsys, "deploy", "genai", "--artifact", str(built["top"]), "--out", str(out),
                              "--last-logits", "--json")
    assert code == 0, err
    assert dep["logits"] == "last" and dep["verified"]
    logits = next(o for o in onnx.load(str(out / "model.onnx")).graph.output if o.name == "logits")
    assert logits.type.tensor_type.shape.dim[1].dim_value == 1


def _head_graph(chain: list[str]):
    """hidden [B, S, 8] -> MatMul(W) -> the element-wise ops in ``chain`` -> logits [B, S, 5]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "W"),
             numpy_helper.from_array(np.asarray(3.0, np.float32), "cap")]
    nodes, x = [helper.make_node("MatMul", ["hidden", "W"], ["h0"])], "h0"
    for i, op in enumerate(chain):
        out = "logits" if i == len(chain) - 1 else f"h{i + 1}"
        nodes.append(helper.make_node(op, [x] if op == "Tanh" else [x, "cap"], [out]))
        x = out
    if not chain:
        nodes[0].output[0] = "logits"
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 5])], inits,
                              value_info=[helper.make_tensor_value_info("h0", TensorProto.FLOAT, ["b", "s", 5])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("chain", [[], ["Div", "Tanh", "Mul"]])   # plain head; Gemma2's soft-capping
def test_last_position_logits_is_the_last_row(chain):
    import onnx
    import onnxruntime as ort

    from harp_trt.builders.genai.last_logits import last_position_logits

    model = _head_graph(chain)
    x = np.random.default_rng(1).standard_normal((2, 6, 8)).astype(np.float32)
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"hidden": x})[0]
    full = run(model)
    edited = last_position_logits(onnx.ModelProto.FromString(model.SerializeToString()))
    onnx.checker.check_model(edited, full_check=True)
    last = run(edited)
    assert last.shape == (2, 1, 5)
    np.testing.assert_array_equal(last[:, 0], full[:, -1])


def test_last_position_logits_refuses_an_unknown_head():
    from onnx import TensorProto, helper

    from harp_trt.builders.genai.last_logits import last_position_logits
    from harp_trt.errors import GraphError

    graph = helper.make_graph([helper.make_node("Concat", ["a", "b"], ["logits"], axis=1)], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 2, 3]) for n in "ab"],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4, 3])])
    with pytest.raises(GraphError, match=r"^\[genai\] the logits output comes out of a Concat") as e:
        last_position_logits(helper.make_model(graph))
    assert "no --last-logits" in e.value.hint
    # a graph input straight to the logits through element-wise ops: no GEMM at all, a typed error too
    graph = helper.make_graph([helper.make_node("Tanh", ["a"], ["logits"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 2, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, 3])])
    with pytest.raises(GraphError, match="no LM-head GEMM"):
        last_position_logits(helper.make_model(graph))
