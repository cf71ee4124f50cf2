"""The house rules, read from the source (ARCHITECTURE.md, "The house"): which package may import
which. A stage reaches another stage only through artifacts; the core and the pipeline reach stages
only through the registry's ``"module:Class"`` strings; the CLI imports a stage only inside a
command's ``run`` (never while building the parser)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE_PACKAGES = ("calib", "harp_trt.rewrite", "builders.ort", "builders.trtllm", "builders.triton", "bench.stage")


def _group(module: str) -> str | None:
    """The house's unit a module belongs to: a stage package, core, cli, pipeline or scripts."""
    for pkg in STAGE_PACKAGES:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    if module.startswith("harp_trt.cli"):
        return "cli"
    if module in ("harp_trt.pipeline",):
        return "pipeline"
    if module == "harp_trt" or module.startswith("harp_trt."):
        return "core"
    if module == "bench" or module.startswith("bench."):
        return "scripts"
    if module == "builders":
        return "core"
    return None


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import in ``path``."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    package = parts if is_pkg else parts[:-1]
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
            rel = f.relative_to(ROOT).with_suffix("")
            mod = ".".join(rel.parts[:-1] if rel.parts[-1] == "__init__" else rel.parts)
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


def test_cli_imports_stages_only_inside_commands():
    """Module-level stage imports would load them while building the parser (`harp-trt --help`)."""
    assert _violations(lambda s, d, top: s == "cli" and d in STAGE_PACKAGES and top) == []


def test_the_rules_see_real_edges():
    """The scanner finds the edges that are allowed, so an empty violation list means something."""
    edges = {(s, _group(t)) for f, m, s in _sources() for t, _, _ in _imports(f)}
    assert ("harp_trt.rewrite", "core") in edges and ("cli", "calib") in edges and ("scripts", "bench.stage") in edges
    assert ("builders.ort", "core") in edges and ("pipeline", "core") in edges


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
    ``builders/triton/repository.py`` and ``llm_repo.py`` once did): one of them owns the fact."""
    assert _circles(_import_graph(module_level=False)) == []


def test_the_circle_finder_sees_circles_and_real_edges():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    top, every = _import_graph(module_level=True), _import_graph(module_level=False)
    assert "builders.triton.onnx_repo" in top["builders.triton.llm_repo"]
    assert "harp_trt.errors" in top["harp_trt.stage"]  # `from .errors import ...`
    assert "builders.triton.llm_repo" in every["builders.triton.repository"] - top["builders.triton.repository"]


def _private_imports(path: Path) -> list[str]:
    """``module:name`` for every underscore name ``path`` imports from a repository module."""
    return [f"{'.' * node.level}{node.module or ''}:{a.name}" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.level or node.module.split(".")[0] in _FOLDERS)
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_triton_modules_import_no_private_names_of_each_other(tmp_path):
    """``repository.py`` / ``llm_repo.py`` (and their siblings) share public names only."""
    bad = {f.name: _private_imports(f) for f in sorted((ROOT / "builders" / "triton").glob("*.py"))}
    assert {k: v for k, v in bad.items() if v} == {}
    probe = tmp_path / "probe.py"
    probe.write_text("from .repository import _a, b\ndef f():\n    from harp_trt.x import _c\n")
    assert _private_imports(probe) == [".repository:_a", "harp_trt.x:_c"]
