"""Lazy registries with "did you mean" errors (after lm-evaluation-harness' ``lm_eval/api/registry.py``).

Entries are objects or ``"module:attr"`` strings imported on first ``get``, so listing names, checking
a name or building the CLI's parser imports nothing heavy; a backend's runtime loads only when chosen.
A registry built with ``base`` (a class or ``"module:attr"``) checks every entry it imports against it.

The mechanism lives here, apart from the pipeline's own table (``harp_trt.registry``): a module that
keeps a registry (model families, strategies, bench engines) imports only this one, so its cache
key (``harp_trt.codekey``, which counts every ``"module:attr"`` entry a module reaches) does not
take in every stage of the pipeline."""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

from .errors import UnknownNameError

__all__ = ["Registry", "load_object", "package_modules"]

T = TypeVar("T")


def load_object(target: str) -> Any:
    """``"package.module:attr"`` -> the object; ``"package.module"`` -> the module (imports it)."""
    mod, _, attr = target.partition(":")
    module = importlib.import_module(mod)
    return getattr(module, attr) if attr else module


def package_modules(package: str) -> list[Any]:
    """The modules and subpackages of ``package`` (``pkgutil.ModuleInfo``, in name order), read from
    its folders without importing them (finding the package imports its parents only)."""
    import importlib.util
    import pkgutil

    spec = importlib.util.find_spec(package)
    return sorted(pkgutil.iter_modules(spec.submodule_search_locations or []), key=lambda m: m.name)


class Registry(Generic[T]):
    def __init__(self, kind: str, base: type | str | None = None,
                 discover: Callable[[], Iterable[tuple[str, Any]]] | None = None):
        """``discover``: called once, on the first lookup, for ``(name, target)`` pairs to register
        (the stages, found where they live: ``harp_trt.registry.find_stages``)."""
        self.kind = kind
        self._base = base
        self._entries: dict[str, Any] = {}
        self._discover = discover

    def _discovered(self) -> dict[str, Any]:
        if self._discover is not None:
            discover, self._discover = self._discover, None
            for name, target in discover():
                self._add(name, target)
        return self._entries

    def register(self, name: str, target: Any = None):
        """``register("x", "pkg.mod:Cls")`` or use as decorator ``@register("x")``."""
        if target is not None:
            self._add(name, target)
            return target

        def deco(obj):
            self._add(name, obj)
            return obj

        return deco

    def register_modules(self, package: str, names: Iterable[str]) -> None:
        """Register each of ``names``, in order, as the module ``package.<name>``: a registry whose
        entries are modules named after them (the CLI's commands) states that convention once."""
        for name in names:
            self._add(name, f"{package}.{name}")

    def register_package(self, package: str, attr: str, skip: Iterable[str] = ()) -> None:
        """Register every module of ``package`` (its files, found without importing them; names
        starting with ``_`` and ``skip`` aside), in name order, as ``package.<module>:<attr>`` under
        the module's name: a new entry is a new file that defines ``attr``, with no line to add
        here (as lm-evaluation-harness finds its tasks by scanning their folder)."""
        for m in package_modules(package):
            if not m.name.startswith("_") and m.name not in set(skip):
                self._add(m.name, f"{package}.{m.name}:{attr}")

    def _add(self, name: str, target: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._discovered())

    def in_order(self) -> list[str]:
        """The names in the order they were registered (a CLI lists its commands so)."""
        return list(self._discovered())

    def __contains__(self, name: str) -> bool:
        return name in self._discovered()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def check(self, name: str) -> str:
        """``name`` if registered, else ``UnknownNameError`` listing the valid names with a "did you
        mean"; imports nothing."""
        if name not in self._discovered():
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
            raise UnknownNameError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}", hint)
        return name

    def get(self, name: str) -> T:
        target = self._entries[self.check(name)]
        if isinstance(target, str):
            target = load_object(target)
            base = load_object(self._base) if isinstance(self._base, str) else self._base
            if base is not None and not (isinstance(target, type) and issubclass(target, base)):
                raise TypeError(f"{self.kind} {name!r} is {target!r}, not a subclass of {base.__name__}")
            self._entries[name] = target
        return target
