"""Command-line flags generated from config fields (``harp_trt.config.option``), and parsed flags
mapped back to fields. A flag's name, type, default, choices and help are declared once, on the
field (after lm-evaluation-harness ``lm_eval/config/evaluate_config.py``). Every generated action
carries ``config_field`` (``"Class.field"``), which ``tests/test_house.py`` reads to trace each flag
to its field."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Iterable, Mapping

from ..config import _UNSET, Option, cli_option

__all__ = ["add_config_arguments", "values_from_args", "config_from_args", "cli_fields", "flag_of"]

_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def cli_fields(cls: type, names: Iterable[str] | None = None) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of ``cls`` that declare an ``option``, in field order (``names``: only those,
    each of which must declare one)."""
    fields = [(f, cli_option(f)) for f in dataclasses.fields(cls)]
    if names is None:
        return [(f, o) for f, o in fields if o is not None]
    by_name = {f.name: (f, o) for f, o in fields}
    picked = [by_name[n] for n in names]
    missing = [f.name for f, o in picked if o is None]
    if missing:
        raise TypeError(f"{cls.__name__}: {', '.join(missing)} declare no option()")
    return picked


def flag_of(f: dataclasses.Field, o: Option, prefix: str = "") -> str:
    name = (o.flag or "--" + f.name.replace("_", "-"))[2:]
    return f"--{prefix}{name}"


def _dest(f: dataclasses.Field, prefix: str) -> str:
    return (prefix + f.name).replace("-", "_")


def _show(value: Any) -> str:
    """A tuple default as the comma list its flag takes (``0,0.1,...``); ``none`` when empty."""
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) if value else "none"
    return value


def _kwargs(cls: type, f: dataclasses.Field, o: Option, prefix: str) -> dict[str, Any]:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = kind.removesuffix(" | None")   # an optional field's flag is its type's; unset stays None
    kw: dict[str, Any] = {"dest": _dest(f, prefix), "help": o.help}
    if kind == "bool":
        if f.default is not None and o.negate != bool(f.default):
            raise TypeError(f"{cls.__name__}.{f.name}: a bool option flips its default; "
                            f"default {f.default} needs negate={not o.negate}")
        kw["action"] = "store_false" if o.negate else "store_true"
        if f.default is None:   # three states: not given (None: the command decides), given (True)
            kw["default"] = None
        return kw
    if o.parse is not None:
        kw.update(type=str, default=_show(f.default))
    elif kind in _TYPES:
        kw.update(type=_TYPES[kind], default=f.default)
    else:
        raise TypeError(f"{cls.__name__}.{f.name}: type {kind} needs option(parse=...)")
    if o.cli_default is not _UNSET:
        kw["default"] = o.cli_default
    if o.choices is not None:
        kw["choices"] = tuple(o.choices() if callable(o.choices) else o.choices)
    kw["metavar"] = o.metavar or flag_of(f, o, prefix)[2:].upper().replace("-", "_")  # as argparse names it
    if "choices" in kw and not o.metavar:
        del kw["metavar"]  # argparse shows {a,b}
    return kw


def _container(p, title: str | None):
    """``p`` itself, or its argument group ``title`` (made once, reused by later fields)."""
    if title is None or not isinstance(p, argparse.ArgumentParser):
        return p
    for g in p._action_groups:
        if g.title == title:
            return g
    return p.add_argument_group(title)


def add_config_arguments(p, cls: type, names: Iterable[str] | None = None, prefix: str = "",
                         overrides: Mapping[str, Mapping[str, Any]] | None = None,
                         group: str | None = None) -> list[argparse.Action]:
    """Add a flag per ``option`` field of ``cls`` (or of ``names``) to parser or group ``p``.
    ``prefix`` goes in front of the flag and dest (``--bench-seq-lens`` -> ``bench_seq_lens``);
    ``overrides`` replaces argparse keywords of a field where one command differs (a default of
    its own); ``group`` puts every flag in that help section instead of the fields' own."""
    overrides = overrides or {}
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    actions = []
    for f, o in cli_fields(cls, names):
        kw = {**_kwargs(cls, f, o, prefix), **overrides.get(f.name, {})}
        flags = [flag_of(f, o, prefix)] + ([o.short] if o.short else [])
        action = _container(p, group or o.group).add_argument(*flags, **kw)
        action.config_field = f"{cls.__name__}.{f.name}"
        action.field_default = _show(f.default)  # for %(field_default)s in help
        actions.append(action)
    return actions


def values_from_args(cls: type, args: argparse.Namespace, names: Iterable[str] | None = None,
                     prefix: str = "") -> dict[str, Any]:
    """``{field: value}`` from parsed flags: comma lists parsed (``ConfigError`` naming the flag),
    ``None`` (a flag left to the command) left out so the field keeps its default."""
    out: dict[str, Any] = {}
    for f, o in cli_fields(cls, names):
        value = getattr(args, _dest(f, prefix))
        if value is None:
            continue
        if o.parse is not None and isinstance(value, str):
            value = o.parse(value, flag_of(f, o, prefix))
        out[f.name] = value
    return out


def config_from_args(cls: type, args: argparse.Namespace, names: Iterable[str] | None = None,
                     prefix: str = "", **extra: Any):
    """``cls.from_dict`` of the flags' values plus ``extra`` fields (e.g. the resolved device)."""
    return cls.from_dict({**values_from_args(cls, args, names, prefix), **extra})
