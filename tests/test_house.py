"""The house rules, read from the source (ARCHITECTURE.md, "The house"): which package may import
which. A stage reaches another stage only through artifacts; the core and the pipeline reach stages
only through the registry's ``"module:Class"`` strings; the CLI imports a stage only inside a
command's ``run`` (never while building the parser)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGE_PACKAGES = ("calib", "harp_trt.rewrite", "builders.ort", "builders.trtllm", "builders.triton", "builders.genai",
                  "builders.gguf", "bench.stage")


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


def _sources():
    for folder in ("harp_trt", "calib", "builders", "bench"):
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
