"""Lazy registries with "did you mean" errors (pattern of lm-evaluation-harness' registry).

Entries are either objects or ``"module:attr"`` strings imported on first use, so heavy backends
load only when chosen."""
from __future__ import annotations

import difflib
import importlib
from typing import Any, Generic, Iterator, TypeVar

from .errors import UnknownNameError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}

    def register(self, name: str, target: Any = None):
        """``register("x", "pkg.mod:Cls")`` or use as decorator ``@register("x")``."""
        if target is not None:
            self._add(name, target)
            return target

        def deco(obj):
            self._add(name, obj)
            return obj

        return deco

    def _add(self, name: str, target: Any) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._entries[name] = target

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        if name not in self._entries:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid: {', '.join(self.names())}", hint
            )
        target = self._entries[name]
        if isinstance(target, str):
            mod, _, attr = target.partition(":")
            target = getattr(importlib.import_module(mod), attr)
            self._entries[name] = target
        return target
