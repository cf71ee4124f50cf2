"""The house rules, read from the source (ARCHITECTURE.md, "The house"): which package may import
which. A stage reaches another stage only through artifacts; the core, the pipeline and the CLI reach
stages only through the registry (its ``"module:Class"`` strings, ``StageSpec.entry``) and the
pipeline; every CLI flag is generated from a config field or is listed here as not one."""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGE_PACKAGES = ("calib", "harp_trt.export", "harp_trt.rewrite", "harp_trt.builders.ort", "harp_trt.builders.trtllm", "harp_trt.builders.triton",
                  "harp_trt.builders.genai", "harp_trt.builders.gguf", "harp_trt.bench.stage")


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
    if module.startswith("builders."):  # a builder not listed above is a stage all the same
        return ".".join(module.split(".")[:2])
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


def _stage(group: str | None) -> bool:
    return group in STAGE_PACKAGES or (group or "").startswith("builders.")


def test_cli_imports_no_stage():
    """Not even inside a command: the CLI names a stage to the registry (``STAGES.get(name)``:
    its config class, ``entry``) or the pipeline (``run_stage``, ``run_build``)."""
    assert _violations(lambda s, d, top: s == "cli" and _stage(d)) == []


def test_harp_trt_imports_no_stage_package():
    """Nothing under harp_trt/ imports calib, builders or bench, at any depth; the only strings that
    name a module in them are the registry's ``"module:Class"`` entries."""
    bad = []
    named = re.compile(r"^(calib|builders|bench)[.:]")
    for f in sorted((ROOT / "harp_trt").rglob("*.py")):
        rel = f.relative_to(ROOT)
        bad += [f"{rel}:{line} imports {t}" for t, line, _ in _imports(f) if t.split(".")[0] in ("calib", "builders", "bench")]
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


# Flags that set no config field, per command, and why. Everything else a command offers must be
# generated from a field's option() (its action carries ``config_field``).
_PLACEMENT = {"--device", "--dtype", "--device-map", "--sequential"}  # harp_trt.device resolves them
_CALIBRATE = {"--model", "--alpha-order", "--paper-alphas", "--naive"} | _PLACEMENT  # inputs of the alphas
NOT_CONFIG = {
    "build": _CALIBRATE | {"--backend", "--force", "--bench", "--keep-intermediates"},  # pipeline choices
    "calibrate": _CALIBRATE | {"--force"},
    "score": {"--model", "--save"} | _PLACEMENT,                     # scoring is no stage
    "eval": {"--plan", "--model", "--split"} | _PLACEMENT,           # nor is eval
    "rewrite": {"--model", "--plan", "--onnx", "--force"},
    "cache": set(),
    "bench": {"--plan", "--artifact", "--model", "--dense-engine", "--harp-engine", "--dtype", "--device",
              "--max-ppl-increase", "--min-speedup", "--force"},       # inputs, placement and gates
    "deploy trtllm": {"--plan", "--model", "--force"},
    "deploy triton": {"--artifact", "--out", "--force"},
    "deploy genai": {"--artifact", "--out", "--force"},
    "deploy gguf": {"--plan", "--model", "--out", "--force"},
    "generate": {"--artifact", "--prompt", "--max-new-tokens", "--sample", "--temperature", "--top-k", "--top-p",
                 "--seed", "--chat", "--threads", "--no-stream"},     # a session's settings, no stage
}
_EVERY_COMMAND = {"-h", "--help", "--workdir", "--json", "-v", "--verbose"}


def _commands():
    """(command name, its parser) for every command and deploy target."""
    from harp_trt.cli import build_parser

    def subparsers(p):
        return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})

    for name, p in subparsers(build_parser()).items():
        targets = subparsers(p)
        yield from ((f"{name} {t}", tp) for t, tp in targets.items()) if targets else [(name, p)]


def test_every_flag_is_a_config_field_or_listed():
    seen, fields = set(), set()
    for name, p in _commands():
        seen.add(name)
        for a in p._actions:
            field = getattr(a, "config_field", None)
            flags = set(a.option_strings) - _EVERY_COMMAND
            if field:
                fields.add(field)
                assert not flags & NOT_CONFIG[name], (name, a.option_strings, "listed but generated")
            elif flags:
                assert flags <= NOT_CONFIG[name], (name, sorted(flags - NOT_CONFIG[name]))
    assert seen == set(NOT_CONFIG)
    assert {"CalibrateConfig.layers", "OrtBuildConfig.quant_symmetric", "TritonRepoConfig.max_input_len",
            "BenchConfig.seq_lens", "TrtllmCheckpointConfig.tp_size", "GenaiConfig.link", "GgufConfig.gguf_type"} <= fields


def test_every_declared_option_is_offered():
    """A field that declares option() is a flag of some command (no dead declarations)."""
    import dataclasses

    from harp_trt.config import cli_option
    from harp_trt.registry import STAGES

    offered = {getattr(a, "config_field", None) for _, p in _commands() for a in p._actions}
    declared = {f"{c.__name__}.{f.name}" for c in {STAGES.get(n).config_class() for n in STAGES.names()}
                for f in dataclasses.fields(c) if cli_option(f)}
    assert declared and declared <= offered, sorted(declared - offered)


@pytest.mark.parametrize("argv, value", [
    (["deploy", "triton", "--artifact", "a", "--out", "o", "--copy", "--include-input", "--prompt-limit", "7"],
     {"link": False, "exclude_input_in_output": False, "max_input_len": 7}),
    (["deploy", "trtllm", "--plan", "p", "--no-hf", "--tp", "2"], {"hf_format": False, "tp_size": 2}),
    (["bench", "--plan", "p", "--engine", "ort", "--seq-lens", "8,16", "--tasks", "none", "--no-latency"],
     {"engine": "ort", "seq_lens": (8, 16), "tasks": (), "latency": False}),
])
def test_flags_map_back_to_fields(argv, value):
    """Parsed flags -> field values, negated flags and comma lists included."""
    from harp_trt.cli import build_parser
    from harp_trt.cli._options import values_from_args
    from harp_trt.registry import STAGES

    stage = {"deploy": argv[1], "bench": "bench"}[argv[0]]
    got = values_from_args(STAGES.get(stage).config_class(), build_parser().parse_args(argv))
    assert {k: got[k] for k in value} == value


def test_bench_engine_choices_are_the_registry():
    from harp_trt.bench.stage.config import ENGINES

    (bench,) = [p for name, p in _commands() if name == "bench"]
    (engine,) = [a for a in bench._actions if "--engine" in a.option_strings]
    assert list(engine.choices) == ENGINES.names() and engine.config_field == "BenchConfig.engine"
