"""What a stage's code key counts (``harp_trt.codekey``), tested by mutation on real stages:
comments and docstrings are not code, a library enters a key as the installed distribution that
provides a module its code imports (numpy, ml_dtypes, accelerate, datasets; onnxruntime-gpu apart
from onnxruntime), and an import inside a function that the stage never runs stays out of its key
(an onnx upgrade re-keys export and rewrite, not calibrate). A traced run checks that last rule
against what the stage really imports."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import save_tiny
from harp_trt import codekey
from harp_trt.codekey import REPO_ROOT, code_key, import_closure, module_file
from harp_trt.registry import STAGES

STAGE_MODULES = {n: STAGES.get(n).stage.partition(":")[0] for n in STAGES.names()}


def _keys(root: Path = REPO_ROOT) -> dict[str, codekey.CodeKey]:
    codekey.clear_cache()
    return {stage: code_key((module,), root) for stage, module in STAGE_MODULES.items()}


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder first on ``sys.path`` where a test installs distribution metadata (what pip writes:
    ``<name>-<version>.dist-info`` with METADATA and top_level.txt); the keys are computed afresh."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    codekey.clear_cache()
    yield folder
    monkeypatch.undo()
    codekey.clear_cache()


def _install(site: Path, name: str, version: str, top_level: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(top_level + "\n")


@pytest.mark.slow
def test_an_onnx_upgrade_rekeys_the_stages_that_run_onnx_and_not_calibrate(site):
    """onnx 99.0 first on the path: exactly the stages whose code runs an onnx import re-key
    (export, rewrite, the builders that read graphs); calibrate, whose closure reaches onnx only
    through ``harp_trt.onnx_io.read_export_meta``, a function it never calls, keeps its key."""
    before = _keys()
    _install(site, "onnx", "99.0", "onnx")
    after = _keys()
    assert md.version("onnx") == "99.0" and dict(after["export"].libraries)["onnx"] == "99.0"
    changed = {s for s in before if before[s].digest != after[s].digest}
    assert changed == {s for s, k in before.items() if "onnx" in dict(k.libraries)}
    assert {"export", "rewrite", "build-ort", "genai", "bench"} <= changed
    assert "calibrate" not in changed and "onnx" not in import_closure((STAGE_MODULES["calibrate"],)).external


@pytest.mark.slow
def test_onnxruntime_gpu_is_keyed_apart_from_onnxruntime(site):
    """Both provide the module ``onnxruntime``: an installed onnxruntime-gpu enters the keys of the
    stages that import it under its own name, whatever onnxruntime's version."""
    before = _keys()
    _install(site, "onnxruntime-gpu", md.version("onnxruntime"), "onnxruntime")
    after = _keys()
    ort = dict(after["build-ort"].libraries)
    assert ort["onnxruntime-gpu"] == ort["onnxruntime"] == md.version("onnxruntime")
    assert "onnxruntime-gpu" not in dict(before["build-ort"].libraries)
    assert after["build-ort"].digest != before["build-ort"].digest
    assert after["calibrate"].digest == before["calibrate"].digest


def test_the_libraries_are_the_distributions_the_code_imports():
    """No hand list: numpy (rewrite folds, quantizer buffers), ml_dtypes (bf16 export), accelerate,
    datasets (bench accuracy) are in the keys of the stages whose code imports them, each at its
    installed version, the standard library never; transformers brings tokenizers and safetensors."""
    keys = _keys()
    libs = {s: dict(k.libraries) for s, k in keys.items()}
    assert {"numpy", "ml-dtypes", "onnx", "onnx-ir", "onnxscript", "onnxruntime", "torch"} <= set(libs["export"])
    assert {"numpy", "ml-dtypes", "onnx-ir"} <= set(libs["rewrite"]) and "numpy" in libs["build-ort"]
    assert {"accelerate", "torch", "transformers", "tokenizers", "safetensors"} <= set(libs["calibrate"])
    assert not {"onnx", "onnxruntime", "onnxscript"} & set(libs["calibrate"])
    assert {"datasets", "lm-eval", "numpy", "onnxruntime-genai"} <= set(libs["bench"])
    for stage, found in libs.items():
        assert not set(found) & set(sys.stdlib_module_names), stage
        assert all(v == md.version(d) for d, v in found.items() if v is not None), stage
    assert codekey.library_versions_of({"yaml", "json", "harp_absent_module", "transformers.models"}) == (
        ("harp_absent_module", None), ("pyyaml", md.version("PyYAML")), ("safetensors", md.version("safetensors")),
        ("tokenizers", md.version("tokenizers")), ("transformers", md.version("transformers")))


@pytest.mark.slow
def test_a_comment_or_docstring_edit_rekeys_no_stage_a_code_edit_every_one(tmp_path):
    """In a copy of the repository: comments, blank lines and docstrings added to ``errors.py``
    (which all 9 stages import) change no key; one statement changes all 9. A Triton asset is
    copied into the artifact as it is: a comment there re-keys the triton stage."""
    root = tmp_path / "repo"
    for pkg in ("harp_trt", "calib", "builders", "bench"):
        shutil.copytree(REPO_ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _keys(root)
    errors = root / "harp_trt" / "errors.py"
    text = errors.read_text()
    doc_end = text.index('"""', 3) + 3
    edited = ('"""Another module docstring, reworded."""' + text[doc_end:]).replace(
        "\nclass ", '\n# a comment on the class below\n\n\nclass ', 1)
    edited = edited.replace("):\n", '):\n    """A docstring added."""\n', 1)
    assert edited != text and compile(edited, "errors.py", "exec")
    errors.write_text(edited)
    assert {s: k.digest for s, k in _keys(root).items()} == {s: k.digest for s, k in before.items()}
    errors.write_text(edited + "\n_CHANGED = True\n")
    after = _keys(root)
    assert all("harp_trt.errors" in k.modules for k in before.values())
    assert {s for s in before if before[s].digest != after[s].digest} == set(before)
    asset = root / "builders" / "triton" / "assets" / "ort_llm_model.py"
    asset.write_text(asset.read_text() + "\n# a comment\n")
    last = _keys(root)
    assert {s for s in after if after[s].digest != last[s].digest} == {"triton"}
    codekey.clear_cache()


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_function_counts_when_code_that_runs_names_it(tmp_path):
    """Rule 1 on a package built here: a function taken by name, the functions it calls, one that
    module-level code calls, a decorated one and every method count; a function nobody names does
    not, until its module is taken whole (``import m``), named in a ``"m:f"`` string, or reached
    through ``globals()``."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/helpers.py": ("import json\nfrom .lib import table\nX = table()\n"
                           "def used():\n    import torch\n    return _inner()\n"
                           "def _inner():\n    import onnx_ir\n"
                           "def unused():\n    import onnx\n"
                           "@register\ndef registered():\n    import yaml\n"
                           "class Thing:\n    def method(self):\n        import polars\n"),
        "pkg/lib.py": "def table():\n    import numpy\ndef other():\n    import onnxruntime\n",
        "pkg/stage.py": "from pkg.helpers import used\ndef run():\n    return used()\n",
        "pkg/whole.py": "import pkg.helpers\n",
        "pkg/entry.py": "ENTRY = 'pkg.lib:other'\n",
        "pkg/dynamic.py": "def f(name):\n    return globals()[name]()\ndef g():\n    import onnxruntime\n",
        "pkg/caller.py": "from pkg.dynamic import f\n",
    })
    codekey.clear_cache()
    stage = import_closure(("pkg.stage",), tmp_path)
    assert stage.external == {"json", "torch", "onnx_ir", "yaml", "polars", "numpy"}
    assert stage.functions["pkg.helpers"] == {"used", "_inner", "registered"}
    assert stage.functions["pkg.lib"] == {"table"}
    assert stage.whole == {"pkg.stage"} and set(stage.modules) == {"pkg", "pkg.stage", "pkg.helpers", "pkg.lib"}
    assert "onnx" in import_closure(("pkg.whole",), tmp_path).external
    assert import_closure(("pkg.entry",), tmp_path).external == {"onnxruntime"}
    assert import_closure(("pkg.caller",), tmp_path).external == {"onnxruntime"}
    key = code_key(("pkg.stage",), tmp_path)
    (tmp_path / "pkg/helpers.py").write_text((tmp_path / "pkg/helpers.py").read_text() + "# note\n")
    codekey.clear_cache()
    assert code_key(("pkg.stage",), tmp_path).digest == key.digest
    codekey.clear_cache()



def test_a_package_registry_takes_every_module_of_its_package(tmp_path):
    """Rule 4 for ``Registry.register_package`` (the families: a new family is a file, named by no
    string): every module of the package counts, so editing any family re-keys the stages."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/fams/__init__.py": "from pkg.reg import R\nR.register_package(__name__, 'FAMILY')\n",
        "pkg/fams/one.py": "import numpy\nFAMILY = 1\n",
        "pkg/reg.py": "class R:\n    @staticmethod\n    def register_package(package, attr):\n        pass\n",
        "pkg/stage.py": "import pkg.fams\n",
    })
    codekey.clear_cache()
    closure = import_closure(("pkg.stage",), tmp_path)
    assert "pkg.fams.one" in closure.modules and "numpy" in closure.external
    real = import_closure(("harp_trt.calib.stage",))
    assert {f"harp_trt.families.{m.stem}" for m in (codekey.REPO_ROOT / "harp_trt/families").glob("*.py")
            if m.stem != "__init__"} <= set(real.modules)
    codekey.clear_cache()

# A fresh interpreter imports the stage's module and runs it on a tiny model with ``__import__`` and
# ``importlib.import_module`` traced: every import statement that repository code executes is
# recorded as (importer, absolute module, names taken). The model and corpus are resolved untraced
# (that is the caller's work, not the stage's).
_TRACE = r"""
import builtins, importlib, json, sys
from pathlib import Path
stage_name, folder, corpus, cache = sys.argv[1:5]
seen, on = set(), [True]
real_import, real_import_module = builtins.__import__, importlib.import_module

def ours(g):
    return (g or {}).get("__name__", "").split(".")[0] == "harp_trt"

def traced(name, globals=None, locals=None, fromlist=(), level=0):
    if on[0] and ours(globals):
        if level:
            package = globals.get("__package__") or globals["__name__"].rpartition(".")[0]
            base = package.rsplit(".", level - 1)[0] if level > 1 else package
            full = f"{base}.{name}" if name else base
        else:
            full = name
        seen.add((globals["__name__"], full, tuple(fromlist or ())))
    return real_import(name, globals, locals, fromlist, level)

def traced_module(name, package=None):
    if on[0] and ours(sys._getframe(1).f_globals) and not name.startswith("."):
        seen.add((sys._getframe(1).f_globals["__name__"], name, ()))
    return real_import_module(name, package)

builtins.__import__, importlib.import_module = traced, traced_module
# the lookup is the harness's: finding the stage imports every stage's config module, so it runs
# untraced and what it imported is forgotten; the stage's own import chain then runs traced
on[0] = False
from harp_trt.registry import STAGES
spec = STAGES.get(stage_name)
for m in [m for m in sys.modules if m.split(".")[0] == "harp_trt"]:
    del sys.modules[m]
on[0] = True
stage_cls = spec.stage_class()
on[0] = False
from harp_trt.data import load_corpus
from harp_trt.models import resolve_model
from harp_trt.stage import Hooks
from harp_trt.store import ArtifactStore
store = ArtifactStore(cache)
resolved = resolve_model(folder, store.root)
config = spec.config_class().from_dict({"layers": 1, "tokens": 128, "seq_len": 32, "alpha_grid": [0.0, 1.0],
                                        "corpus": corpus} if stage_name == "calibrate" else {})
on[0] = True
stage = stage_cls()
inputs = stage.prepare(store, config, {"model": resolved}, Hooks())
art = stage.execute(store, config, inputs)
on[0] = False
assert not art.cached
print(json.dumps(sorted(seen)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["calibrate", "export"])
def test_what_a_stage_run_imports_is_in_its_key(tmp_path, stage):
    """Oracle 3, the rule's ground truth: run the stage for real (a tiny llama) and trace every import
    that repository code executes, at import and during the run; each repository module is in the
    key's closure, each other module is the standard library's or among the closure's libraries."""
    from test_calibrate_cli import write_corpus

    folder = save_tiny("llama", tmp_path / "tiny")
    corpus = write_corpus(tmp_path / "corpus.txt", docs=6, words=60)
    out = subprocess.run([sys.executable, "-c", _TRACE, stage, str(folder), str(corpus), str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    closure = import_closure((STAGE_MODULES[stage],))
    missing = set()
    for importer, name, fromlist in seen:
        if module_file(name.split(".")[0]) is None:
            if name.split(".")[0] not in set(sys.stdlib_module_names) | closure.external:
                missing.add((importer, name))
            continue
        names = [name, *(f"{name}.{f}" for f in fromlist if f != "*")]
        missing |= {(importer, m) for m in names if module_file(m) and m not in closure.modules}
    assert len(seen) > 50 and any(n == "torch" for _, n, _ in seen)
    assert any(n.split(".")[0] == "onnx" for _, n, _ in seen) == (stage == "export")  # calibrate runs no onnx
    assert not missing, f"{stage}: run imported (by, module) outside its key: {sorted(missing)}"
