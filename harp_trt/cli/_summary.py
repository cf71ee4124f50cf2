"""The summary ``harp-trt build`` prints for a person (``--json`` prints the result dict instead).

Nothing here cuts a value: paths fold at the terminal's width (their characters all there, split
over lines), and the one command to run next is printed on one line of its own, never wrapped by
rich, so a terminal copies it whole. Numbers are rounded for reading: perplexities to 2 decimals,
memory and disk in GB, times in seconds."""
from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["render_build", "next_command", "sparkline", "ppl_rows", "GENERATE_PROMPT"]

GB = 1e9
GENERATE_PROMPT = "The capital of France is"
SPARK = "▁▂▃▄▅▆▇█"
SPARK_ASCII = "_.-=+*#@"
SPARK_WIDTH = 40  # at most this many candidates side by side; more are binned (each bin its lowest)
# perplexity keys of a plan (calib/stage.py) -> column; "heldout_" keys go to the held-out row
PPL_COLUMNS = {"dense": "dense", "alpha1": "alpha=1", "alpha0": "alpha=0", "searched": "searched"}


def render_build(result: dict[str, Any], console: Console) -> None:
    """Stages, pruned layers (with the alpha search as text), perplexities, the rest as key/value
    lines, then ``next: harp-trt generate ...`` where the build made an ORT engine."""
    stages = result.get("stages") or {}
    console.print(_stage_table(stages, result.get("seconds"), result.get("all_cached")))
    calib = stages.get("calibrate", {}).get("artifact")
    console.print(_layer_table(result.get("layers") or [], result.get("alphas") or [], calib, console))
    if result.get("ppl"):
        console.print(_ppl_table(result["ppl"]))
    facts = _facts(result, calib)
    bench = result.get("bench")
    if bench:
        report = stages.get("bench", {}).get("artifact")
        _bench_facts(facts, bench, Path(report) / "report.md" if report else None)
    console.print(facts)
    cmd = next_command(result)
    if cmd:
        console.print(Text(f"next: {cmd}"), soft_wrap=True)


def next_command(result: dict[str, Any]) -> str | None:
    """``harp-trt generate --artifact ENGINE --prompt ...`` when the build's engine is one
    ``generate`` runs (a folder with ``engine.json``), else None."""
    engine = result.get("engine")
    from ..engine_spec import is_engine

    if not engine or not is_engine(engine):
        return None
    return f"harp-trt generate --artifact {shlex.quote(engine)} --prompt {_dq(GENERATE_PROMPT)}"


def _dq(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`") + '"'


def _gb(n: Any) -> str:
    return f"{n / GB:.2f} GB" if isinstance(n, (int, float)) else "–"


def _num(v: Any, digits: int = 2) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) and math.isfinite(v) else "–"


def _grid() -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")
    return t


def _stage_table(stages: dict[str, dict], seconds: Any, all_cached: Any) -> Table:
    """One row per stage; artifacts by folder name (a cache key every command's --plan/--artifact
    takes) where they share one folder (``_facts`` prints it in full as "cache"), else by full path."""
    paths = [Path(s["artifact"]) for s in stages.values() if s.get("artifact")]
    parents = {p.parent for p in paths}
    root = next(iter(parents)) if len(parents) == 1 else None
    cached = "every stage a cache hit" if all_cached else "built what was not cached"
    caption = f"{_num(seconds)} s in all, {cached}"
    t = Table(title="harp-trt build", caption=Text(caption), box=box.SIMPLE_HEAD, caption_justify="left")
    for name, kw in (("stage", {}), ("status", {}), ("seconds", {"justify": "right"}),
                     ("peak RSS", {"justify": "right"}), ("artifact", {})):
        t.add_column(name, overflow="fold", **kw)
    for name, s in stages.items():
        art = Path(s["artifact"]) if s.get("artifact") else None
        shown = "" if art is None else art.name if root is not None else str(art)
        t.add_row(Text(name), "cached" if s.get("cached") else "built", _num(s.get("seconds")),
                  _gb(s.get("peak_rss_so_far")) if s.get("peak_rss_so_far") else "–", Text(shown))
    return t


def _search_trace(calib: str | None) -> dict[int, list[tuple[float, float]]]:
    """layer -> [(alpha, calibration perplexity)] sorted by alpha, from the calibrate artifact's
    search_trace.parquet ({} when it has none)."""
    f = Path(calib) / "search_trace.parquet" if calib else None
    if f is None or not f.is_file():
        return {}
    import polars as pl

    out: dict[int, list[tuple[float, float]]] = {}
    for r in pl.read_parquet(f, columns=["layer", "alpha", "ppl"]).iter_rows(named=True):
        out.setdefault(int(r["layer"]), []).append((float(r["alpha"]), float(r["ppl"])))
    return {layer: sorted(c) for layer, c in out.items()}


def sparkline(values: list[float], ascii_only: bool = False, width: int = SPARK_WIDTH) -> str:
    """One character per value, its height the value's place between the lowest and the highest on
    a log scale (perplexities span orders of magnitude between alpha 0 and 1); more than ``width``
    values are binned, each bin shown by its lowest."""
    ramp = SPARK_ASCII if ascii_only else SPARK
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    if len(vals) != len(values) or not vals:
        return "?" * min(len(values), width)
    if len(vals) > width:
        edges = [round(i * len(vals) / width) for i in range(width + 1)]
        vals = [min(vals[a:b]) for a, b in zip(edges, edges[1:])]
    lo, hi = math.log(min(vals)), math.log(max(vals))
    if hi - lo < 1e-12:
        return ramp[0] * len(vals)
    return "".join(ramp[min(len(ramp) - 1, int((math.log(v) - lo) / (hi - lo) * len(ramp)))] for v in vals)


def _layer_table(layers: list[int], alphas: list[float], calib: str | None, console: Console) -> Table:
    """Pruned layers and their alphas; where alpha was searched, the search as text: calibration
    perplexity per candidate alpha (a sparkline), its lowest and highest."""
    trace = _search_trace(calib)
    searched = any(len(trace.get(layer, ())) > 1 for layer in layers)
    t = Table(title="pruned layers", box=box.SIMPLE_HEAD)
    t.add_column("layer", justify="right")
    t.add_column("alpha", justify="right")
    if searched:
        span = [a for layer in layers for a, _ in trace.get(layer, ())]
        t.add_column(f"perplexity vs alpha {min(span):.2f}..{max(span):.2f} (log)", overflow="fold")
        t.add_column("lowest", justify="right")
        t.add_column("highest", justify="right")
    ascii_only = not (console.encoding or "").lower().startswith("utf")
    for layer, alpha in zip(layers, alphas):
        row = [str(layer), _num(alpha)]
        if searched:
            ppls = [p for _, p in trace.get(layer, ())]
            row += [sparkline(ppls, ascii_only), _num(min(ppls, default=math.nan)), _num(max(ppls, default=math.nan))]
        t.add_row(*row)
    return t


def ppl_rows(ppl: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """(columns, {"calibration"|"held-out": {column: "12.34"}}) of a plan's perplexities."""
    cols: list[str] = []
    rows: dict[str, dict[str, str]] = {"calibration": {}, "held-out": {}}
    for key, value in ppl.items():
        held = key.startswith("heldout_")
        name = key[len("heldout_"):] if held else key
        col = PPL_COLUMNS.get(name, name)
        if col not in cols:
            cols.append(col)
        rows["held-out" if held else "calibration"][col] = _num(value)
    order = list(PPL_COLUMNS.values())
    cols.sort(key=lambda c: order.index(c) if c in order else len(order))
    return cols, {k: r for k, r in rows.items() if r}


def _ppl_table(ppl: dict[str, Any]) -> Table:
    cols, rows = ppl_rows(ppl)
    t = Table(title="perplexity", caption="held-out: text the search never saw", box=box.SIMPLE_HEAD,
              caption_justify="left")
    t.add_column("")
    for c in cols:
        t.add_column(c, justify="right")
    for name, r in rows.items():
        t.add_row(name, *(r.get(c, "–") for c in cols))
    return t


def _facts(result: dict[str, Any], calib: str | None) -> Table:
    t = _grid()
    t.add_row("model", Text(str(result.get("model", ""))))
    t.add_row("backend", Text(str(result.get("backend", ""))))
    kv = result.get("kv_bytes_per_token") or {}
    if kv.get("harp"):
        dense = kv.get("dense")
        t.add_row("KV cache", f"{kv['harp']:,} B per token" +
                  (f" (dense {dense:,}: {dense / kv['harp']:.2f}x smaller)" if dense else ""))
    quant = result.get("quant")
    if quant:
        q = [f"{quant.get('mode', '')}, block {quant.get('block_size')}",
             f"weights {_gb(quant.get('weight_bytes_fp32'))} -> {_gb(quant.get('weight_bytes_quantized'))}"]
        t.add_row("quantized", ", ".join(q))
    pre = result.get("preflight")
    if pre:
        t.add_row("preflight", f"peak memory ~{_gb(pre.get('peak_rss'))} of {_gb(pre.get('free_memory'))} "
                               f"available; peak disk ~{_gb(pre.get('peak_disk'))} of {_gb(pre.get('free_disk'))} "
                               f"free ({pre.get('path')} path)")
    for note in result.get("notes") or ():
        t.add_row("note", Text(str(note)))
    paths = {Path(s["artifact"]).parent for s in (result.get("stages") or {}).values() if s.get("artifact")}
    if len(paths) == 1:
        t.add_row("cache", Text(str(paths.pop())))
    if calib:
        t.add_row("plan", Text(str(Path(calib) / "plan.json")))
        png = Path(calib) / "alpha_search.png"
        if png.is_file():
            t.add_row("figure", Text(str(png)))
        elif len(_search_trace(calib).get((result.get("layers") or [None])[0], ())) > 1:
            # Text, not a markup string: rich would read "[plots]" as a style tag and drop it
            t.add_row("figure", Text("alpha_search.png not written (matplotlib is not installed: pip install -e "
                                     "'.[plots]'); the search is the text under \"pruned layers\""))
    if result.get("engine"):
        t.add_row("engine", Text(str(result["engine"])))
    return t


def _bench_facts(t: Table, bench: dict[str, Any], report: Path | None) -> None:
    """The bench's headline figures as rows of ``t`` (the full tables: its report.md)."""
    t.add_row("bench", Text(f"{bench.get('engine', '')} engines, dense vs HARP"))
    p = bench.get("ppl") or {}
    if "dense" in p and "harp" in p:
        inc = p.get("increase")
        t.add_row("held-out ppl", f"dense {_num(p['dense'])}, HARP {_num(p['harp'])}" +
                  (f" ({100 * inc:+.2f} %)" if isinstance(inc, (int, float)) else ""))
    pre = bench.get("prefill_speedup") or {}
    if pre:
        t.add_row("prefill speed-up", ", ".join(f"{k} tokens {_num(v)}x" for k, v in pre.items()))
    for key, label in (("decode_speedup", "decode speed-up"), ("ttft_speedup", "TTFT speed-up")):
        if isinstance(bench.get(key), (int, float)):
            t.add_row(label, f"{_num(bench[key])}x")
    if report is not None:
        t.add_row("report", Text(str(report)))
