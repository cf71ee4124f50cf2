"""Triton repository for TensorRT-LLM: real ``TrtllmCheckpointStage`` artifacts of tiny Qwen2 (window1
route: per-layer attention windows) and Llama (DeciLM route, tokenizer in hf/) models -> ensemble,
preprocessing, tensorrt_llm, postprocessing; every config.pbtxt parsed with ``model_config_pb2``, no
``${`` left, values equal to the build config, the ensemble wiring checked (and shown to catch a
broken map), the Python-backend helpers run on the copied tokenizer, and the error paths."""
from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

from harp_trt.builders.triton import (TEMPLATE_KEYS, TritonRepoConfig, parse_model_config, string_params,
                             validate_repository, write_repository)
from harp_trt.builders.trtllm import TrtllmCheckpointConfig, TrtllmCheckpointStage
from harp_trt.cli import main
from harp_trt.errors import PostconditionError, PreconditionError
from harp_trt.plan import Plan
from harp_trt.store import ArtifactStore

from conftest import save_tiny

MODELS = ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm"]
BUILD = dict(dtype="float32", max_batch_size=6, max_input_len=32, max_seq_len=64)


def _plan(family: str, ref: str) -> Plan:
    return Plan(ref, "0" * 64, family, 4, "test", (2, 3), (0.7, 0.0))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """{"qwen2": artifact whose plan points at a model folder with the tokenizer,
        "llama": artifact with the tokenizer saved in hf/}"""
    from harp_trt.models import ResolvedModel

    root = tmp_path_factory.mktemp("trt")
    store = ArtifactStore(root / "cache")
    tok_folder = save_tiny("qwen2", root / "qwen2-model")
    llama_folder = save_tiny("llama", root / "llama-tiny", intermediate_size=256)
    cfg = TrtllmCheckpointConfig(**BUILD)
    qwen = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("qwen2", str(tok_folder)),
                                                        "model": ResolvedModel(str(tok_folder), tok_folder, "", "folder")})
    llama = TrtllmCheckpointStage().execute(store, cfg, {"plan": _plan("llama", "llama-tiny"),
                                                         "model": ResolvedModel("llama-tiny", llama_folder, "", "folder")})
    return {"qwen2": qwen, "llama": llama, "tokenizer": tok_folder}


def _configs(repo):
    return {m: parse_model_config(repo / m / "config.pbtxt") for m in MODELS}


def test_qwen2_repository_values_match_the_build(artifacts, tmp_path):
    art = artifacts["qwen2"]
    report = write_repository(art.path, tmp_path / "repo")
    repo = tmp_path / "repo"
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == MODELS
    cfgs = _configs(repo)
    assert {m: c.name for m, c in cfgs.items()} == {m: m for m in MODELS}
    for f in repo.rglob("*"):
        if f.is_file() and f.suffix in (".pbtxt", ".py", ".md", ".json"):
            assert "${" not in f.read_text(), f

    assert {c.max_batch_size for c in cfgs.values()} == {BUILD["max_batch_size"]}
    llm = cfgs["tensorrt_llm"]
    p = string_params(llm)
    assert llm.backend == "tensorrtllm" and llm.model_transaction_policy.decoupled is False
    assert p["gpt_model_path"] == str(art.path / "engine")  # where build_engine.sh writes by default
    assert "engine" in (art.path / "build_engine.sh").read_text()
    assert p["gpt_model_type"] == "inflight_fused_batching" and p["kv_cache_free_gpu_mem_fraction"] == "0.9"
    assert p["batch_scheduler_policy"] == "guaranteed_no_evict" and p["exclude_input_in_output"] == "true"
    ckpt = json.loads((art.path / "checkpoint" / "config.json").read_text())
    windows = ckpt["runtime_defaults"]["max_attention_window"]
    assert windows == [64, 64, 1, 1]  # kept layers: max_seq_len; HARP-pruned layers 2, 3: one token
    assert p["max_attention_window_size"] == "64,64,1,1" and "sink_token_length" not in p  # must be > 0 if set
    # read by the backend with no fallback: present (empty = unset), else the model does not load
    assert p["tokenizer_dir"] == p["xgrammar_tokenizer_info_path"] == p["guided_decoding_backend"] == ""
    assert "max_tokens_in_paged_kv_cache" not in p  # optional, no value: left out (backend default)
    assert list(llm.dynamic_batching.preferred_batch_size) == [6]
    out_types = {t.name: t.data_type for t in llm.output}
    from tritonclient.grpc import model_config_pb2 as pb
    assert out_types["context_logits"] == pb.TYPE_FP32 and out_types["output_ids"] == pb.TYPE_INT32  # logits_dtype
    pre = string_params(cfgs["preprocessing"])
    assert pre == {"tokenizer_dir": "tokenizer", "add_special_tokens": "true", "max_input_len": "32",
                   "max_seq_len": "64"}
    assert cfgs["preprocessing"].backend == cfgs["postprocessing"].backend == "python"
    assert cfgs["ensemble"].platform == "ensemble"
    assert [s.model_name for s in cfgs["ensemble"].ensemble_scheduling.step] == [
        "preprocessing", "tensorrt_llm", "postprocessing"]
    assert (repo / "ensemble" / "1" / "README.md").is_file() and (repo / "tensorrt_llm" / "1" / "README.md").is_file()
    for m in ("preprocessing", "postprocessing"):
        assert (repo / m / "1" / "model.py").is_file()
        assert (repo / m / "1" / "tokenizer" / "tokenizer.json").read_bytes() == \
            (artifacts["tokenizer"] / "tokenizer.json").read_bytes()

    assert set(report["template_values"]) == set(TEMPLATE_KEYS)
    assert report["template_values"]["triton_max_batch_size"] == 6 and report["engine_built"] is False
    readme = (repo / "README.md").read_text()
    assert "build_engine.sh" in readme and "trtllm-python-py3" in readme and "64,64,1,1" in readme
    assert "tritonserver --model-repository=" in readme
    shares = art.manifest["launch"]["kv_runtime"]["shares_env"]
    assert shares.startswith("TRTLLM_WINDOW_SIZE_SHARES=") and f"-e {shares}" in readme


def test_llama_decilm_and_overrides(artifacts, tmp_path):
    art = artifacts["llama"]
    cfg = TritonRepoConfig(max_batch_size=4, decoupled=True, kv_cache_free_gpu_mem_fraction=0.5,
                           batch_scheduler_policy="max_utilization", engine_dir="/engines/harp-llama",
                           preprocessing_instances=3, exclude_input_in_output=False)
    report = write_repository(art.path, tmp_path / "repo", cfg)
    cfgs = _configs(tmp_path / "repo")
    p = string_params(cfgs["tensorrt_llm"])
    assert "max_attention_window_size" not in p  # DeciLM linear layers: no windows to set
    assert report["template_values"]["max_attention_window_size"] is None
    assert p["gpt_model_path"] == "/engines/harp-llama" and p["kv_cache_free_gpu_mem_fraction"] == "0.5"
    assert p["batch_scheduler_policy"] == "max_utilization" and p["exclude_input_in_output"] == "false"
    assert cfgs["tensorrt_llm"].model_transaction_policy.decoupled is True
    assert {c.max_batch_size for c in cfgs.values()} == {4}
    assert [g.count for g in cfgs["preprocessing"].instance_group] == [3]
    assert report["tokenizer_from"] == str(art.path / "tokenizer")  # the artifact's own, on every route
    spec = importlib.util.spec_from_file_location("c", tmp_path / "repo" / "client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    assert client.DEFAULTS["decoupled"] is True
    for words in _docker_runs((tmp_path / "repo" / "README.md").read_text()):  # build and serve see the engine
        assert "/engines/harp-llama:/engines/harp-llama" in _parse_docker_run(words)[0]["-v"]
    arrays = client.request_arrays("hi", 7, stream=True)
    ens = {t.name: t for t in cfgs["ensemble"].input}
    for name, a in arrays.items():  # every client tensor is an ensemble input of that rank (+ batch)
        assert name in ens and a.ndim == len(ens[name].dims) + 1


def test_validation_catches_a_broken_ensemble(artifacts, tmp_path):
    repo = tmp_path / "repo"
    write_repository(artifacts["qwen2"].path, repo)
    path = repo / "ensemble" / "config.pbtxt"
    good = path.read_text()
    path.write_text(good.replace('key: "input_lengths"', 'key: "input_length"'))
    with pytest.raises(PostconditionError, match="maps input 'input_length', which the model does not have"):
        validate_repository(repo)
    path.write_text(good.replace('value: "_TOKENS_BATCH"\n      }\n      output_map', 'value: "_TOKENS"\n      }\n      output_map'))
    with pytest.raises(PostconditionError, match="reads '_TOKENS_BATCH' before any step produces it"):
        validate_repository(repo)
    pre = repo / "preprocessing" / "config.pbtxt"
    pre_good = pre.read_text()
    pre.write_text(pre_good.replace('name: "INPUT_ID"\n    data_type: TYPE_INT32', 'name: "INPUT_ID"\n    data_type: TYPE_INT64'))
    path.write_text(good)
    with pytest.raises(PostconditionError, match="'_INPUT_ID'.*does not match tensorrt_llm.input_ids"):
        validate_repository(repo)
    pre.write_text(pre_good)
    assert set(validate_repository(repo)) == set(MODELS)


def _asset(repo, model):
    spec = importlib.util.spec_from_file_location(f"{model}_model", repo / model / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_python_backend_helpers_on_the_copied_tokenizer(artifacts, tmp_path):
    repo = tmp_path / "repo"
    write_repository(artifacts["qwen2"].path, repo)
    pre, post = _asset(repo, "preprocessing"), _asset(repo, "postprocessing")
    here = str(repo / "preprocessing" / "1")
    assert pre.resolve_dir("tokenizer", here) == str(repo / "preprocessing" / "1" / "tokenizer")
    assert pre.resolve_dir("/abs/tok", here) == "/abs/tok"
    tok = pre.load_tokenizer(pre.resolve_dir("tokenizer", here))
    ids, lengths = pre.encode(tok, ["Hi!", "abcde"], add_special_tokens=False)
    assert ids.dtype == np.int32 and lengths.dtype == np.int32
    assert ids.tolist() == [[72, 105, 33, 1, 1], [97, 98, 99, 100, 101]] and lengths.tolist() == [[3], [5]]
    cfg = parse_model_config(repo / "preprocessing" / "config.pbtxt")
    dims = {t.name: len(t.dims) + 1 for t in cfg.output}  # + batch dimension
    words = pre.word_lists(tok, [["ab", "c"], []])
    assert words.shape == (2, 2, 3) and words.dtype == np.int32
    assert words[0].tolist() == [[97, 98, 99], [2, 3, -1]] and words[1].tolist() == [[0, 0, 0], [-1, -1, -1]]
    assert ids.ndim == dims["INPUT_ID"] and lengths.ndim == dims["REQUEST_INPUT_LEN"] and words.ndim == dims["STOP_WORDS_IDS"]
    assert pre.clamp_output_len([[100], [5]], lengths, 64).tolist() == [[61], [5]]
    assert pre.clamp_output_len([[100]], [[64]], 64).tolist() == [[1]]
    assert pre.clamp_output_len([[100]], [[64]], 0).tolist() == [[100]]
    toks = np.array([[[72, 105, 33, 0, 0]], [[97, 98, 99, 100, 101]]], dtype=np.int32)
    text = post.decode(tok, toks, np.array([[3], [2]]))
    assert text.shape == (2, 1) and text.dtype == object  # OUTPUT: TYPE_STRING [-1] per batch item
    assert text[0, 0].decode() == tok.decode([72, 105, 33]) != tok.decode([72, 105, 33, 0, 0])
    assert text[1, 0].decode() == tok.decode([97, 98]) and "c" not in text[1, 0].decode()


def test_trtllm_errors(artifacts, tmp_path, capsys):
    art = artifacts["qwen2"]
    moved = tmp_path / "elsewhere"
    artifacts["tokenizer"].rename(moved)  # the plan's model folder is gone: the artifact has its own
    try:
        assert write_repository(art.path, tmp_path / "repo0")["tokenizer_from"] == str(art.path / "tokenizer")
        (tmp_path / "empty").mkdir()
        with pytest.raises(PreconditionError, match="no tokenizer files found.*\n.*--tokenizer-dir"):
            write_repository(art.path, tmp_path / "repo", TritonRepoConfig(tokenizer_dir=str(tmp_path / "empty")))
        assert not (tmp_path / "repo").exists()
        rc = main(["deploy", "triton", "--artifact", str(art.path), "--out", str(tmp_path / "repo"),
                   "--tokenizer-dir", str(moved), "--json"])
        assert rc == 0
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert last["kind"] == "trtllm" and last["max_attention_window_size"] == "64,64,1,1"
    finally:
        moved.rename(artifacts["tokenizer"])
    with pytest.raises(PreconditionError, match="lies inside the artifact"):
        write_repository(art.path, art.path / "triton")
    broken = tmp_path / "trtllm-broken"
    broken.mkdir()
    ArtifactStore.write_manifest(broken, {"stage": "trtllm", "key": "trtllm-broken"})
    assert main(["deploy", "triton", "--artifact", str(broken), "--out", str(tmp_path / "r2")]) == 2
    assert "has no checkpoint/config.json" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists()
    # by cache key through --workdir
    store_root = art.path.parent
    assert main(["deploy", "triton", "--artifact", art.key, "--out", str(tmp_path / "r3"), "--workdir",
                 str(store_root), "--json"]) == 0
    assert (tmp_path / "r3" / "tensorrt_llm" / "config.pbtxt").is_file()


def test_engine_without_our_window_list_is_refused(artifacts, tmp_path):
    """A built engine at --engine-dir whose config lacks the checkpoint's per-layer windows (a
    window-1 layer would then average V over the prefix, silently) is refused."""
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(json.dumps({"pretrained_config": {"runtime_defaults": {}}}))
    with pytest.raises(PreconditionError, match=r"has max_attention_window None, but .* need \[64, 64, 1, 1\]"):
        write_repository(artifacts["qwen2"].path, tmp_path / "repo", TritonRepoConfig(engine_dir=str(engine)))
    (engine / "config.json").write_text(json.dumps(
        {"pretrained_config": {"runtime_defaults": {"max_attention_window": [64, 64, 1, 1]}}}))
    write_repository(artifacts["qwen2"].path, tmp_path / "repo", TritonRepoConfig(engine_dir=str(engine)))


def test_v1_batching_is_refused():
    """V1 maps to BatchingType::kSTATIC, which the 1.x executor refuses at model load
    (Executor::Impl::createModel): refused before anything is written, naming the executor's error."""
    from harp_trt.errors import ConfigError

    with pytest.raises(ConfigError, match="batching_strategy must be 'inflight_fused_batching'") as e:
        TritonRepoConfig(batching_strategy="V1").validate()
    assert "Static batching type is deprecated" in str(e.value)


# ---- the Triton image: release table, TensorRT-LLM version, docker run -----------------------
_DOCKER_VALUE_OPTS = {"-p", "-v", "-e", "--gpus", "--shm-size", "--name", "--network", "--ulimit"}


def _docker_runs(readme: str) -> list[list[str]]:
    """Every ``docker run`` command of a README's bash blocks, as shell words."""
    import shlex

    runs = []
    for block in readme.split("```bash")[1:]:
        text = block.split("```")[0].replace("\\\n", " ")
        runs += [shlex.split(line) for line in text.splitlines() if line.startswith("docker run")]
    return runs


def _parse_docker_run(words: list[str]) -> tuple[dict[str, list[str]], str, list[str]]:
    """(options, image, command) as ``docker run`` reads them: options up to the first word that is
    neither an option nor an option's value; that word is the image, the rest the container's command."""
    assert words[:2] == ["docker", "run"]
    opts: dict[str, list[str]] = {}
    i = 2
    while words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        if not eq and name in _DOCKER_VALUE_OPTS:
            value, i = words[i + 1], i + 1
        opts.setdefault(name, []).append(value)
        i += 1
    return opts, words[i], words[i + 1:]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """(artifact, report, README) of a tp=2 Qwen2 engine route, engine not built: orchestrator mode and
    window shares both need an environment variable, and the engine spans two GPUs."""
    from harp_trt.models import ResolvedModel

    root = tmp_path_factory.mktemp("tp2")
    folder = save_tiny("qwen2", root / "qwen2")
    art = TrtllmCheckpointStage().execute(ArtifactStore(root / "cache"), TrtllmCheckpointConfig(
        **BUILD, tp_size=2, verify=False, build="never"), {
        "plan": _plan("qwen2", str(folder)), "model": ResolvedModel(str(folder), folder, "", "folder")})
    report = write_repository(art.path, root / "repo")
    return art, report, (root / "repo" / "README.md").read_text()


def test_docker_run_lines_parse_as_docker_arguments(tp2):
    """Every VAR=value sits behind -e and the command after the image is the program itself: the
    README's two runs (build the engine, start the server) and docker_run on its own."""
    from harp_trt.builders.triton.readme import docker_run

    art, report, readme = tp2
    runs = _docker_runs(readme)
    runs.append(_docker_runs("```bash\n" + docker_run("img:1", "tritonserver --model-repository=/models",
                                                        gpus=False) + "\n```")[0])
    assert len(runs) == 3
    for words in runs:
        opts, image, command = _parse_docker_run(words)
        assert command[0] in ("bash", "mpirun", "tritonserver"), command
        assert not any("=" in w and not w.startswith("-") for w in command), command
        for name, values in opts.items():  # VAR=value only as the value of -e
            assert name == "-e" or not any(re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", v) for v in values), (name, values)
    assert _parse_docker_run(runs[2])[2] == ["tritonserver", "--model-repository=/models"]
    assert "--gpus" not in _parse_docker_run(runs[2])[0]
    opts, image, _ = _parse_docker_run(runs[1])
    assert image == report["image"] == "nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3"
    shares = art.manifest["launch"]["kv_runtime"]["shares_env"]
    assert sorted(opts["-e"]) == sorted(["TRTLLM_ORCHESTRATOR=1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1", shares])
    assert opts["--gpus"] == ["2"] and f"{art.path}:{art.path}" in opts["-v"] and '$(pwd):/models' in opts["-v"]


def test_readme_builds_the_engine_in_the_image_before_serving(tp2):
    """An unbuilt engine leaves the tensorrt_llm model unloadable (the executor parses
    ``<gpt_model_path>/config.json``): the README's first run builds it in the serving image, with the
    artifact's own build_engine.sh writing exactly where gpt_model_path points, on the engine's GPUs."""
    art, report, readme = tp2
    assert report["engine_built"] is False and "The engine is not built yet" in readme
    assert readme.index("## Build the engine") < readme.index("## Start the server")
    build, serve = _docker_runs(readme)
    opts, image, command = _parse_docker_run(build)
    assert image == report["image"] and opts["--gpus"] == ["2"] and "-p" not in opts
    assert command == ["bash", str(art.path / "build_engine.sh"), report["engine_dir"]]
    assert report["engine_dir"] == string_params(parse_model_config(
        art.path.parent.parent / "repo" / "tensorrt_llm" / "config.pbtxt"))["gpt_model_path"]
    assert (art.path / "build_engine.sh").read_text().count('OUT="${1:-$HERE/engine}"') == 1  # its argument: the output
    assert f"{art.path}:{art.path}" in opts["-v"]  # the script, the checkpoint and the engine folder
    assert _parse_docker_run(serve)[1] == image  # built and served by one TensorRT-LLM


def test_server_starts_as_trtllms_launcher_starts_it(tp2, artifacts, tmp_path):
    """The flags TensorRT-LLM's launch_triton_server.py passes (get_cmd, add_multi_model_config, and
    the orchestrator environment of its __main__), for tp=2 and tp=1, in the README and in
    launch_command: before, the README ran a bare ``tritonserver --model-repository=/models``."""
    from harp_trt.builders.triton.readme import launch_command
    from harp_trt.builders.triton.releases import TRITON_TRTLLM

    _, _, readme = tp2
    _, _, command = _parse_docker_run(_docker_runs(readme)[1])
    shm = "--backend-config=python,shm-region-prefix-name=prefix0_"
    assert command == ["mpirun", "--allow-run-as-root", "-n", "1", "tritonserver", "--model-repository=/models",
                       "--pinned-memory-pool-byte-size=0", "--enable-peer-access=false",
                       "--cuda-memory-pool-byte-size=0:0", "--cuda-memory-pool-byte-size=1:0",
                       "--disable-auto-complete-config", shm]
    assert launch_command(2) == (command, {"TRTLLM_ORCHESTRATOR": "1", "TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES": "1"})
    assert sum(a.startswith("--cuda-memory-pool-byte-size=") for a in launch_command(4)[0]) == 4
    assert all(r > "24.06" for r in TRITON_TRTLLM)  # add_multi_model_config adds the pools only after 24.06
    write_repository(artifacts["qwen2"].path, tmp_path / "repo1")  # tp=1: one server, no MPI, no pools
    opts, _, command = _parse_docker_run(_docker_runs((tmp_path / "repo1" / "README.md").read_text())[1])
    assert command == ["tritonserver", "--model-repository=/models", "--disable-auto-complete-config", shm]
    assert opts["--gpus"] == ["1"] and not any(e.startswith("TRTLLM_ORCHESTRATOR") for e in opts["-e"])


def test_release_table_is_data_with_a_citation_per_row():
    from harp_trt.builders.triton.releases import (DEFAULT_TRITON_RELEASE, TRITON_ORT, TRITON_TRTLLM, TRTLLM_VERSION,
                                          check_trtllm_release)

    assert len(TRITON_TRTLLM) >= 8
    for release, row in TRITON_TRTLLM.items():
        assert re.fullmatch(r"\d\d\.\d\d", release) and row.release == release
        assert re.fullmatch(r"\d+\.\d+\.\d+(rc\d+)?", row.tensorrt_llm)
        assert (f"triton-inference-server/tensorrtllm_backend@r{release} (" in row.source
                and f"dockerfile/Dockerfile.triton.trt_llm_backend line" in row.source
                and row.source.endswith(f"ARG TENSORRTLLM_VER={row.tensorrt_llm}")), row
    # the pins the issue names, read on the backend's release branches
    assert [TRITON_TRTLLM[r].tensorrt_llm for r in ("25.10", "26.03", "26.04")] == ["1.0.0", "1.2.0rc8", "1.2.1"]
    assert TRITON_TRTLLM[DEFAULT_TRITON_RELEASE].tensorrt_llm == TRTLLM_VERSION
    assert DEFAULT_TRITON_RELEASE in TRITON_ORT and TritonRepoConfig().triton_release == DEFAULT_TRITON_RELEASE
    assert all(TRITON_TRTLLM[r].tensorrt_llm != TRTLLM_VERSION for r in TRITON_TRTLLM if r < DEFAULT_TRITON_RELEASE)
    assert check_trtllm_release("26.05", TRTLLM_VERSION).image.endswith(":26.05-trtllm-python-py3")


def test_default_release_carries_the_checkpoint_version_and_a_mismatch_exits_2(artifacts, tmp_path, capsys):
    from harp_trt.builders.triton.releases import DEFAULT_TRITON_RELEASE, TRITON_TRTLLM

    art = artifacts["qwen2"]
    target = art.manifest["tensorrt_llm"]["version"]
    assert main(["deploy", "triton", "--artifact", str(art.path), "--out", str(tmp_path / "ok"), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["triton_release"] == DEFAULT_TRITON_RELEASE and last["tensorrt_llm"] == target
    assert TRITON_TRTLLM[last["triton_release"]].tensorrt_llm == target
    readme = (tmp_path / "ok" / "README.md").read_text()
    assert f"TensorRT-LLM {target}" in readme and f"tritonserver:{DEFAULT_TRITON_RELEASE}-trtllm-python-py3" in readme
    assert json.loads((tmp_path / "ok" / "harp_triton.json").read_text())["tensorrt_llm_version"] == target
    for release, have in (("25.10", "1.0.0"), ("26.03", "1.2.0rc8")):
        rc = main(["deploy", "triton", "--artifact", str(art.path), "--out", str(tmp_path / release),
                   "--triton-release", release])
        err = capsys.readouterr().err
        assert rc == 2 and f"Triton {release} carries TensorRT-LLM {have}" in err
        assert f"targets TensorRT-LLM {target}" in err
        assert not (tmp_path / release).exists()
