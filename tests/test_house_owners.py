"""The house rule "one owner for each fact" (ARCHITECTURE.md, "The house"): each fact below
is defined in one module and every other module goes through it, and a stage is declared by the
stage alone (the core names none). Each rule scans the source and shows on a planted file that it
sees a use."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("harp_trt", "calib", "builders", "bench")


def _files(root: Path):
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root).as_posix(), path.read_text()


def _ast_uses(root: Path, seen, owners: set[str]) -> list[str]:
    """``file:line`` of every AST node for which ``seen(node)`` holds, outside ``owners`` and outside
    the arguments of the owner's own function (``engine_threads(spec, params.get(...))``)."""
    out = []
    for rel, text in _files(root):
        if rel in owners:
            continue
        tree = ast.parse(text)
        handed = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call) and _name(call.func) in OWNER_CALLS
                  for a in call.args for n in ast.walk(a)}
        out += sorted({f"{rel}:{n.lineno}" for n in ast.walk(tree) if seen(n) and id(n) not in handed})
    return out


OWNER_CALLS = {"engine_threads"}


def _name(func) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _const(node, values) -> bool:
    return isinstance(node, ast.Constant) and node.value in values


# ---- the engine contract: engine.json and its format string -------------------------------------
def _engine_literal(node) -> bool:
    return _const(node, {"engine.json", "harp-engine/1"})


# ---- model shapes: one table (bench/_shapes.py) --------------------------------------------------
def _model_shape(node) -> bool:
    """A config written out by hand: keywords or dict keys giving both hidden_size and
    num_hidden_layers as numbers."""
    if isinstance(node, ast.Call):
        pairs = {k.arg: k.value for k in node.keywords if k.arg}
    elif isinstance(node, ast.Dict):
        pairs = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
    else:
        return False
    return all(isinstance(pairs.get(k), ast.Constant) for k in ("hidden_size", "num_hidden_layers"))


# ---- peak RSS: one reading of getrusage (harp_trt/memory.py) -----------------------------------
def _rusage(node) -> bool:
    """``getrusage`` or ``ru_maxrss`` read, in code or in code held in a string (a ``-c`` wrapper)."""
    return (isinstance(node, ast.Attribute) and node.attr in {"ru_maxrss", "getrusage"}) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and ".ru_maxrss" in node.value)


# ---- threads: one reading of an engine's thread count (harp_trt/engine_spec.engine_threads) ---
def _threads_read(node) -> bool:
    """``x.get("intra_op_threads")`` or ``x["intra_op_threads"]`` read (writing the key is the builder's)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and _const(node.args[0], {"intra_op_threads"})
    return isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _const(node.slice, {"intra_op_threads"})


RULES = {
    # fact: (what a use looks like, its owners and why, a planted use the scan must see)
    "engine contract": (_engine_literal, {"harp_trt/engine_spec.py"}, 'SPEC = "engine.json"\n'),
    # families/base.py: the toy config every family's self-check builds, not a model's shape
    "model shapes": (_model_shape, {"bench/_shapes.py", "harp_trt/families/base.py"},
                     "cfg = dict(hidden_size=64, num_hidden_layers=2)\n"),
    "peak RSS": (_rusage, {"harp_trt/memory.py"}, "import resource\nr = resource.getrusage(0).ru_maxrss\n"),
    "threads": (_threads_read, {"harp_trt/engine_spec.py"}, 'n = spec.get("intra_op_threads") or 0\n'),
}


@pytest.mark.parametrize("fact", sorted(RULES))
def test_each_fact_has_one_owner(fact, tmp_path):
    seen, owners, planted = RULES[fact]
    assert _ast_uses(ROOT, seen, owners) == [], f"{fact}: go through {sorted(owners)[0]}"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "x.py").write_text(planted + '"""A docstring naming engine.json, getrusage and ru_maxrss."""\n')
    assert _ast_uses(tmp_path, seen, owners) == [f"bench/x.py:{planted.count(chr(10))}"]  # the scan sees a use


# ---- KV bytes per token: harp_trt/kvcache.kv_cache_bytes ---------------------------------------
_KV_PRODUCT = re.compile(r"\b2\s*\*[^#\n]*(kv_heads[^#\n]*head_dim|head_dim[^#\n]*kv_heads)")


def _kv_products(root: Path) -> list[str]:
    return [f"{rel}:{n}" for rel, text in _files(root) if rel != "harp_trt/kvcache.py"
            for n, line in enumerate(text.splitlines(), 1) if _KV_PRODUCT.search(line)]


def test_kv_bytes_are_counted_in_one_place(tmp_path):
    """Every K + V byte count multiplies ``kv_cache_bytes`` (the GGUF writer re-derived it)."""
    assert _kv_products(ROOT) == []
    (tmp_path / "builders").mkdir()
    (tmp_path / "builders" / "w.py").write_text("per = sum(2 * head_dim * l.kv_heads * 2 for l in layers)\n")
    assert _kv_products(tmp_path) == ["builders/w.py:1"]


def test_engine_threads_is_the_one_rule():
    """A caller's positive count wins, else the engine's recorded one, else None (the runtime's
    default); 0, "" and None are "not set" wherever they come from (flag, Triton parameter, config)."""
    from harp_trt.engine_spec import engine_threads

    assert engine_threads({"intra_op_threads": 2}) == 2
    assert engine_threads({"intra_op_threads": 2}, 3) == 3 and engine_threads({"intra_op_threads": 2}, "3") == 3
    assert engine_threads({"intra_op_threads": 2}, 0) == 2 and engine_threads({"intra_op_threads": 2}, "") == 2
    assert engine_threads({"intra_op_threads": 0}) is None and engine_threads(None, None) is None
    with pytest.raises(ValueError, match=">= 0"):
        engine_threads({}, -1)


def test_a_stage_is_a_folder_found_by_the_registry(tmp_path):
    """No stage named in the core: STAGES is what ``find_stages`` reads from the stage folders (each config module's ``STAGE``);
    the core spells no stage's module: a new runtime under builders/ is found with no line added."""
    import ast
    from pathlib import Path

    import harp_trt.registry as registry
    from harp_trt.registry import find_stages

    from harp_trt.registry import STAGES

    assert STAGES.names() == ["bench", "build-ort", "calibrate", "export", "genai", "gguf", "rewrite", "triton",
                              "trtllm"]
    assert all(STAGES.get(n).config.startswith(STAGES.get(n).stage.partition(":")[0].rpartition(".")[0] + ".")
               for n in STAGES.names())  # declared beside the stage: config and stage in one package
    owned = {x for n in STAGES.names() for x in (STAGES.get(n).stage, STAGES.get(n).config)}
    owned |= {x.partition(":")[0] for x in set(owned)}
    core = [n.value for f in ("registry.py", "pipeline.py", "lazy.py", "stage_spec.py")
            for n in ast.walk(ast.parse((Path(registry.__file__).parent / f).read_text()))
            if isinstance(n, ast.Constant) and n.value in owned]
    assert core == []
    root = tmp_path / "stg"
    for folder, body in {"": "", "plain": None, "newrt": "STAGE = S('newrt')", "other": "X = 1"}.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
        if body is not None:
            (root / folder / "config.py").write_text(
                "from harp_trt.stage_spec import StageSpec\n"
                "def S(name):\n    return StageSpec(name, 'm:C', 'm:D', 'build', 'a new runtime')\n" + body + "\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert [s.name for s in find_stages(("stg",))] == ["newrt"]
    finally:
        sys.path.remove(str(tmp_path))
        for m in [m for m in sys.modules if m == "stg" or m.startswith("stg.")]:
            del sys.modules[m]
