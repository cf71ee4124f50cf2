"""Bad input through ``harp_trt.cli.main``, command by command: each case raises its typed
``HarpError`` (checked by calling the command's ``run`` directly), and through ``main`` prints one
error line (plus at most a hint), exits 2 and leaves no artifact and nothing in the cache's .tmp."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import save_tiny
from harp_trt.cli import build_parser, main
from harp_trt.errors import CacheError, ConfigError, GraphError, HarpError

NO_KEY = "calibrate-0123456789abcdef"  # a well-formed key no cache holds


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny 4-layer llama (4 heads, 2 KV heads), a valid plan for it, and broken plans."""
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan

    root = tmp_path_factory.mktemp("cli-errors")
    tiny = save_tiny("llama", root / "tiny")
    digest = resolve_model(str(tiny), root / "setup-cache").digest
    good = Plan(model_ref=str(tiny), model_digest=digest, family="llama", num_layers=4, strategy="top",
                layers=(2, 3), alphas=(0.5, 0.5))
    good.save(root / "plan.json")
    d = good.to_dict()
    plans = {
        "not-json.json": "{layers: [2, 3]",
        "list.json": json.dumps([d]),
        "wrong-format.json": json.dumps(d | {"format": "harp-plan/0"}),
        "unknown-key.json": json.dumps(d | {"layer_alphas": [0.5]}),
        "missing-key.json": json.dumps({k: v for k, v in d.items() if k != "alphas"}),
        "wrong-type.json": json.dumps(d | {"layers": "2,3"}),
        "bad-alpha.json": json.dumps(d | {"alphas": [0.5, "high"]}),
        "out-of-range.json": json.dumps(d | {"layers": [2, 9]}),
    }
    for name, text in plans.items():
        (root / name).write_text(text)
    (root / "binary.json").write_bytes(b"\xff\xfe\x00plan")
    (root / "broken.onnx").write_text("not a protobuf")
    outside = root / "not-in-cache"  # a folder that looks like an artifact, outside the cache
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")
    return root


# (argv with R = the setup folder, T = the tiny model, error class, text the message holds)
PLAN_CASES = [
    ("R/missing.json", ConfigError, "no plan at"),
    ("R/not-json.json", ConfigError, "is not valid JSON"),
    ("R/binary.json", ConfigError, "is not valid JSON"),
    ("R/list.json", ConfigError, "not a harp plan: a JSON list"),
    ("R/wrong-format.json", ConfigError, "not a harp plan (format 'harp-plan/0'"),
    ("R/unknown-key.json", ConfigError, "unknown key(s) layer_alphas"),
    ("R/missing-key.json", ConfigError, "missing key(s) alphas"),
    ("R/wrong-type.json", ConfigError, "'layers' must be a list of layer indices"),
    ("R/bad-alpha.json", ConfigError, "'alphas' must be a list of numbers"),
    ("R/out-of-range.json", ConfigError, "plan layers [9] out of range 0..3"),
    ("R/not-in-cache", ConfigError, "no plan at"),  # a folder without plan.json
    (NO_KEY, CacheError, f"no artifact {NO_KEY}"),
]
PLAN_COMMANDS = [["eval"], ["rewrite"], ["bench", "--no-latency"], ["deploy", "trtllm"], ["deploy", "gguf"]]

CASES = [
    *[(cmd + ["--plan", plan], err, needle) for cmd in PLAN_COMMANDS for plan, err, needle in PLAN_CASES],
    # generate: the artifact, the prompt, the sampling values
    (["generate", "--artifact", "R/nowhere", "--prompt", "hi"], GraphError, "no engine folder or cached artifact"),
    (["generate", "--artifact", "T", "--prompt", "hi"], GraphError, "has no engine.json"),
    (["generate", "--artifact", NO_KEY, "--prompt", "hi"], GraphError, f"no engine folder or cached artifact '{NO_KEY}'"),
    (["generate", "--artifact", "T", "--prompt", ""], ConfigError, "--prompt is empty"),
    (["generate", "--artifact", "T", "--prompt", "  "], ConfigError, "--prompt is empty"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--max-new-tokens", "0"], ConfigError, "--max-new-tokens must be >= 1"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--sample", "--temperature", "0"], ConfigError,
     "--temperature must be > 0"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--temperature", "nan"], ConfigError, "--temperature must be >= 0"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--sample", "--temperature", "-1"], ConfigError,
     "--temperature must be >= 0"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--top-p", "0"], ConfigError, "--top-p must lie in (0, 1]"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--top-p", "1.5"], ConfigError, "--top-p must lie in (0, 1]"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--top-k", "-1"], ConfigError, "--top-k must be >= 0"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--threads", "-2"], ConfigError, "--threads must be >= 0"),
    (["generate", "--artifact", "T", "--prompt", "hi", "--seed", "-1"], ConfigError, "--seed must be >= 0"),
    # cache
    (["cache", "rm"], ConfigError, "cache rm needs a KEY"),
    (["cache", "rm", NO_KEY], CacheError, f"no artifact '{NO_KEY}'"),
    (["cache", "rm", "R/not-in-cache"], CacheError, "is not an artifact key"),
    (["cache", "rm", ".tmp"], CacheError, "is not an artifact key"),
    (["cache", "ls", NO_KEY], ConfigError, "cache ls takes no KEY"),
    # score --save, checked before the scoring
    (["score", "--model", "T", "--save", "R/scores.txt"], ConfigError, "--save must end in .csv or .parquet"),
    (["score", "--model", "T", "--save", "R/no-such-folder/scores.csv"], ConfigError, "does not exist"),
    (["score", "--model", "T", "--save", "R"], ConfigError, "--save must end in .csv or .parquet"),
    (["score", "--model", "T", "--layers", "0"], ConfigError, "--layers must be a positive number"),
    # rewrite --onnx
    (["rewrite", "--plan", "R/plan.json", "--onnx", "R/missing.onnx"], ConfigError, "R/missing.onnx: no such file"),
    (["rewrite", "--plan", "R/plan.json", "--onnx", "R/broken.onnx", "--no-verify"], GraphError,
     "is not a readable ONNX model"),
    # deploy trtllm: tp / pp / dtype
    (["deploy", "trtllm", "--plan", "R/plan.json", "--tp", "0"], ConfigError, "tp_size must be a positive integer"),
    (["deploy", "trtllm", "--plan", "R/plan.json", "--pp", "-1"], ConfigError, "pp_size must be a positive integer"),
    (["deploy", "trtllm", "--plan", "R/plan.json", "--dtype", "int8"], ConfigError, "unsupported TensorRT-LLM dtype 'int8'"),
    (["deploy", "trtllm", "--plan", "R/plan.json", "--tp", "3"], ConfigError,
     "tp_size=3 does not divide the model's 4 attention heads"),
    (["deploy", "trtllm", "--plan", "R/plan.json", "--pp", "8"], ConfigError, "pp_size=8 exceeds the model's 4 decoder layers"),
    (["deploy", "trtllm", "--plan", "R/plan.json", "--pp", "3"], ConfigError, "has no attention layer left after pruning"),
    # deploy gguf: llama.cpp type and dtype (plan of another model, unsupported family: test_gguf_deploy.py)
    (["deploy", "gguf", "--plan", "R/plan.json", "--gguf-type", "q4_km"], ConfigError, "unknown GGUF type 'q4_km'"),
    (["deploy", "gguf", "--plan", "R/plan.json", "--dtype", "fp16"], ConfigError, "unsupported GGUF dtype 'fp16'"),
    # --paper-alphas only on the top layers (refused before any model is fetched)
    (["calibrate", "--model", "llama3.1-8b", "--paper-alphas", "--strategy", "sink"], ConfigError,
     "--strategy sink would put them on other layers"),
    (["calibrate", "--model", "qwen2-7b", "--paper-alphas", "--prune-layers", "1,2,3,4"], ConfigError,
     "--prune-layers 1,2,3,4 would put them on other layers"),
    (["build", "--model", "gemma2-9b", "--paper-alphas", "--strategy", "gate-norm"], ConfigError,
     "--strategy gate-norm would put them on other layers"),
    # the search split and the paper objective's BOS (refused before the model loads)
    (["calibrate", "--model", "T", "--search-split", "all"], ConfigError, "the held-out perplexity needs another text"),
    (["calibrate", "--model", "T", "--heldout-corpus", "R/other.txt"], ConfigError,
     "--heldout-corpus goes with --search-split all"),
    (["calibrate", "--model", "T", "--search-split", "all", "--heldout-corpus", "wiki"], ConfigError,
     "--heldout-corpus wiki is the search corpus"),
    (["calibrate", "--model", "T", "--paper-bos", "lm-eval-0.4.7"], ConfigError,
     "--paper-bos lm-eval-0.4.7 applies to --objective paper only"),
    # fitted replacements (calib/fit.py): where no engine or no search can take them
    (["calibrate", "--model", "T", "--replacement", "rrr", "--alphas", "0.5,0.5"], ConfigError,
     "--replacement rrr is chosen by the alpha search, which --alphas skips"),
    (["build", "--model", "T", "--replacement", "lmmse", "--backend", "gguf"], ConfigError,
     "--replacement lmmse cannot go to --backend gguf (stage gguf): llama.cpp's deci linear attention"),
]


def _argv(args: list[str], root: Path) -> list[str]:
    def sub(a: str) -> str:
        if a == "T":
            return str(root / "tiny")
        return str(root) + a[1:] if a == "R" or a.startswith("R/") else a

    return [sub(a) for a in args]


def _ids(case) -> str:
    return " ".join(case[0])[:90]


@pytest.mark.parametrize("argv,error,needle", CASES, ids=[_ids(c) for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_no_artifact(setup, tmp_path, capsys, monkeypatch, argv, error, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a refused preset must not reach for a hub
    cache = tmp_path / "cache"
    argv = _argv(argv, setup)
    needle = needle.replace("R/", f"{setup}/")
    # the typed error, from the command itself
    args = build_parser().parse_args([*argv, "--workdir", str(cache)])
    with pytest.raises(HarpError) as info:
        args._module.run(args)
    assert isinstance(info.value, error), repr(info.value)
    assert info.value.exit_code == 2
    # through main: exit 2, one line (and at most a hint), no traceback
    assert main([*argv, "--workdir", str(cache)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(f"harp-trt {argv[0]}: error: ") and needle in err[0], err
    assert len(err) == 1 or (len(err) == 2 and err[1].startswith("  hint: ")), err
    # nothing cached: no artifact folder, nothing half-written
    if cache.exists():  # commands that fail before opening the store never create it
        assert not [p for p in cache.iterdir() if re.fullmatch(r"[a-z_]+-[0-9a-f]{16}", p.name)]
        assert not list((cache / ".tmp").iterdir())
    assert (setup / "not-in-cache" / "manifest.json").is_file()  # `cache rm PATH` deleted nothing outside


def test_an_old_plan_without_the_split_record_still_loads(setup):
    """Plans written before the search split was recorded load, and say they used halves."""
    from harp_trt.plan import Plan

    d = json.loads((setup / "plan.json").read_text())
    assert "search_split" not in d["extra"]
    plan = Plan.from_dict(d)
    assert plan.search_split == "halves" and plan.layers == (2, 3)


def test_generate_refuses_a_cached_artifact_that_is_not_an_engine(tmp_path, capsys):
    """An artifact key of another stage is named as such, and the artifact stays."""
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(tmp_path / "cache")
    key = ArtifactStore.make_key("calibrate", {"probe": 1})
    with store.lock(key), store.writing(key) as tmp:
        ArtifactStore.write_manifest(tmp, {"stage": "calibrate"})
    assert main(["generate", "--artifact", key, "--prompt", "hi", "--workdir", str(store.root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"harp-trt generate: error: [generate] artifact {key} is a calibrate artifact, not an engine"]
    assert store.get(key) is not None and not list((store.root / ".tmp").iterdir())


@pytest.mark.slow
def test_sigterm_mid_stage_leaves_nothing_half_written(setup, tmp_path):
    """A runner's SIGTERM while a stage writes (here the export of a tiny model) unwinds like Ctrl-C:
    exit 130, the stage's temp folder removed, no artifact published."""
    import os
    import signal
    import subprocess
    import sys
    import time

    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "harp_trt.cli", "build", "--model", str(setup / "tiny"), "--layers", "1",
           "--alphas", "0.5", "--workdir", str(cache)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (cache / ".tmp").is_dir() and any((cache / ".tmp").iterdir()):
            break  # a stage is writing now
        time.sleep(0.05)
    assert proc.poll() is None, f"the build ended before a stage wrote: {proc.communicate()}"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; no artifact was written" in err
    assert not list((cache / ".tmp").iterdir())
    published = [p for p in cache.iterdir() if (p / "manifest.json").is_file()]
    assert len(published) <= 2  # the stages that had finished before the signal, each complete
