"""Frozen, versioned stage configs. Unknown keys are rejected with the list of valid ones, and the
CLI takes its defaults from the fields (no duplicated defaults)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar, TypeVar

from .errors import ConfigError

__all__ = ["StageConfig", "canonical_json", "digest_of"]

C = TypeVar("C", bound="StageConfig")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def digest_of(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class StageConfig:
    """Base of every stage config. Subclasses bump ``VERSION`` when their meaning changes."""

    VERSION: ClassVar[int] = 1

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def default(cls, name: str) -> Any:
        for f in dataclasses.fields(cls):
            if f.name == name:
                if f.default is not dataclasses.MISSING:
                    return f.default
                if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                    return f.default_factory()  # type: ignore[misc]
        raise KeyError(name)

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any]) -> C:
        valid = cls.field_names()
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(
                f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}"
            )
        clean = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        obj = cls(**clean)
        obj.validate()
        return obj

    def replace(self: C, **changes: Any) -> C:
        obj = dataclasses.replace(self, **changes)
        obj.validate()
        return obj

    def validate(self) -> None:
        """Raise ConfigError for out-of-range values. Override in subclasses."""

    def check_ints(self, names: tuple[str, ...], minimum: int) -> None:
        """ConfigError unless every field in ``names`` is an int (not a bool) >= ``minimum``."""
        for name in names:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
                what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
                raise ConfigError(f"{name} must be {what}, got {v!r}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    def key_material(self) -> dict[str, Any]:
        """What the artifact key hashes: the version plus every field."""
        return {"config": type(self).__name__, "version": self.VERSION, **self.to_dict()}
