"""Human rendering of a command's result dict (rich tables); ``--json`` bypasses this."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render", "console"]

console = Console(stderr=False)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) > 12:
        return f"[{', '.join(_fmt(x) for x in v[:12])}, ... ({len(v)} items)]"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def render(result: dict[str, Any]) -> None:
    tables = result.pop("_tables", None) or {}
    hidden = set(result.pop("_hide", None) or ())  # keys a table above already shows
    for title, rows in tables.items():
        if not rows:
            continue
        t = Table(title=title)
        for col in rows[0]:
            t.add_column(str(col))
        for r in rows:
            t.add_row(*(_fmt(r[c]) for c in rows[0]))
        console.print(t)
    t = Table(show_header=False, box=None)
    for k, v in result.items():
        if k.startswith("_") or k in hidden:
            continue
        t.add_row(f"[bold]{k}[/bold]", _fmt(v))
    console.print(t)
