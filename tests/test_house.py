"""The house rules, read from the source (ARCHITECTURE.md, "The house"): which package may import
which. A stage reaches another stage only through artifacts; the core, the pipeline and the CLI reach
stages only through the registry (its ``"module:Class"`` strings, ``StageSpec.entry``) and the
pipeline. The flag rule is in test_house_flags.py."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from harp_trt.codekey import PACKAGE_DIRS

ROOT = Path(__file__).resolve().parents[1]


def _stage_packages() -> tuple[str, ...]:
    """Each stage's package, as the registry finds the stages (a new runtime's folder is one)."""
    from harp_trt.registry import STAGES

    return tuple(sorted({STAGES.get(n).stage.partition(":")[0].rpartition(".")[0] for n in STAGES.names()}))


STAGE_PACKAGES = _stage_packages()


def _group(module: str) -> str | None:
    """The house's unit a module belongs to: a stage package, core, cli, pipeline or scripts."""
    for pkg in STAGE_PACKAGES:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    if module.startswith("harp_trt.cli"):
        return "cli"
    if module in ("harp_trt.pipeline",):
        return "pipeline"
    if module == "harp_trt.bench" or module.startswith("harp_trt.bench."):
        return "scripts"
    if module.startswith("harp_trt.builders."):  # a builder not listed above is a stage all the same
        return ".".join(module.split(".")[:3])
    if module == "harp_trt" or module.startswith("harp_trt."):
        return "core"
    return None


_PACKAGE_OF = {folder: pkg for pkg, folder in PACKAGE_DIRS.items()}


def _module(path: Path) -> str:
    """A file's import name (setup.py's package-dir): ``builders/ort/gqa.py`` -> ``harp_trt.builders.ort.gqa``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts = [*_PACKAGE_OF[parts[0]].split("."), *parts[1:]] if parts[0] in _PACKAGE_OF else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in ``path``."""
    parts = _module(path).split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                names = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            else:
                names = [node.module]
            out += [(n, node.lineno, id(node) in top) for n in names]
    return out


_FOLDERS = ("harp_trt", "calib", "builders", "bench")


def _sources():
    for folder in _FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            if "assets" in f.parts:  # files shipped into Triton repositories, run there
                continue
            mod = _module(f)
            yield f, mod, _group(mod)


def _violations(rule) -> list[str]:
    bad = []
    for f, mod, src in _sources():
        for target, line, top in _imports(f):
            dst = _group(target)
            if dst is not None and dst != src and rule(src, dst, top):
                bad.append(f"{f.relative_to(ROOT)}:{line} {mod} -> {target}")
    return bad


def test_no_stage_imports_another_stage():
    assert _violations(lambda s, d, top: s in STAGE_PACKAGES and d in STAGE_PACKAGES) == []


def test_core_and_pipeline_import_no_stage():
    """harp_trt's core and the pipeline name stages only as registry strings."""
    assert _violations(lambda s, d, top: s in ("core", "pipeline") and d in STAGE_PACKAGES + ("cli", "scripts")) == []


def test_stages_do_not_import_the_cli_pipeline_or_scripts():
    assert _violations(lambda s, d, top: s in STAGE_PACKAGES and d in ("cli", "pipeline", "scripts")) == []


def _stage(group: str | None) -> bool:
    return group in STAGE_PACKAGES or (group or "").startswith("harp_trt.builders.")


def test_cli_imports_no_stage():
    """Not even inside a command: the CLI names a stage to the registry (``STAGES.get(name)``:
    its config class, ``entry``) or the pipeline (``run_stage``, ``run_build``)."""
    assert _violations(lambda s, d, top: s == "cli" and _stage(d)) == []


def test_harp_trt_imports_no_stage_package():
    """Nothing under harp_trt/ imports harp_trt.calib, harp_trt.builders or harp_trt.bench, at any
    depth; the only strings that name a module in them are the registry's ``"module:Class"`` entries."""
    bad = []
    named = re.compile(r"^(harp_trt\.)?(calib|builders|bench)[.:]")
    for f in sorted((ROOT / "harp_trt").rglob("*.py")):
        rel = f.relative_to(ROOT)
        bad += [f"{rel}:{line} imports {t}" for t, line, _ in _imports(f) if named.match(t + ".")]
        if rel.as_posix() == "harp_trt/registry.py":
            continue
        bad += [f"{rel}:{n.lineno} names {n.value!r}" for n in ast.walk(ast.parse(f.read_text()))
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and named.match(n.value)]
    assert bad == []


def test_the_rules_see_real_edges():
    """The scanner finds the edges that are allowed, so an empty violation list means something."""
    edges = {(s, _group(t)) for f, m, s in _sources() for t, _, _ in _imports(f)}
    assert ("harp_trt.export", "core") in edges and ("harp_trt.rewrite", "core") in edges and ("cli", "pipeline") in edges and ("scripts", "harp_trt.bench.stage") in edges
    assert ("harp_trt.builders.ort", "core") in edges and ("pipeline", "core") in edges
    assert ("harp_trt.calib", "core") in edges and _group("harp_trt.builders") == "core"


# ---- import names ------------------------------------------------------------------------------
_OLD_MODULE = re.compile(rf"({'|'.join(PACKAGE_DIRS.values())})(\.\w+)+(:\w+)?")  # module path under a bare folder name


def _old_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every absolute import of a bare folder name in ``tree``, and in the code of
    its string constants that parse as Python with an import (``python -c`` programs)."""
    out = []
    for n in ast.walk(tree):
        names = ([a.name for a in n.names] if isinstance(n, ast.Import) else
                 [n.module] if isinstance(n, ast.ImportFrom) and not n.level else [])
        out += [(n.lineno, name) for name in names if name.split(".")[0] in PACKAGE_DIRS.values()]
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and "import" in n.value:
            try:
                code = ast.parse(n.value)
            except (SyntaxError, ValueError):
                continue
            out += [(n.lineno, name) for _, name in _old_imports(code)]
    return out


def test_no_file_uses_the_folder_names_as_import_names():
    """bench/, builders/ and calib/ import as harp_trt.bench, harp_trt.builders, harp_trt.calib: no
    file imports the bare names (in its code or code it runs), or names them in a registry or ``-m``
    string."""
    bad = []
    for folder in (*_FOLDERS, "tests"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel, tree = f.relative_to(ROOT), ast.parse(f.read_text())
            bad += [f"{rel}:{line} imports {name}" for line, name in _old_imports(tree)]
            bad += [f"{rel}:{n.lineno} names {n.value!r}" for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and _OLD_MODULE.fullmatch(n.value)]
    assert bad == []
    probe = ast.parse("import os, " + "calib.x as y\ndef f():\n    from bench import z\n    return 'import bench.a'")
    assert [(line, name.split(".")[0]) for line, name in _old_imports(probe)] == [(1, "calib"), (3, "bench"), (4, "bench")]


def test_the_install_holds_one_top_level_package():
    """setup.py installs every package folder (``__init__.py``) of harp_trt/, bench/, builders/ and
    calib/, each under harp_trt, found rather than listed: no top-level ``builders`` to shadow
    another distribution's (onnxruntime-genai's builder imports its siblings as top-level modules),
    and a new folder installs without an edit. Its package-dir mapping is the one ``harp_trt.codekey``
    and a checkout's finder (``harp_trt/__init__.py``) use."""
    import json
    import subprocess
    import sys

    import harp_trt

    # in a child: importing setuptools puts its vendored distributions on this process's path
    code = ("import json, runpy; ns = runpy.run_path('setup.py', run_name='probe');"   # not __main__: no setup()
            "print(json.dumps([ns['packages'](), ns['PACKAGE_DIRS']]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    packages, package_dirs = json.loads(out.stdout.strip().splitlines()[-1])
    folders = {_module(f) for folder in _FOLDERS for f in (ROOT / folder).rglob("__init__.py")}
    assert sorted(packages) == sorted(folders) and "harp_trt.builders.ort" in folders
    assert {p.split(".")[0] for p in packages} == {"harp_trt"}
    assert package_dirs == PACKAGE_DIRS and PACKAGE_DIRS is harp_trt.PACKAGE_DIRS


def test_a_checkout_imports_its_own_folders(tmp_path):
    """From outside the repository, with only this checkout on the path (``PYTHONPATH``), the mapped
    names load this checkout's folders, ahead of whatever an editable install elsewhere maps."""
    import os
    import subprocess
    import sys

    code = ("import json, harp_trt.builders.ort.config as b, harp_trt.bench.stage.config as s, harp_trt.calib.config as c;"
            "print(json.dumps([m.__file__ for m in (b, s, c)]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    got = [Path(f) for f in __import__("json").loads(out.stdout.strip().splitlines()[-1])]
    assert got == [ROOT / "builders/ort/config.py", ROOT / "bench/stage/config.py", ROOT / "calib/config.py"]


# ---- import circles ---------------------------------------------------------------------------
def _module_level(body, module_level: bool):
    """The statements of ``body`` that run when the module is imported (into if / try / with / class
    bodies, not into functions or ``if TYPE_CHECKING``); every statement when not ``module_level``."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and module_level:
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                yield from _module_level(sub, module_level)


def _import_graph(module_level: bool) -> dict[str, set[str]]:
    """module -> the repository modules it imports (``from pkg import mod`` names the module)."""
    files = {mod: f for f, mod, _ in _sources()}
    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        package = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
        edges = set()
        for node in _module_level(ast.parse(f.read_text()).body, module_level):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = (".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                        if node.level else node.module)
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[mod] = {e for e in edges if e in files and e != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_at_module_level():
    """No two modules need each other to finish importing."""
    assert _circles(_import_graph(module_level=True)) == []


def test_no_import_circle_even_through_imports_inside_functions():
    """A circle hidden in function bodies is still two modules that own each other's facts (as
    ``builders/triton/repository.py``, now ``stage.py``, and ``llm_repo.py`` once did): one of them owns the fact."""
    assert _circles(_import_graph(module_level=False)) == []


def test_the_circle_finder_sees_circles_and_real_edges():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    top, every = _import_graph(module_level=True), _import_graph(module_level=False)
    assert "harp_trt.builders.triton.onnx_repo" in top["harp_trt.builders.triton.llm_repo"]
    assert "harp_trt.errors" in top["harp_trt.stage"]  # `from .errors import ...`
    assert "harp_trt.builders.triton.llm_repo" in every["harp_trt.builders.triton.stage"] - top["harp_trt.builders.triton.stage"]


def _private_imports(path: Path) -> list[str]:
    """``module:name`` for every underscore name ``path`` imports from a repository module."""
    return [f"{'.' * node.level}{node.module or ''}:{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in _FOLDERS)
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_triton_modules_import_no_private_names_of_each_other(tmp_path):
    """``stage.py`` / ``llm_repo.py`` (and their siblings) share public names only."""
    bad = {f.name: _private_imports(f) for f in sorted((ROOT / "builders" / "triton").glob("*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}
    probe = tmp_path / "probe.py"
    probe.write_text("from .repository import _a, b\ndef f():\n    from harp_trt.x import _c\n")
    assert _private_imports(probe) == [".repository:_a", "harp_trt.x:_c"]


# ---- family and backend names are table keys, not branches --------------------------------------
# The tables and registries that own the names (a family's facts, a backend's steps, a bench engine's
# loader): comparing against the names there is what they are for.
NAME_TABLES = ("harp_trt/families/", "harp_trt/registry.py", "bench/stage/config.py")
# What still branches on a backend or engine name, with why; the list may only shrink (a new branch
# belongs in a table: a ``BackendSpec`` / ``Step`` field, an engine attribute, a registry entry).
NAME_BRANCHES = {
    "harp_trt/models.py": "'gguf' here is a model source kind (a .gguf reference), not the backend",
    "builders/triton/releases.py": "'trtllm' is the Triton image kind the release table names",
    "builders/triton/stage.py": "'trtllm' is the kind of artifact the repository wraps (ONNX or TensorRT-LLM)",
    "bench/_long_context_runtime.py": "element sizes and the KV allocator per runtime (to move onto the engines)",
    "bench/long_context.py": "the llama.cpp loader's kv_type argument (to move onto the engine registry)",
}


def _names_compared(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) for every ``==`` / ``!=`` / ``in`` comparison of ``path`` with one of ``names``
    as a literal operand (alone or inside a literal tuple, list or set)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                out += [(node.lineno, c.value) for c in consts if isinstance(c, ast.Constant) and c.value in names]
    return out


def _family_and_backend_names() -> set[str]:
    from harp_trt.bench.stage.config import ENGINES
    from harp_trt.families import FAMILIES
    from harp_trt.registry import BACKENDS

    families = FAMILIES.names()
    archs = {FAMILIES.get(f).trtllm.architecture for f in families if FAMILIES.get(f).trtllm is not None}
    return (set(families) | archs | set(BACKENDS.names())
            | set(ENGINES.names()) | {"LlamaForCausalLM", "MistralForCausalLM"})


def test_no_family_or_backend_name_is_compared_outside_the_tables():
    names = _family_and_backend_names()
    bad, seen = [], set()
    for f, _, _ in _sources():
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(NAME_TABLES):
            continue
        hits = _names_compared(f, names)
        if hits and rel in NAME_BRANCHES:
            seen.add(rel)
        elif hits:
            bad += [f"{rel}:{line} compares with {name!r}" for line, name in hits]
    assert bad == []
    assert seen == set(NAME_BRANCHES), f"no longer branches on a name, drop it from NAME_BRANCHES: {set(NAME_BRANCHES) - seen}"


def test_the_name_scan_sees_comparisons(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(a, b):\n    if a.backend == 'gguf' or b in ('x', 'llama'):\n        return a != \"ort\"\n")
    assert _names_compared(probe, _family_and_backend_names()) == [(2, "gguf"), (2, "llama"), (3, "ort")]


# ---- sizes --------------------------------------------------------------------------------------
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 80


def _oversized(path: Path) -> list[str]:
    text = path.read_text()
    out = [f"{path.name}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_FILE_LINES else []
    return out + [f"{path.name}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(text))
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_file_over_450_lines_and_no_function_over_80():
    bad = [x for folder in (*_FOLDERS, "tests") for f in sorted((ROOT / folder).rglob("*.py")) for x in _oversized(f)]
    assert bad == []


def test_the_size_scan_counts_lines(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n" + "    x = 1\n" * 80 + "\n\ndef g():\n    pass\n")
    assert _oversized(probe) == ["probe.py:1 f: 81 lines"]


def _entry_point_gaps(root: Path) -> list[str]:
    """A public module of bench/ (not ``_*``) that is no entry point: no ``main``, no ``__main__``
    guard, or not named in docs/benchmarks.md (the scripts' index) as ``bench/NAME.py``."""
    readme = (root / "docs" / "benchmarks.md").read_text()
    gaps = []
    for f in sorted((root / "bench").glob("[!_]*.py")):
        tree = ast.parse(f.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        guard = any(isinstance(n, ast.If) and "__main__" in ast.dump(n.test) for n in tree.body)
        for missing, what in ((not has_main, "main()"), (not guard, "__main__ guard"),
                              (f"bench/{f.name}" not in readme, "docs/benchmarks.md mention")):
            if missing:
                gaps.append(f"bench/{f.name}: lacks {what}")
    scripts = {f.stem for f in (root / "bench").glob("[!_]*.py")}
    for f in sorted((root / "bench").glob("*.py")):   # a script imports helpers, never another script
        for n in (n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)):
            mod = n.module or ""
            names = [mod.rsplit(".", 1)[-1]] + ([a.name for a in n.names] if mod in ("harp_trt.bench", "") else [])
            if mod.startswith("harp_trt.bench") or n.level:
                gaps += [f"bench/{f.name}: imports script bench/{x}.py" for x in names if x in scripts]
    return gaps


def test_every_public_bench_module_is_a_documented_entry_point(tmp_path):
    """Scripts and helpers apart: bench/NAME.py runs (``main`` and the guard) and docs/benchmarks.md
    names it; what scripts share lives in bench/_*.py, and no bench module imports a script."""
    assert _entry_point_gaps(ROOT) == []
    (tmp_path / "bench").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("`bench/tool.py`")
    (tmp_path / "bench" / "tool.py").write_text("def main():\n    pass\n")
    (tmp_path / "bench" / "_helper.py").write_text("from harp_trt.bench.tool import main\n")
    assert _entry_point_gaps(tmp_path) == ["bench/tool.py: lacks __main__ guard",
                                           "bench/_helper.py: imports script bench/tool.py"]
