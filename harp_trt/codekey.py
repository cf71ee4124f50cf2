"""What a stage's cache key says about its code: computed, not listed (Bazel/Nix-style content keys).

``code_key(roots)`` scans the source of ``roots`` (the stage's module) and every module of this
repository whose code they can run, transitively, and hashes that code plus the installed versions
of the third-party distributions it imports: a hand-written list goes stale the day someone adds an
import, a scan does not. Nothing is imported (``ast`` reads the files, names resolve against the
repository root), so ``harp-trt --help`` stays light and a copy of the repository elsewhere gets
the same digest (paths are hashed relative to the root).

What counts as code that runs (each rule has a reason):

1. A module's code counts except the bodies of its top-level functions: module-level statements,
   decorators, defaults, class bodies and methods (a method runs on any instance, and code holds
   instances without naming their class). A top-level function's body counts when code that counts
   names it (a call, a reference, ``from m import f``, a ``"m:f"`` string), when it is decorated (a
   decorator may register it), or when its module is taken whole (``import m``, ``from pkg import
   m``, ``from m import *``, a root, counted code of ``m`` calling ``globals()``). The imports of
   code that counts count wherever they stand (functions, ``try``, ``if``, relative ones). Why not
   every import in a file: ``harp_trt/models.py`` takes ``make_tokenizer_portable`` from
   ``harp_trt/onnx_io.py``, whose ``read_export_meta`` imports onnx; calibrate never calls it, and an
   onnx upgrade must not re-run a calibration (tens of minutes for a 7B model). A function reached
   only by a computed name escapes the rule unless rules 3-4 see it (``tests/test_code_key_scope.py``
   traces real stage runs against the closure).
2. Importing ``a.b.c`` executes the packages ``a`` and ``a.b`` first: their code counts by rule 1,
   their functions only where that code names them. A PEP 562 ``__getattr__`` (the lazy re-exports
   in ``harp_trt/rewrite/__init__.py``) counts when code takes from the package a name that the
   package does not bind. The export stage (``harp_trt/export/``) imports no module of
   ``harp_trt/rewrite/``, so changing a rule does not re-export.
3. Lazy registries (``harp_trt/lazy.py``) import ``"package.module:attr"`` strings on first use: such
   a string literal in code that counts, naming a module of this repository, is
   ``from package.module import attr``.
4. A package whose counted code imports computed submodule names
   (``importlib.import_module(f"{__name__}.{x}")`` in ``builders/triton/__init__.py``) or registers
   them all (``Registry.register_package``, ``harp_trt/families/__init__.py``) takes every module
   beneath it whole.
5. Counted code that uses ``__file__`` and names a file or folder beside its module in a string
   literal reads that data (``builders/triton/assets``: files copied into a Triton repository):
   every file there counts, its Python files also as modules taken whole.
6. ``require("a.b", ...)`` (``harp_trt.extras``: an optional dependency imported with a typed error
   when missing) in counted code imports ``a.b`` like ``import a.b``: its version shapes the key.

What the digest covers, each module counted once however it is reached:

- Every file of a module reached, by path relative to the repository root. A Python module by its
  code: ``ast.dump`` of its tree without docstrings and other bare string statements, which do
  nothing when run; comments, docstrings, blank lines and line numbers change no key, an edit to
  code anywhere in the file does (its unreached functions included: only imports follow rule 1).
  The dump's format is the interpreter's, so a new Python minor version may re-key. A data file
  (rule 5; the Python files among them too, as they are copied) by its bytes.
- The third-party libraries: every top-level module outside the repository and the standard
  library (``sys.stdlib_module_names``) that counted code imports, plus what it ``IMPLIES``, mapped
  to the installed distributions that provide it (``importlib.metadata.packages_distributions()``)
  and recorded as (normalised distribution name, version): onnxruntime and onnxruntime-gpu key
  apart, and numpy, ml_dtypes or accelerate count the day code imports them. A module that no
  installed distribution provides counts as (module, None): installing it re-keys.

Names map to files as pyproject.toml's ``package-dir`` installs them (``PACKAGE_DIRS``):
``harp_trt.builders.ort.builder`` is ``builders/ort/builder.py`` in a checkout (and
``harp_trt/builders/ort/builder.py`` in an installed wheel, hashed under the checkout's path); the
bare folder names (``builders``, ``calib``, ``bench``) are no import names and resolve to nothing.

Cached per process (``functools.lru_cache``); ``clear_cache()`` is for tests that edit files or distributions."""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata as md
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import PACKAGE_DIRS  # import name -> checkout folder, defined once (harp_trt/__init__.py)

__all__ = ["CodeKey", "Closure", "code_key", "import_closure", "library_versions_of", "installed_version", "IMPLIES",
           "REPO_ROOT", "PACKAGE_DIRS", "module_file", "source_digest", "clear_cache"]

# (``__spec__.origin`` is this file; not ``__file__``, which would make rule 5 take the folder
# names of PACKAGE_DIRS for data beside it where they are, in an installed wheel)
REPO_ROOT = Path(__spec__.origin).resolve().parent.parent

# a library that works through another, which our code need not import: its version shapes the
# output of code importing the first (transformers tokenizes with tokenizers, reads weights with safetensors)
IMPLIES: dict[str, tuple[str, ...]] = {"transformers": ("tokenizers", "safetensors")}

_REGISTRY_ENTRY = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):([A-Za-z_]\w*)")
_FILE_NAME = re.compile(r"\w[\w.-]*")
_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class CodeKey:
    """``modules``: the repository modules the roots reach (sorted); ``files``: every file hashed
    (relative paths: the modules' and the data they read); ``libraries``: (distribution, installed
    version), or (module, None) where none provides it, for the third-party modules their code
    imports; ``digest``: sha256[:16] of the files' code and the libraries."""

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


def _owned(tree: ast.Module):
    """(node, owner, at top level) for every node of a module: ``owner`` is the name of the
    top-level function whose body holds the node, None for code that runs with the module (rule 1:
    module level, decorators, defaults, classes and their methods)."""
    stack = [(n, None, True) for n in tree.body]
    while stack:
        node, owner, top = stack.pop()
        yield node, owner, top
        body = {id(s) for s in node.body} if top and isinstance(node, _FUNCTION) else set()
        for child in ast.iter_child_nodes(node):
            stack.append((child, node.name if id(child) in body else owner,
                          top and not isinstance(node, (ast.ClassDef, *_FUNCTION))))


@dataclass
class _Part:
    """What one part of a file's code reaches when it runs (rule 1 splits a file into parts)."""

    whole: set[str] = field(default_factory=set)              # repository modules taken whole
    names: set[tuple[str, str]] = field(default_factory=set)  # (repository module, name) taken from it
    refs: set[str] = field(default_factory=set)               # names used: the file's own functions among them
    external: set[str] = field(default_factory=set)           # top-level names of the other modules imported
    strings: set[str] = field(default_factory=set)
    uses_file: bool = False
    dynamic: bool = False                                     # importlib.import_module(<computed name>)
    uses_globals: bool = False


@dataclass(frozen=True)
class _File:
    parts: dict[str | None, _Part]  # None: the code that runs with the module; a name: that top-level function's body
    bound: frozenset[str]           # the names the module binds at its top level


def _scan_import(node: ast.Import | ast.ImportFrom, src: _Source, part: _Part, root: Path) -> None:
    """Rule 1 for one import statement: a module taken whole, names taken from a module, or a library."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if _resolve(alias.name, root):
                part.whole.add(alias.name)
            else:
                part.external.add(alias.name.split(".")[0])
        return
    target = _absolute(src, node.module, node.level)
    if node.level == 0 and not _resolve(target.split(".")[0], root):
        part.external.add(target.split(".")[0])
        return
    for alias in node.names:
        if alias.name == "*":
            part.whole.add(target)
        elif _resolve(f"{target}.{alias.name}", root):  # a submodule: the module object is taken
            part.whole.add(f"{target}.{alias.name}")
        else:
            part.names.add((target, alias.name))


@functools.lru_cache(maxsize=None)
def _scan(src: _Source, root: Path) -> _File:
    """Split one file into the parts of rule 1 and note what each reaches (rules 1-6)."""
    parts: dict[str | None, _Part] = {None: _Part()}
    bound: set[str] = set()
    tree = ast.parse(src.path.read_bytes(), filename=str(src.path))
    for node, owner, top in _owned(tree):
        part = parts.setdefault(owner, _Part())
        if top and isinstance(node, (ast.ClassDef, *_FUNCTION)):
            bound.add(node.name)
            if isinstance(node, _FUNCTION):
                parts.setdefault(node.name, _Part())
                if node.decorator_list:
                    part.refs.add(node.name)
        if isinstance(node, ast.Name):
            part.refs.add(node.id)
            part.uses_file |= node.id == "__file__"
            if top and isinstance(node.ctx, ast.Store):
                bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if top:
                bound.update(a.asname or a.name.split(".")[0] for a in node.names)
            _scan_import(node, src, part, root)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            part.strings.add(node.value)
        elif isinstance(node, ast.Call):
            called = getattr(node.func, "id", getattr(node.func, "attr", ""))
            literal = bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            if called == "require" and literal:  # rule 6 (a module of this repository is never required)
                part.external.add(node.args[0].value.split(".")[0])
            elif isinstance(node.func, ast.Attribute) and (called == "import_module" and node.args and not literal
                                                           or called == "register_package"):  # rule 4
                part.dynamic = True
            elif called == "globals" and isinstance(node.func, ast.Name):
                part.uses_globals = True
    return _File(parts, frozenset(bound))


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
    """``modules``: every repository module the roots reach -> its file; ``functions``: for each,
    the top-level functions whose bodies count (rule 1; all of them for a module in ``whole``);
    ``whole``: the modules taken whole; ``data``: other files the code reads beside it (rule 5);
    ``external``: top-level names of the other modules imported by code that counts."""

    modules: dict[str, Path]
    functions: dict[str, frozenset[str]]
    whole: frozenset[str]
    data: frozenset[Path]
    external: frozenset[str]


_WHOLE, _LOAD = None, ""  # a task's ``attr``: take the module whole / only load it (a parent package)


class _Walk:
    """The work list of ``import_closure``: tasks (module, attr, taken by an import) until none is left."""

    def __init__(self, root: Path, loaded: dict[str, _Source], roots: tuple[str, ...]):
        self.root, self.loaded = root, loaded
        self.files: dict[str, tuple[_Source, _File]] = {}
        self.counted: dict[str, set[str]] = {}
        self.whole: set[str] = set()
        self.external: set[str] = set()
        self.data: set[Path] = set()
        self.todo: list[tuple[str, str | None, bool]] = [(r, _WHOLE, False) for r in roots]

    def run(self) -> None:
        while self.todo:
            name, attr, taken = self.todo.pop()
            if self._load(name) is None:
                continue  # a namespace folder, or a name that is an attribute rather than a module
            f = self.files[name][1]
            if attr is _WHOLE and name not in self.whole:
                self.whole.add(name)
                for fn in sorted(p for p in f.parts if p is not None):
                    self._count(name, fn)
            elif attr and attr in f.parts:
                self._count(name, attr)
            elif attr and taken and attr not in f.bound and "__getattr__" in f.parts:  # rule 2
                self._count(name, "__getattr__")

    def _load(self, name: str) -> _Source | None:
        """Scan module ``name`` once, count its code that runs on import and load its parents."""
        if name in self.files:
            return self.files[name][0]
        src = _resolve(name, self.root) or self.loaded.get(name)
        if src is None:
            return None
        self.files[name], self.counted[name] = (src, _scan(src, self.root)), set()
        parts = name.split(".")
        self.todo.extend((".".join(parts[:i]), _LOAD, False) for i in range(1, len(parts)))  # rule 2
        self._count(name, None)
        return src

    def _count(self, name: str, fn: str | None) -> None:
        """Count part ``fn`` of module ``name`` (None: its code that runs on import) and queue what it reaches."""
        src, f = self.files[name]
        if fn is not None:
            if fn in self.counted[name]:
                return
            self.counted[name].add(fn)
        part = f.parts[fn]
        self.external |= part.external
        self.todo.extend((m, _WHOLE, False) for m in part.whole)
        self.todo.extend((m, a, True) for m, a in part.names)
        self.todo.extend((name, r, False) for r in part.refs if r in f.parts)
        if part.uses_globals:
            self.todo.append((name, _WHOLE, False))
        for text in part.strings:
            if (m := _REGISTRY_ENTRY.fullmatch(text)) and _resolve(m.group(1), self.root):  # rule 3
                self.todo.append((m.group(1), m.group(2), True))
        if part.dynamic and src.is_package:  # rule 4
            self.todo.extend((_module_name(p, self.root), _WHOLE, False) for p in sorted(src.path.parent.rglob("*.py"))
                             if "__pycache__" not in p.parts)
        self._beside(name)

    def _beside(self, name: str) -> None:
        """Rule 5 over the counted code of ``name``: the files it names beside itself."""
        src, f = self.files[name]
        counted = [f.parts[None], *(f.parts[fn] for fn in self.counted[name])]
        if not any(p.uses_file for p in counted):
            return
        for text in set().union(*(p.strings for p in counted)):
            if _FILE_NAME.fullmatch(text) and (beside := src.path.parent / text).exists():
                found = [beside] if beside.is_file() else [
                    p for p in beside.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
                new = set(found) - self.data
                self.data |= new
                self.todo.extend((_module_name(p, self.root), _WHOLE, False) for p in sorted(new) if p.suffix == ".py")


def import_closure(roots: tuple[str, ...], root: Path = REPO_ROOT) -> Closure:
    """The closure of ``roots`` (module names, each taken whole) under ``root``, by the rules in
    the module docstring. Raises ``ValueError`` for a root that is not a module file under ``root``."""
    loaded = {r: src for r in roots if _resolve(r, root) is None and (src := _loaded_elsewhere(r, root))}
    for r in roots:
        if _resolve(r, root) is None and r not in loaded:
            raise ValueError(f"no module {r!r} under {root} to take a code version from")
    walk = _Walk(root, loaded, tuple(roots))
    walk.run()
    return Closure({n: src.path for n, (src, _) in walk.files.items()},
                   {n: frozenset(fns) for n, fns in walk.counted.items()}, frozenset(walk.whole),
                   frozenset(walk.data), frozenset(walk.external))


@functools.lru_cache(maxsize=None)
def _providers() -> dict[str, tuple[str, ...]]:
    """Top-level module -> the installed distributions that provide it (sorted, deduplicated)."""
    return {m: tuple(sorted(set(d))) for m, d in md.packages_distributions().items()}


def library_versions_of(names: set[str] | tuple[str, ...]) -> tuple[tuple[str, str | None], ...]:
    """(distribution, version) of every installed distribution that provides one of the top-level
    modules ``names`` or what they ``IMPLIES``; (module, None) for a module none provides. The
    standard library is left out. Sorted: no import order or lookup order shows in a key."""
    names = {n.split(".")[0] for n in names}
    names |= {dep for n in names for dep in IMPLIES.get(n, ())}
    out: set[tuple[str, str | None]] = set()
    for name in names - set(sys.stdlib_module_names):
        dists = _providers().get(name)
        # (names as PEP 503 normalises them: onnx_ir and onnx-ir are one distribution)
        out |= {(re.sub(r"[-_.]+", "-", d).lower(), installed_version(d)) for d in dists} if dists else {(name, None)}
    return tuple(sorted(out, key=lambda lib: (lib[0], lib[1] or "")))


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``importlib.metadata``), None if absent."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def _code(path: Path) -> bytes:
    """What of a Python file the key hashes: its code, without comments, line numbers or bare string
    statements (docstrings among them), which do nothing when run."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            if isinstance(body := getattr(node, name, None), list) and body and isinstance(body[0], ast.stmt):
                setattr(node, name, [s for s in body if not (isinstance(s, ast.Expr) and isinstance(
                    s.value, ast.Constant) and isinstance(s.value.value, str))] or [ast.Pass()])
    return ast.dump(tree).encode()


def source_digest(module: str, root: Path = REPO_ROOT) -> str:
    """sha256 of the code of repository module ``module`` as ``code_key`` hashes it (a comment or
    docstring edit keeps it). Raises ``ValueError`` for a name that is no module under ``root``."""
    path = module_file(module, root)
    if path is None:
        raise ValueError(f"no module {module!r} under {root}")
    return hashlib.sha256(_code(path)).hexdigest()


@functools.lru_cache(maxsize=None)
def code_key(roots: tuple[str, ...], root: Path = REPO_ROOT) -> CodeKey:
    """The code part of a cache key for a stage whose code starts at ``roots`` (module names):
    sha256 over every file of the closure (by its path relative to ``root``; a module's code, a
    data file's bytes) and the versions of the libraries its code imports."""
    closure = import_closure(roots, root)
    libraries = library_versions_of(closure.external)
    files = {_checkout_path(f, root): f for f in (*closure.modules.values(), *closure.data)}
    h = hashlib.sha256()
    for rel in sorted(files):
        f = files[rel]
        body = _code(f) if f.suffix == ".py" and f not in closure.data else f.read_bytes()
        h.update(rel.encode() + b"\0" + body + b"\0")
    h.update(repr(libraries).encode())
    return CodeKey(tuple(sorted(closure.modules)), tuple(sorted(files)), libraries, h.hexdigest()[:16])


def clear_cache() -> None:
    """Forget computed keys (after a test edits a file or installs a distribution)."""
    for cached in (code_key, _scan, _resolve, _code, _providers):
        cached.cache_clear()
