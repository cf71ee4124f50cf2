"""The one registry: stages and backends as lazy ``"module:Class"`` entries that the pipeline walks
and the CLI reads (defaults from light config modules, so ``harp-trt --help`` imports no framework)."""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import time

import pytest

from harp_trt.config import StageConfig
from harp_trt.errors import UnknownNameError
from harp_trt.registry import BACKENDS, PHASES, STAGES, Registry, load_object
from harp_trt.stage import Stage

HEAVY = ("torch", "onnx", "onnxruntime", "onnx_ir", "transformers", "numpy", "polars", "safetensors")


def _modules_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; return which HEAVY modules it imported and its wall time."""
    probe = (f"import sys, time, json\nt = time.perf_counter()\n{code}\n"
             f"print(json.dumps({{'heavy': [m for m in {HEAVY!r} if m in sys.modules], "
             f"'seconds': time.perf_counter() - t}}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_help_imports_no_framework():
    """Every command's --help builds from the registry and light config modules only."""
    code = ("import contextlib, io\nfrom harp_trt.cli import COMMANDS, main\n"
            "for argv in [['--help']] + [[c, '--help'] for c in COMMANDS]:\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as buf:\n"
            "        try:\n            main(argv)\n        except SystemExit as e:\n"
            "            assert e.code == 0, (argv, e.code)\n"
            "    assert 'usage: harp-trt' in buf.getvalue(), argv")
    got = _modules_after(code)
    assert got["heavy"] == []


def test_help_is_fast():
    """`harp-trt --help` as users run it: well under a second (torch alone takes ~2 s to import).
    The bound is loose on purpose (shared machines); the import check above is the exact one."""
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "harp_trt.cli", "--help"], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t
    assert out.returncode == 0 and "bench" in out.stdout and "95% CIs" in out.stdout
    assert seconds < 1.5, f"harp-trt --help took {seconds:.2f} s"


@pytest.fixture(scope="module")
def fresh_code_versions() -> dict[str, str]:
    """Every registered stage's code version as a fresh interpreter computes it."""
    code = ("import json\nfrom harp_trt.registry import STAGES\n"
            "print(json.dumps({n: STAGES.get(n).stage_class().code_version() for n in STAGES.names()}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _recomputed_key(stage: str, material: dict) -> str:
    """``<stage>-<sha256[:16]>`` of the stage name and its material as canonical JSON (sorted keys,
    no spaces), as harp_trt/store.py documents the key; written out here, not called."""
    text = json.dumps({"stage": stage, **material}, sort_keys=True, separators=(",", ":"))
    return f"{stage}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _another_value(stage: str, field: str, value, tmp_path):
    """A different value of a config field's type (validity aside: the key hashes whatever is set)."""
    if (stage, field) == ("bench", "task_dir"):  # hashed by content: a folder with a task in it
        (tmp_path / "task.yaml").write_text("task: x\n")
        return str(tmp_path)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    if isinstance(value, tuple):
        return value + (value[-1],) if value else (7,)
    if value is None:
        return 7
    pytest.fail(f"{stage}.{field}: the test has no other value for a {type(value).__name__}")


# config fields the key leaves out on purpose, with why (bench/stage/config.py: BenchConfig.key_material)
NOT_IN_KEY = {("bench", "eval_data"): "a path: the eval wheel it names is pinned",
              # in the key with --recover only, so plans without recovery keep their keys (tests/test_recover.py)
              **{("calibrate", f"recover_{k}"): "with --recover only" for k in ("tokens", "steps", "lr")}}


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGES.names())
def test_stage_entries_resolve(name, fresh_code_versions):
    spec = STAGES.get(name)
    assert spec.phase in PHASES
    cls = spec.stage_class()
    assert issubclass(cls, Stage) and cls.name == name   # the registry name is the artifact's stage name
    assert issubclass(spec.config_class(), StageConfig)
    # the code version: 16 hex digits of sha256, the same in another process (nothing in it is an
    # address, a time or a path), and its own: no other stage's code has the same
    version = cls.code_version()
    assert re.fullmatch(r"[0-9a-f]{16}", version), version
    assert version == cls.code_version() == fresh_code_versions[name]
    assert list(fresh_code_versions.values()).count(version) == 1, fresh_code_versions


@pytest.mark.parametrize("name", STAGES.names())
def test_stage_key_hashes_every_config_field(name, tmp_path):
    """A stage's key is the documented hash of its material; the same config (rebuilt from its own
    dict) keys the same, and changing any one field of the config changes the key."""
    from harp_trt.store import ArtifactStore

    spec = STAGES.get(name)
    stage, config = spec.stage_class()(), spec.config_class()()
    store = ArtifactStore(tmp_path / "store")

    def key(cfg) -> str:
        material = Stage.key_material(stage, cfg, {})  # the base material (stages add their inputs' digests)
        assert material["config"] == cfg.key_material() and material["code"] == type(stage).code_version()
        return store.make_key(name, material)

    base = key(config)
    assert base == _recomputed_key(name, Stage.key_material(stage, config, {}))
    assert key(type(config).from_dict(config.to_dict())) == base
    for field in dataclasses.fields(config):
        if (name, field.name) in NOT_IN_KEY:
            continue
        changed = copy.copy(config)
        object.__setattr__(changed, field.name, _another_value(name, field.name, getattr(config, field.name), tmp_path))
        assert key(changed) != base, f"{name}: changing {field.name} leaves the key {base}"


def test_a_real_stage_key_is_its_documented_hash(tmp_path):
    """``Stage.key`` of the ORT build (the base material: stage version, code version, config,
    upstream keys) equals the hash written out here, and follows the upstream artifact's key."""
    from harp_trt.builders.ort.builder import OrtBuildStage
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.store import Artifact, ArtifactStore

    store, stage, config = ArtifactStore(tmp_path), OrtBuildStage(), OrtBuildConfig(quant="int4")
    upstream = Artifact("export-0123456789abcdef", tmp_path / "export-0123456789abcdef", {"stage": "export"})
    material = {"stage_version": stage.version, "code": OrtBuildStage.code_version(),
                "config": {"config": "OrtBuildConfig", "version": OrtBuildConfig.VERSION,
                           **{f.name: (list(v) if isinstance(v := getattr(config, f.name), tuple) else v)
                              for f in dataclasses.fields(config)}},
                "upstream": {"onnx": upstream.key}}
    got = stage.key(store, config, {"onnx": upstream})
    assert got == _recomputed_key("build-ort", material)
    other = Artifact("export-fedcba9876543210", upstream.path, upstream.manifest)
    assert stage.key(store, config, {"onnx": upstream}) == got
    assert stage.key(store, config, {"onnx": other}) != got
    assert stage.key(store, OrtBuildConfig(quant="int8"), {"onnx": upstream}) != got


def test_config_modules_are_light():
    code = "from harp_trt.registry import STAGES\nfor n in STAGES.names():\n    STAGES.get(n).config_class()()"
    assert _modules_after(code)["heavy"] == []


def test_backend_steps_are_wired():
    """Every step names a registered stage and reads only the model, the plan or earlier steps."""
    for name in BACKENDS.names():
        spec = BACKENDS.get(name)
        seen = {"model", "plan", "calibrate"}
        for step in spec.steps:
            STAGES.check(step.stage)
            assert step.when in ("always", "bench")
            for fn in (step.only_if, step.adjust):
                assert not fn or callable(load_object(fn)), (name, step.name, fn)
            missing = [src for _, src in step.inputs if src not in seen]
            assert not missing, (name, step.name, missing)
            seen.add(step.name)
        assert all(s in seen for _, s in spec.engines), name
    assert [s.name for s in BACKENDS.get("triton").steps][-1] == "build:triton"
    assert callable(load_object(BACKENDS.get("trtllm").after))


def test_core_names_no_backend_option():
    """The pipeline knows no backend and no option of one: no backend name, no
    ``quant``/``fp32`` in its code (names, attributes, strings outside docstrings)."""
    import ast
    from pathlib import Path

    import harp_trt.pipeline as pipeline

    banned = set(BACKENDS.names()) | {"quant", "fp32"}
    tree = ast.parse(Path(pipeline.__file__).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    words = [n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else n.value
             for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))
             or (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs)]
    assert not [w for w in words if any(b in w.split() or b == w for b in banned)]



def test_unknown_names_say_did_you_mean():
    with pytest.raises(UnknownNameError, match=r"unknown backend 'onnxrt'.*valid: genai, gguf, ort, triton, trtllm"):
        BACKENDS.get("onnxrt")
    with pytest.raises(UnknownNameError, match="did you mean 'ort'"):
        BACKENDS.check("orte")
    with pytest.raises(UnknownNameError, match="did you mean 'rewrite'"):
        STAGES.check("rewrit")


def test_registry_checks_the_base_class():
    reg = Registry("thing", base="harp_trt.stage:Stage")
    reg.register("config", "harp_trt.config:StageConfig")
    reg.register("stage", "harp_trt.export.export:ExportStage")
    assert reg.get("stage").name == "export"
    with pytest.raises(TypeError, match="not a subclass of Stage"):
        reg.get("config")


def test_unknown_command_says_did_you_mean(capsys):
    from harp_trt.cli import COMMANDS, main

    assert isinstance(COMMANDS, Registry) and COMMANDS.in_order()[0] == "build"
    assert main(["calibrat", "--model", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("harp-trt: error: unknown command 'calibrat'; valid: bench, build, cache")
    assert err[1] == "  hint: did you mean 'calibrate'?"


def test_run_build_engines_are_checked_before_any_work(tmp_path):
    """``run_build(engines=...)`` (a benchmark script's dense and HARP engines, no bench): a step the
    backend lacks, or engines beside a bench config, is a ConfigError before calibrate runs."""
    from harp_trt.bench.stage.config import BenchConfig
    from harp_trt.errors import ConfigError
    from harp_trt.pipeline import run_build
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(tmp_path / "cache")
    calib = STAGES.get("calibrate").config_class()()
    with pytest.raises(ConfigError, match="has no step 'build:nope'"):
        run_build("missing-model", calib, store, "ort", engines=(("dense", "build:nope"),))
    with pytest.raises(ConfigError, match="engines or bench_config"):
        run_build("missing-model", calib, store, "ort", bench_config=BenchConfig(engine="ort"),
                  engines=(("dense", "build:dense"),))
    assert not list((tmp_path / "cache").glob("calibrate-*"))
