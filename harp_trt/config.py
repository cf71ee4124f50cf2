"""Frozen, versioned stage configs. Unknown keys are rejected with the list of valid ones.

A field the command line sets is declared with ``option(default, help=...)``: its flag, type,
default, choices and help live on the field (``dataclasses.field`` metadata), and
``harp_trt.cli._options`` builds the argparse flags from them and maps parsed flags back to
fields (after lm-evaluation-harness ``lm_eval/config/evaluate_config.py``). Metadata is not part
of ``dataclasses.asdict``, so it never changes a key."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Callable, ClassVar, TypeVar

from .errors import ConfigError

__all__ = ["StageConfig", "Option", "option", "cli_option", "canonical_json", "digest_of", "parse_ints",
           "parse_grid", "parse_tasks", "parse_batch_sizes", "parse_seq_len"]

CLI = "harp_trt.cli"  # the metadata key of an option
_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class Option:
    """How a config field appears on the command line. ``flag``: ``--name`` (default: the field's
    name with dashes); ``negate``: a bool field whose default is True gets a flag that sets it False
    (``--no-verify``, ``--copy``); ``parse(text, flag)``: for tuple fields, the flag takes one
    comma-separated string; ``cli_default``: the flag's default where it is not the field's (``None``:
    the command works it out, e.g. ``--layers`` from the preset); ``choices``: a tuple or a callable
    returning one (a registry's ``names``, read when the parser is built); ``group``: the help
    section. In ``help``, ``%(default)s`` is the flag's default, ``%(field_default)s`` the field's."""

    help: str
    flag: str | None = None
    short: str | None = None
    choices: tuple | Callable[[], Any] | None = None
    parse: Callable[[str, str], Any] | None = None
    negate: bool = False
    group: str | None = None
    metavar: str | None = None
    cli_default: Any = _UNSET


def option(default: Any, *, help: str, **cli: Any) -> Any:
    """A dataclass field with ``default`` and its command-line form (``Option``'s fields)."""
    return dataclasses.field(default=default, metadata={CLI: Option(help=help, **cli)})


def cli_option(f: dataclasses.Field) -> Option | None:
    return f.metadata.get(CLI)


# ---- parsers of comma-separated flag values (ConfigError names the flag) --------------------------
def parse_grid(text: str, flag: str = "--alpha-grid") -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers in [0, 1], got {text!r}") from None


def parse_ints(text: str, flag: str, *, positive: bool = False) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; ``positive``: at least one, each >= 1 (sizes, counts)."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if positive and (not out or min(out) < 1):
        raise ConfigError(f"{flag} takes positive integers, got {text!r}")
    return out


def parse_tasks(text: str, flag: str = "--tasks") -> tuple[str, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    return tuple(t.strip() for t in text.split(",") if t.strip())


def parse_batch_sizes(text: str, flag: str = "--batch-sizes") -> tuple[int, ...]:
    """Request batch sizes for the bench's throughput runs; ``none`` = no throughput runs."""
    if text.strip().lower() == "none":
        return ()
    sizes = parse_ints(text, flag)
    if not sizes or any(b < 1 for b in sizes):
        raise ConfigError(f"{flag} must be positive request counts, got {text!r}",
                          f"e.g. {flag} 1,4,16, or 'none' to skip the throughput runs")
    return sizes


def parse_seq_len(text: str, flag: str = "--seq-len") -> int:
    """A window length in tokens, or ``max`` (0: the model's maximum length)."""
    if text == "max":
        return 0
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"{flag} must be a number of tokens or 'max', got {text!r}") from None
    if n < 1:
        raise ConfigError(f"{flag} must be >= 1 or 'max', got {text!r}")
    return n

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
