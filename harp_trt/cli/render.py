"""Human rendering of a command's result dict (rich tables); ``--json`` bypasses this. A command
module with its own ``render(result, console)`` (build's summary, ``_summary.py``) is rendered by it.

No cell is ever cut: a value wider than its column folds onto the next line, every character kept
(rich's default, "…", once cut every artifact path at 80 columns)."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["render", "make_console"]


def make_console() -> Console:
    """A console on stdout, made when the result is printed (so ``COLUMNS`` then applies)."""
    return Console(stderr=False)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)) and len(v) > 12:
        return f"[{', '.join(_fmt(x) for x in v[:12])}, ... ({len(v)} items)]"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_fmt(x)}" for k, x in v.items())
    return str(v)


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or make_console()
    tables = result.pop("_tables", None) or {}
    hidden = set(result.pop("_hide", None) or ())  # keys a table above already shows
    for title, rows in tables.items():
        if not rows:
            continue
        t = Table(title=title)
        for col in rows[0]:
            t.add_column(str(col), overflow="fold")
        for r in rows:
            t.add_row(*(Text(_fmt(r[c])) for c in rows[0]))
        console.print(t)
    t = Table(show_header=False, box=None)
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    for k, v in result.items():
        if k.startswith("_") or k in hidden:
            continue
        t.add_row(Text(str(k)), Text(_fmt(v)))
    console.print(t)
