"""What a stage's cache key says about its code: computed, not listed (Bazel/Nix-style content keys).

``code_key(roots)`` scans the source of ``roots`` (the stage's module) and every module of this
repository they import, transitively, and hashes those files plus the versions of the libraries
among their imports that shape an artifact (``LIBRARIES``). A hand-written list of modules goes
stale the day someone adds an import; a scan does not. Nothing is imported: the scan reads files
(``ast``) and resolves names against the repository root, so ``harp-trt --help`` stays light and a
copy of the repository elsewhere gets the same digest (paths are hashed relative to the root).

What counts as an import (each rule has a reason):

1. ``import a.b`` / ``from a.b import c`` / relative imports, anywhere in a file: at module level,
   inside functions and classes, under ``try`` or ``if``. A function-level import runs when the
   function does, and the artifact is what the functions wrote.
2. Importing ``a.b.c`` executes the packages ``a`` and ``a.b`` first: they count, but a package
   reached only that way contributes its *module-level* imports, not those inside its functions.
   Its PEP 562 ``__getattr__`` (the lazy re-exports in ``harp_trt/rewrite/__init__.py``) runs only
   for code that takes a name from the package itself (rule 1 then applies to the package in
   full). The export stage (``harp_trt/export/``) imports no module of ``harp_trt/rewrite/``, so
   changing a rule does not re-export.
3. Lazy registries (``harp_trt/lazy.py``) import ``"package.module:attr"`` strings on first use: a
   string literal of that shape naming a module of this repository counts as an import of it.
4. A package that imports computed submodule names (``importlib.import_module(f"{__name__}.{x}")``
   in ``builders/triton/__init__.py``) counts every module beneath it when imported in full.
5. A module that uses ``__file__`` and names a file or folder beside it in a string literal reads
   that data (``Path(__file__).parent / "assets"`` in ``builders/triton/``: the Triton model and
   client files copied into a repository): every file there counts, its Python files as imports
   (the served model imports ``harp_trt.serving``).
6. ``require("a.b", ...)`` (``harp_trt.extras``: an optional dependency imported with a typed
   error when missing) imports ``a.b`` like ``import a.b``: its version still shapes the key.

A module reached by several roads counts once; the digest covers the bytes of every file counted,
by path relative to the repository root, and the versions of the ``LIBRARIES`` the code imports.

Names map to files as pyproject.toml's ``package-dir`` installs them (``PACKAGE_DIRS``):
``harp_trt.builders.ort.builder`` is ``builders/ort/builder.py`` in a checkout (and
``harp_trt/builders/ort/builder.py`` in an installed wheel, hashed under the checkout's path); the
bare folder names (``builders``, ``calib``, ``bench``) are no import names and resolve to nothing.

Per process the result is cached (``functools.lru_cache``): the code a process runs does not change
under it. ``clear_cache()`` is for tests that change a file or a version."""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CodeKey", "Closure", "code_key", "import_closure", "library_versions_of", "installed_version", "LIBRARIES",
           "IMPLIES", "REPO_ROOT", "PACKAGE_DIRS", "module_file", "clear_cache"]

# (``__spec__.origin`` is this file; not ``__file__``, which would make rule 5 take the folder
# names of PACKAGE_DIRS for data beside it where they are, in an installed wheel)
REPO_ROOT = Path(__spec__.origin).resolve().parent.parent
# import name -> its folder at the repository's top level (pyproject.toml: [tool.setuptools] package-dir)
PACKAGE_DIRS = {"harp_trt.bench": "bench", "harp_trt.builders": "builders", "harp_trt.calib": "calib"}

# import name -> distributions that provide it (first installed one wins). The libraries whose
# version changes what an artifact holds: the exporter and its ONNX tooling (graph bytes), the
# runtimes (engines, timings), the model code and tokenizers (numbers, ids), the weight formats.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "tokenizers": ("tokenizers",),
    "onnx": ("onnx",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "onnxruntime_genai": ("onnxruntime-genai", "onnxruntime-genai-cuda"),
    "onnx_ir": ("onnx-ir", "onnx_ir"),
    "onnxscript": ("onnxscript",),
    "gguf": ("gguf",),
    "llama_cpp": ("llama-cpp-python", "llama_cpp_python"),  # quantizes and verifies the GGUF (builders/gguf)
    "safetensors": ("safetensors",),
    "lm_eval": ("lm_eval", "lm-eval"),
    "tensorrt_llm": ("tensorrt_llm", "tensorrt-llm"),
}

# a library that works through another: its version shapes the output of code importing the first
# (transformers tokenizes with tokenizers and reads weights with safetensors)
IMPLIES: dict[str, tuple[str, ...]] = {"transformers": ("tokenizers", "safetensors")}

_REGISTRY_ENTRY = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*")
_FILE_NAME = re.compile(r"\w[\w.-]*")


@dataclass(frozen=True)
class CodeKey:
    """``modules``: the repository modules the roots reach (sorted); ``files``: every file hashed
    (relative paths: the modules' and the data they read); ``libraries``: (import name, installed
    version or None) of the ``LIBRARIES`` they import; ``digest``: sha256[:16] of files and versions."""

    modules: tuple[str, ...]
    files: tuple[str, ...]
    libraries: tuple[tuple[str, str | None], ...]
    digest: str


@dataclass(frozen=True)
class _Source:
    name: str
    path: Path
    is_package: bool


def _places(name: str) -> list[list[str]]:
    """Where module ``name`` may lie, as path parts under the root: a mapped package's folder (a
    checkout), then its own path (an installed wheel, or any other package)."""
    parts = name.split(".")
    for pkg, folder in PACKAGE_DIRS.items():
        if name == pkg or name.startswith(pkg + "."):
            return [[folder, *parts[len(pkg.split(".")):]], parts]
    return [] if parts[0] in PACKAGE_DIRS.values() else [parts]


@functools.lru_cache(maxsize=None)
def _resolve(name: str, root: Path) -> _Source | None:
    """The file of module ``name`` under ``root`` (a module or a package's ``__init__.py``)."""
    if not name or not all(p.isidentifier() for p in name.split(".")):
        return None
    for parts in _places(name):
        base = root.joinpath(*parts)
        if (f := base.with_name(base.name + ".py")).is_file():
            return _Source(name, f, False)
        if (f := base / "__init__.py").is_file():
            return _Source(name, f, True)
    return None


def module_file(name: str, root: Path = REPO_ROOT) -> Path | None:
    """The file of repository module ``name`` (``harp_trt.builders.ort`` -> ``builders/ort/__init__.py``), or None."""
    src = _resolve(name, root)
    return src.path if src else None


def _absolute(src: _Source, module: str | None, level: int) -> str:
    """``from <level dots><module> import ...`` inside ``src`` -> the absolute module name."""
    if level == 0:
        return module or ""
    package = src.name.split(".") if src.is_package else src.name.split(".")[:-1]
    base = package[:len(package) - (level - 1)] if level > 1 else package
    return ".".join(base + ([module] if module else []))


def _top_level_nodes(tree: ast.Module):
    """Nodes executed when the module is imported: everything outside function bodies."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


@dataclass
class _Found:
    """What one file's code that runs reaches: repository modules (imported in full), other modules
    (top-level names), data files beside it."""

    modules: set[str] = field(default_factory=set)
    external: set[str] = field(default_factory=set)
    data: set[Path] = field(default_factory=set)


@functools.lru_cache(maxsize=None)
def _scan(src: _Source, full: bool, root: Path) -> _Found:
    """Apply rules 1-6 to the code of one file that runs: all of it (``full``) or, for a package
    reached only as a parent, its module-level code (rule 2)."""
    found, dynamic, strings, uses_file = _Found(), False, set(), False
    tree = ast.parse(src.path.read_bytes(), filename=str(src.path))
    for node in (ast.walk(tree) if full else _top_level_nodes(tree)):
        if isinstance(node, ast.Name) and node.id == "__file__":
            uses_file = True
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _resolve(alias.name, root):
                    found.modules.add(alias.name)
                else:
                    found.external.add(alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(src, node.module, node.level)
            if node.level == 0 and not _resolve(target.split(".")[0], root):
                found.external.add(target.split(".")[0])
                continue
            subs = [f"{target}.{a.name}" for a in node.names if _resolve(f"{target}.{a.name}", root)]
            found.modules.update(subs)
            if len(subs) < len(node.names):  # a name taken from the module itself: it runs in full
                found.modules.add(target)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "require"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.external.add(node.args[0].value.split(".")[0])  # rule 6 (a module of this repo is never required)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and not isinstance(node.args[0], ast.Constant)):
            dynamic = True
    for text in strings:
        if (m := _REGISTRY_ENTRY.fullmatch(text)) and _resolve(m.group(1), root):  # rule 3
            found.modules.add(m.group(1))
        elif uses_file and _FILE_NAME.fullmatch(text) and (src.path.parent / text).exists():  # rule 5
            beside = src.path.parent / text
            found.data.update(f for f in ([beside] if beside.is_file() else beside.rglob("*"))
                              if f.is_file() and "__pycache__" not in f.parts)
    if dynamic and src.is_package:  # rule 4
        found.data.update(src.path.parent.rglob("*.py"))
    found.modules.update(_module_name(f, root) for f in found.data if f.suffix == ".py")
    return found


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    folders = {folder: pkg for pkg, folder in PACKAGE_DIRS.items()}
    parts = [*folders[parts[0]].split("."), *parts[1:]] if parts[0] in folders else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _checkout_path(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` as in a checkout (a wheel's ``harp_trt/builders/x.py`` is ``builders/x.py``)."""
    parts = path.relative_to(root).parts
    for pkg, folder in PACKAGE_DIRS.items():
        n = len(pkg.split("."))
        if list(parts[:n]) == pkg.split("."):
            parts = (folder, *parts[n:])
    return "/".join(parts)


def _loaded_elsewhere(name: str, root: Path) -> _Source | None:
    """A loaded module whose file lies under ``root`` but not at its name's place (a stage defined
    in a test module, ``tests/test_x.py`` imported as ``test_x``)."""
    f = getattr(sys.modules.get(name), "__file__", None)
    if (f and Path(f).suffix == ".py" and Path(f).resolve().is_relative_to(root)
            and "site-packages" not in Path(f).resolve().relative_to(root).parts):  # not a venv in the clone
        return _Source(name, Path(f).resolve(), Path(f).name == "__init__.py")
    return None


@dataclass(frozen=True)
class Closure:
    """``modules``: every repository module the roots reach -> its file; ``parents``: those reached
    only as the package of another (module-level code scanned); ``data``: other files the code reads
    beside it; ``external``: top-level names of the other modules imported."""

    modules: dict[str, Path]
    parents: frozenset[str]
    data: frozenset[Path]
    external: frozenset[str]


def import_closure(roots: tuple[str, ...], root: Path = REPO_ROOT) -> Closure:
    """The closure of ``roots`` (module names) under ``root``, by the rules in the module docstring.
    Raises ``ValueError`` for a root that is not a module file under ``root``."""
    loaded = {r: src for r in roots if _resolve(r, root) is None and (src := _loaded_elsewhere(r, root))}
    for r in roots:
        if _resolve(r, root) is None and r not in loaded:
            raise ValueError(f"no module {r!r} under {root} to take a code version from")
    full: dict[str, Path] = {}
    parents: dict[str, Path] = {}
    data: set[Path] = set()
    external: set[str] = set()
    todo: list[tuple[str, bool]] = [(r, True) for r in roots]
    while todo:
        name, is_full = todo.pop()
        if name in full or (not is_full and name in parents):
            continue
        src = _resolve(name, root) or loaded.get(name)
        if src is None:
            continue  # a namespace folder, or a name that is an attribute rather than a module
        (full if is_full else parents)[name] = src.path
        found = _scan(src, is_full, root)
        external |= found.external
        data |= {f for f in found.data if f.suffix != ".py"}
        todo.extend((m, True) for m in found.modules)
        parts = name.split(".")
        todo.extend((".".join(parts[:i]), False) for i in range(1, len(parts)))
    return Closure({**parents, **full}, frozenset(set(parents) - set(full)), frozenset(data), frozenset(external))


def library_versions_of(names: set[str] | tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """(import name, version) for each of ``names`` in ``LIBRARIES``; None when not installed."""
    names = set(names) | {dep for n in names for dep in IMPLIES.get(n, ())}
    out = []
    for name in sorted(names & set(LIBRARIES)):
        versions = (installed_version(dist) for dist in LIBRARIES[name])
        out.append((name, next((v for v in versions if v is not None), None)))
    return tuple(out)


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``importlib.metadata``), None if absent."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def code_key(roots: tuple[str, ...], root: Path = REPO_ROOT) -> CodeKey:
    """The code part of a cache key for a stage whose code starts at ``roots`` (module names):
    sha256 over every file of the closure (by its path relative to ``root``, and its bytes) and the
    versions of the ``LIBRARIES`` it imports."""
    closure = import_closure(roots, root)
    libraries = library_versions_of(closure.external)
    files = {_checkout_path(f, root): f for f in (*closure.modules.values(), *closure.data)}
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].read_bytes() + b"\0")
    h.update(repr(libraries).encode())
    return CodeKey(tuple(sorted(closure.modules)), tuple(sorted(files)), libraries, h.hexdigest()[:16])


def clear_cache() -> None:
    """Forget computed keys (after a test edits a file or patches a version lookup)."""
    for cached in (code_key, _scan, _resolve):
        cached.cache_clear()
