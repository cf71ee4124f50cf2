"""Cache keys cover all the code an artifact depends on (``harp_trt.codekey``): every repository
module a stage imports, found by a scan and checked here against two oracles that find imports
another way (a fresh interpreter's ``sys.modules``, and the compiled bytecode's ``IMPORT_NAME``s);
a change to a core module in a copy of the repository re-keys exactly the stages that import it;
a library version is part of the key."""
from __future__ import annotations

import dis
import inspect
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from harp_trt import codekey
from harp_trt.codekey import REPO_ROOT, code_key, import_closure, module_file
from harp_trt.registry import STAGES

PACKAGES = ("harp_trt", "calib", "builders", "bench")  # folders (bench/ imports as harp_trt.bench)
STAGE_MODULES = {n: STAGES.get(n).stage.partition(":")[0] for n in STAGES.names()}  # imports nothing

# A fresh interpreter imports a stage's module, then takes every entry of every lazy registry it can
# reach (families, strategies, bench engines) until nothing new loads, and lists the repository
# modules it then holds: what really runs when the stage's module is imported and its registries used.
_ORACLE = r"""
import importlib, json, sys
from pathlib import Path
root = Path(sys.argv[1]).resolve()
importlib.import_module(sys.argv[2])
lazy = sys.modules.get("harp_trt.lazy")  # not imported here: this check must not load a module itself

def ours():
    out = {}
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)  # (torch.ops and torch.classes carry a relative one)
        if f and Path(f).is_absolute() and Path(f).resolve().is_relative_to(root):
            # the repository's own files: not a virtual environment that lives inside the clone (.ci/run's .venv)
            if Path(f).resolve().relative_to(root).parts[0] in ("harp_trt", "calib", "builders", "bench"):
                out[name] = mod
    return out

seen = -1
while seen != len(sys.modules):
    seen = len(sys.modules)
    for mod in list(ours().values()):
        for value in list(vars(mod).values()):
            if lazy is not None and isinstance(value, lazy.Registry):
                for entry in value.names():
                    value.get(entry)
print(json.dumps(sorted(ours())))
"""


def _env(root: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(root)}


def _in_fresh_interpreter(root: Path, *argv: str, code: str = _ORACLE) -> list | dict:
    out = subprocess.run([sys.executable, "-c", code, str(root), *argv], capture_output=True, text=True,
                         timeout=300, cwd=root, env=_env(root))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_every_module_a_stage_imports_is_in_its_key(stage):
    """Oracle 1: the repository modules a fresh interpreter holds after importing the stage's
    module (and resolving its lazy registries) are all in the stage's key."""
    cls = STAGES.get(stage).stage_class()
    loaded = set(_in_fresh_interpreter(REPO_ROOT, STAGE_MODULES[stage]))
    key = cls.code_key()
    assert STAGE_MODULES[stage] in loaded and "harp_trt.stage" in loaded  # the oracle saw the stage
    assert not loaded - set(key.modules), f"{stage}: imported but not in its key: {sorted(loaded - set(key.modules))}"
    assert cls.code_version() == key.digest and len(key.digest) == 16


def _bytecode_imports(code: types.CodeType, skip: frozenset[str] = frozenset()):
    """(module, level, fromlist) of every IMPORT_NAME in ``code`` and its nested code objects,
    leaving out the bodies of the module's functions named in ``skip`` (a function's code object
    sits in its module's constants: optimized, new locals, and a name; a class body has neither flag)."""
    consts = []
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            level, fromlist = consts[-2:] if len(consts) >= 2 else (0, None)
            yield ins.argval, level, fromlist or ()
        consts = consts + [ins.argval] if ins.opname == "LOAD_CONST" else []
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and not (c.co_flags & inspect.CO_NEWLOCALS and c.co_name in skip):
            yield from _bytecode_imports(c)


def _functions_of(code: types.CodeType) -> set[str]:
    """The names of a module's top-level functions, from its bytecode."""
    return {c.co_name for c in code.co_consts if isinstance(c, types.CodeType) and c.co_flags & inspect.CO_NEWLOCALS
            and not c.co_name.startswith("<")}


def _module_of(name: str) -> bool:
    return module_file(name) is not None


@pytest.mark.parametrize("stage", sorted(STAGE_MODULES))
def test_function_level_imports_are_in_the_key(stage):
    """Oracle 2, for imports inside functions (which an import alone does not run): compile every
    module in the closure and resolve each ``IMPORT_NAME`` of its bytecode, outside the bodies of
    the functions the closure says never run (codekey rule 1: its ``functions``); every repository
    module named is in the key, every other module's top-level name among its libraries' modules."""
    closure = import_closure((STAGE_MODULES[stage],))
    missing, libraries = {}, {}
    for name, path in closure.modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        code = compile(path.read_bytes(), str(path), "exec")
        skip = frozenset(_functions_of(code) - closure.functions[name])
        for mod, level, fromlist in _bytecode_imports(code, skip):
            if level:
                parts = package.split(".")
                mod = ".".join(parts[:len(parts) - level + 1] + ([mod] if mod else []))
            elif not _module_of(mod.split(".")[0]) and mod.split(".")[0] not in closure.external:
                libraries[mod] = name
            wanted = [m for m in [mod, *(f"{mod}.{f}" for f in fromlist if f != "*")] if _module_of(m)]
            missing.update({m: name for m in wanted if m not in closure.modules})
    assert not missing, f"{stage}: imported (module -> by) but not in its key: {missing}"
    assert not libraries, f"{stage}: imported (library -> by) but not in its key: {libraries}"


def test_the_named_gaps_are_closed_and_the_rules_stay_out_of_the_export():
    """The modules once missing from the key are in; the export's key still leaves out the rewrite
    rules (a rule change must not re-export), which the rewrite's key holds."""
    keys = {s: set(code_key((m,)).modules) for s, m in STAGE_MODULES.items()}
    assert {"harp_trt.dims", "harp_trt.models", "harp_trt.device"} <= keys["calibrate"]
    assert {"harp_trt.dims", "harp_trt.models", "harp_trt.onnx_io"} <= keys["bench"]
    assert {"harp_trt.rewrite.rules", "harp_trt.rewrite.passes"} <= keys["rewrite"]
    assert not {m for m in keys["export"] if m.startswith("harp_trt.rewrite.")}
    assert {"harp_trt.verify", "harp_trt.dims", "harp_trt.families.gemma2"} <= keys["export"]
    triton = code_key((STAGE_MODULES["triton"],))
    assert "builders/triton/assets/ort_llm_model.py" in triton.files and "harp_trt.serving" in triton.modules


_DIGESTS = r"""
import json, sys
from harp_trt.codekey import REPO_ROOT
from harp_trt.registry import STAGES
assert str(REPO_ROOT) == sys.argv[1], (REPO_ROOT, sys.argv[1])
out = {}
for n in STAGES.names():
    cls = STAGES.get(n).stage_class()
    out[n] = {"digest": cls.code_version(), "modules": list(cls.code_key().modules)}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_core_change_rekeys_every_dependent_stage(tmp_path):
    """In a copy of the repository, the real stage classes' code versions: equal to the original's
    (no path in the key), then a one-line change to ``harp_trt/dims.py`` changes every stage that
    imports it, and only those."""
    root = tmp_path / "repo"
    for pkg in PACKAGES:
        shutil.copytree(REPO_ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    before = _in_fresh_interpreter(root, code=_DIGESTS)
    assert {n: v["digest"] for n, v in before.items()} == {
        n: STAGES.get(n).stage_class().code_version() for n in STAGES.names()}
    with open(root / "harp_trt" / "dims.py", "a") as f:
        f.write("\n_CHANGED = True\n")
    after = _in_fresh_interpreter(root, code=_DIGESTS)
    dependent = {n for n, v in before.items() if "harp_trt.dims" in v["modules"]}
    assert {"calibrate", "export", "rewrite", "trtllm", "bench"} <= dependent
    assert dependent != set(before), "some stage should not import dims (build-ort, triton)"
    for name in before:
        changed = before[name]["digest"] != after[name]["digest"]
        assert changed == (name in dependent), (name, before[name]["digest"], after[name]["digest"])


def test_an_installed_wheel_keys_like_the_checkout(tmp_path):
    """A wheel installs bench/, builders/ and calib/ inside harp_trt/ (pyproject.toml: package-dir);
    its keys equal the checkout's: files are hashed under their checkout paths."""
    site = tmp_path / "site-packages"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO_ROOT / "harp_trt", site / "harp_trt", ignore=ignore)
    for name, folder in codekey.PACKAGE_DIRS.items():
        shutil.copytree(REPO_ROOT / folder, site.joinpath(*name.split(".")), ignore=ignore)
    for stage, module in STAGE_MODULES.items():
        mine, wheel = code_key((module,)), code_key((module,), site)
        assert module_file(module, site).is_relative_to(site / "harp_trt")
        assert (wheel.files, wheel.modules, wheel.digest) == (mine.files, mine.modules, mine.digest), stage
    codekey.clear_cache()


def test_a_library_version_is_in_the_key(monkeypatch):
    """A different onnxruntime re-keys the ORT build (an engine built by one is not served to
    another); calibrate, which never imports onnxruntime, keeps its key."""
    ort, calib = STAGE_MODULES["build-ort"], STAGE_MODULES["calibrate"]
    before = code_key((ort,)), code_key((calib,))
    assert dict(before[0].libraries).get("onnxruntime") and "onnxruntime" not in dict(before[1].libraries)
    real = codekey.installed_version
    monkeypatch.setattr(codekey, "installed_version",
                        lambda dist: "0.0.1-other" if dist.startswith("onnxruntime") else real(dist))
    codekey.clear_cache()
    try:
        after = code_key((ort,)), code_key((calib,))
        assert dict(after[0].libraries)["onnxruntime"] == "0.0.1-other"
        assert after[0].digest != before[0].digest and after[1].digest == before[1].digest
    finally:
        monkeypatch.undo()
        codekey.clear_cache()
    assert code_key((ort,)).digest == before[0].digest


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_scan_rules_on_a_small_package(tmp_path):
    """Each rule of ``harp_trt.codekey`` on a package built here: function-level and relative
    imports count, a parent's lazy ``__getattr__`` does not (until a name is taken from it),
    registry strings and data beside a ``__file__`` user count, a source edit changes the digest."""
    _write(tmp_path, {
        "pkg/__init__.py": "def __getattr__(name):\n    from . import lazy\n    return lazy\n",
        "pkg/lazy.py": "",
        "pkg/sub/__init__.py": "",
        "pkg/sub/stage.py": ("from ..util import helper\n"
                             "def run():\n    from pkg.late import x\n    import onnx\n"
                             "    return 'pkg.entry:Thing'\n"),
        "pkg/util.py": "import torch\nhelper = 1\n",
        "pkg/late.py": "x = 1\n",
        "pkg/entry.py": "from pathlib import Path\nT = (Path(__file__).parent / 'assets').read_text\n",
        "pkg/assets/model.txt": "served as is\n",
        "pkg/user.py": "from pkg import anything\n",
    })
    codekey.clear_cache()
    closure = import_closure(("pkg.sub.stage",), tmp_path)
    assert set(closure.modules) == {"pkg", "pkg.sub", "pkg.sub.stage", "pkg.util", "pkg.late", "pkg.entry"}
    assert closure.whole == {"pkg.sub.stage"} and closure.external == {"torch", "onnx", "pathlib"}
    assert closure.functions["pkg"] == frozenset() and closure.functions["pkg.sub.stage"] == {"run"}
    assert closure.data == {tmp_path / "pkg/assets/model.txt"}
    assert "pkg.lazy" in import_closure(("pkg.user",), tmp_path).modules   # a name taken from pkg
    key = code_key(("pkg.sub.stage",), tmp_path)
    assert "pkg/assets/model.txt" in key.files and [n for n, _ in key.libraries] == ["onnx", "torch"]
    (tmp_path / "pkg/assets/model.txt").write_text("changed\n")
    codekey.clear_cache()
    changed = code_key(("pkg.sub.stage",), tmp_path).digest
    assert changed != key.digest
    (tmp_path / "pkg/lazy.py").write_text("y = 2\n")   # outside the closure: no change
    codekey.clear_cache()
    assert code_key(("pkg.sub.stage",), tmp_path).digest == changed
    with pytest.raises(ValueError, match="no module 'nosuch'"):
        import_closure(("nosuch",), tmp_path)
    codekey.clear_cache()


def test_forbid_model_loads_blocks_every_weight_reader(tmp_path, monkeypatch):
    """The guard the cache-hit tests use trips on every way weights are read: harp-trt's readers,
    transformers' ``from_pretrained``, safetensors and GGUF readers, ONNX loading and ONNX Runtime
    sessions, also where a module imported the function by name (transformers' own ``safe_open``)."""
    import gguf
    import onnx
    import onnxruntime
    import safetensors
    import safetensors.torch
    import transformers.modeling_utils
    from conftest import forbid_model_loads, save_tiny
    from transformers import AutoModelForCausalLM

    from harp_trt import layerwise, models, weights

    folder = save_tiny("llama", tmp_path / "tiny")
    st = next(folder.glob("*.safetensors"))
    assert weights.WeightReader(folder).names()   # readable before the guard
    forbid_model_loads(monkeypatch)
    readers = [lambda: weights.WeightReader(folder), lambda: AutoModelForCausalLM.from_pretrained(folder),
               lambda: models.load_model_folder(folder), lambda: layerwise.LayerStack.open(folder),
               lambda: safetensors.safe_open(str(st), "pt"), lambda: safetensors.torch.load_file(str(st)),
               lambda: transformers.modeling_utils.safe_open(str(st), "pt"), lambda: gguf.GGUFReader(str(st)),
               lambda: onnx.load(str(st)), lambda: onnxruntime.InferenceSession(str(st))]
    for read in readers:
        with pytest.raises(AssertionError, match="a cache hit read model weights"):
            read()


def test_a_stage_defined_in_a_test_module_has_a_code_version():
    """A stage class outside the four packages (here, in this test file) keys on its own file and
    what it imports; the stages' base class still needs no list."""
    from harp_trt.stage import Stage

    class Probe(Stage):
        name = "probe"

    key = Probe.code_key()
    assert "tests/test_cache_keys.py" in key.files and "harp_trt.codekey" in key.modules
    assert len(Probe.code_version()) == 16
