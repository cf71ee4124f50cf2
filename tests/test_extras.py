"""Optional dependencies (``harp_trt.extras``, pyproject.toml's extras): each missing one is a typed
one-line error naming its extra (exit 2 through the CLI, nothing written), the PNGs are skipped
with a warning without matplotlib, and the main path imports none of the optional libraries.

A missing library is a real ImportError: a subprocess sets ``sys.modules[name] = None`` (for the
name and its loaded submodules) before anything imports it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import save_tiny
from harp_trt.extras import EXTRAS

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("lm_eval", "tritonclient", "matplotlib")

# argv[1]: modules to block; argv[2]: CLI argv, or null; argv[3]: Python run after it, or ""
_RUNNER = """
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
code = None
if json.loads(sys.argv[2]) is not None:
    from harp_trt.cli import main
    try:
        code = main(json.loads(sys.argv[2]))
    except SystemExit as e:
        code = e.code
from harp_trt.errors import HarpError
try:
    exec(sys.argv[3])
except HarpError as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
print(json.dumps({"code": code, "loaded": sorted(m for m in %r if sys.modules.get(m) is not None)}))
""" % (OPTIONAL,)


def run(blocked: tuple[str, ...], argv: list[str] | None, code: str = "") -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(blocked), json.dumps(argv), code],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if "error:" in l or "Error:" in l]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_calibrate_cli import write_corpus

    tmp = tmp_path_factory.mktemp("extras")
    return save_tiny("llama", tmp / "tiny-llama"), write_corpus(tmp / "corpus.txt")


@pytest.mark.slow
def test_build_without_onnxruntime_names_cpu_and_gpu_extras_before_calibrating(tiny, tmp_path):
    folder, corpus = tiny
    res, err = run(("onnxruntime",), ["build", "--model", str(folder), "--workdir", str(tmp_path / "w"),
                                      "--corpus", str(corpus)])
    assert res["code"] == 2
    assert error_line(err) == ("harp-trt build: error: onnxruntime is not installed: the export's check against "
                               "PyTorch needs it; pip install -e '.[cpu]' (or '.[gpu]' on a CUDA host) in the harp-trt checkout")
    assert not list((tmp_path / "w").glob("calibrate-*"))  # refused before calibrate's work
    # the engine's own session, reached without the pipeline (harp-trt generate, served models)
    res, err = run(("onnxruntime",), None, "from harp_trt.ort_session import default_providers; default_providers()")
    assert error_line(err).startswith("MissingDependencyError: onnxruntime is not installed: ONNX Runtime sessions")


@pytest.mark.slow
def test_bench_without_lm_eval_names_the_eval_extra(tiny, tmp_path):
    folder, corpus = tiny
    res, err = run(("lm_eval",), ["build", "--model", str(folder), "--workdir", str(tmp_path / "w"),
                                  "--corpus", str(corpus), "--bench", "--bench-tasks", "piqa"],
                   "import harp_trt.bench.stage.lm_eval_adapter")
    assert res["code"] == 2
    line = "lm-eval is not installed: the bench's accuracy tasks need it"
    assert error_line(err.split("MissingDependencyError")[0]) == (
        f"harp-trt build: error: {line} (or pass --tasks none); pip install -e '.[eval]' in the harp-trt checkout")
    assert f"MissingDependencyError: {line}; pip install -e '.[eval]' in the harp-trt checkout" in err  # importing the adapter
    assert not list((tmp_path / "w").glob("calibrate-*"))


@pytest.mark.slow
def test_gguf_backend_without_llama_cpp_names_the_gguf_extra_before_calibrating(tiny, tmp_path):
    folder, corpus = tiny
    res, err = run(("llama_cpp",), ["build", "--model", str(folder), "--workdir", str(tmp_path / "w"),
                                    "--corpus", str(corpus), "--backend", "gguf"])
    assert res["code"] == 2
    assert error_line(err) == ("harp-trt build: error: llama-cpp-python is not installed: llama.cpp writes, checks "
                               "and quantizes the GGUF; pip install -e '.[gguf]' in the harp-trt checkout (it builds "
                               "llama.cpp from source: ~10 CPU-minutes)")
    assert not list((tmp_path / "w").glob("calibrate-*"))


def test_triton_config_check_without_tritonclient_names_the_triton_extra():
    res, err = run(("tritonclient",), None,
                   "from harp_trt.builders.triton.pbtxt import parse_model_config; parse_model_config('name: \"m\"')")
    assert error_line(err) == ("MissingDependencyError: tritonclient is not installed: Triton repositories need it "
                               "(each config.pbtxt is checked against its ModelConfig schema); "
                               "pip install -e '.[triton]' in the harp-trt checkout")


@pytest.mark.slow
def test_calibrate_without_matplotlib_skips_the_png_and_keys_it_apart(tiny, tmp_path, capsys):
    folder, corpus = tiny
    argv = ["calibrate", "--model", str(folder), "--layers", "2", "--tokens", "256", "--seq-len", "64",
            "--corpus", str(corpus), "--workdir", str(tmp_path / "w"), "--json"]
    res, err = run(("matplotlib",), argv, "from harp_trt.calib.plots import plot_search; plot_search(None, [], None)")
    assert res["code"] == 0 and res["loaded"] == []  # calibrate imports no optional library
    # a first run without the plots extra prints no warning: the PNG's absence is logged at info level and
    # the summary prints the alpha search as text
    assert "alpha_search.png not written" not in err and "WARNING" not in err, err
    assert ("MissingDependencyError: matplotlib is not installed: the alpha-search plot needs it; "
            "pip install -e '.[plots]' in the harp-trt checkout") in err  # the plot itself, called directly
    bare = [p for p in (tmp_path / "w").glob("calibrate-*") if p.is_dir()]
    assert len(bare) == 1 and (bare[0] / "plan.json").is_file() and not (bare[0] / "alpha_search.png").exists()
    # with matplotlib (this process): another key, the figures written, the same plan
    from harp_trt.cli import main

    assert main(argv) == 0
    full = [p for p in (tmp_path / "w").glob("calibrate-*") if p.is_dir() and p != bare[0]]
    assert len(full) == 1 and (full[0] / "alpha_search.png").stat().st_size > 1000
    plan = lambda p: {k: v for k, v in json.loads((p / "plan.json").read_text()).items() if k != "extra"}
    assert plan(full[0]) == plan(bare[0])


def test_help_and_main_path_import_no_optional_library():
    res, _ = run((), ["build", "--help"],
                 "import harp_trt.calib.stage, harp_trt.pipeline, harp_trt.export.export, harp_trt.rewrite.stage, "
                 "harp_trt.builders.ort.builder, harp_trt.bench.stage, harp_trt.ort_session")
    assert res["code"] == 0 and res["loaded"] == []


def test_extras_in_pyproject_match_the_hints():
    """Every install hint names an extra of pyproject.toml that installs that distribution, none of
    them is a base dependency, and the gpu extra never brings the CPU onnxruntime."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, base = project["optional-dependencies"], " ".join(project["dependencies"])
    for module, (dist, hint) in EXTRAS.items():
        extra = hint.split("'.[")[1].split("]")[0]
        assert any(r.startswith(dist) for r in extras[extra]), (module, extra)
        assert dist not in base, dist
    assert [r.split("==")[0] for r in extras["gpu"]] == ["onnxruntime-gpu"]
    assert "harp-trt[cpu,eval,triton,plots,genai]" in extras["test"]
