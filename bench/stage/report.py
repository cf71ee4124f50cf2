"""The bench's tables as a markdown report and PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl

from harp_trt.extras import require

__all__ = ["markdown_table", "write_report", "plot_latency", "plot_accuracy", "serving_rows"]


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown_table(df: pl.DataFrame, columns: list[str] | None = None) -> str:
    cols = columns or df.columns
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.select(cols).iter_rows():
        lines.append("| " + " | ".join(_fmt(v) for v in row) + " |")
    return "\n".join(lines)


def _ci_err(df: pl.DataFrame) -> list[list[float]] | None:
    """Asymmetric error bars (below, above) of ``speedup`` from its 95 % interval, if present."""
    if "speedup_ci95_low" not in df.columns or not df.height:
        return None
    sp = df["speedup"].to_list()
    lo = [s - (v if v is not None else s) for s, v in zip(sp, df["speedup_ci95_low"].to_list())]
    hi = [(v if v is not None else s) - s for s, v in zip(sp, df["speedup_ci95_high"].to_list())]
    return [lo, hi]


def plot_latency(speedup: pl.DataFrame, path: Path, title: str, summary: dict[str, Any] | None = None) -> None:
    """Top: prefill median latency vs sequence length, dense and HARP, plus the ideal HARP line
    (dense latency / ideal speed-up); measured speed-up with its 95 % interval vs the ideal.
    Bottom (when ``summary`` has them): TTFT and ITL p50/p90/p99 per variant; output tokens/s per
    batch size with each throughput speed-up and its interval."""
    require("matplotlib", "the latency plot needs it").use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    s = summary or {}
    serving = bool(s.get("time_to_first_token") or s.get("throughput"))
    fig, axes = plt.subplots(2 if serving else 1, 2, figsize=(11, 8.4 if serving else 4.2), squeeze=False)
    a, b = axes[0]
    pre = speedup.filter(pl.col("measure") == "prefill").sort("seq_len")
    if pre.height:
        x = pre["seq_len"].to_list()
        a.plot(x, pre["dense_median_ms"].to_list(), "o-", label="dense")
        a.plot(x, pre["harp_median_ms"].to_list(), "s-", label="HARP")
        a.plot(x, (pre["dense_median_ms"] / pre["ideal_speedup"]).to_list(), "k--", lw=1,
               label="HARP ideal (FLOPs)")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        b.errorbar(x, pre["speedup"].to_list(), yerr=_ci_err(pre), fmt="o-", capsize=3,
                   label="measured (95% CI)")
        b.plot(x, pre["ideal_speedup"].to_list(), "k--", label="ideal (FLOPs)")
        if "ceiling" in pre.columns:
            b.axhline(pre["ceiling"][0], color="red", lw=0.8, ls=":", label="ceiling L/(L-P)")
        b.axhline(1.0, color="grey", lw=0.8)
        b.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("prefill median (ms)")
    a.set_title("prefill latency")
    a.legend()
    b.set_xlabel("prompt tokens")
    b.set_ylabel("speed-up (dense / HARP)")
    b.set_title("prefill speed-up")
    b.legend()
    if serving:
        c, d = axes[1]
        names = [("time_to_first_token", "TTFT"), ("inter_token_latency", "ITL")]
        labels, xs = [], []
        for i, (key, short) in enumerate(names):
            for j, pct in enumerate(("p50", "p90", "p99")):
                labels.append(f"{short}\n{pct}")
                xs.append(i * 3.5 + j)
        for off, v in ((-0.2, "dense"), (0.2, "harp")):
            vals = [(s.get(key) or {}).get(v, {}).get(pct, 0.0) for key, _ in names for pct in ("p50", "p90", "p99")]
            c.bar(np.array(xs) + off, vals, 0.4, label="HARP" if v == "harp" else v)
        c.set_xticks(xs, labels, fontsize=8)
        c.set_yscale("log")
        c.set_ylabel("ms (log)")
        c.set_title(f"time to first token / inter-token latency, batch 1, {s.get('decode_context')} tokens")
        c.legend()
        tp = s.get("throughput") or {}
        sizes = sorted(tp, key=int)
        if sizes:
            x = np.arange(len(sizes))
            for off, v in ((-0.2, "dense"), (0.2, "harp")):
                d.bar(x + off, [tp[k][v]["output_token_throughput"]["avg"] for k in sizes], 0.4,
                      label="HARP" if v == "harp" else v)
            spd = s.get("speedups") or {}
            for i, k in enumerate(sizes):
                ci = spd.get(f"throughput_bs{k}")
                if ci:
                    top = max(tp[k]["dense"]["output_token_throughput"]["avg"],
                              tp[k]["harp"]["output_token_throughput"]["avg"])
                    d.annotate(f"{ci['speedup']:.3f}x\n[{ci['speedup_ci95_low']:.3f}, {ci['speedup_ci95_high']:.3f}]",
                               (i, top), ha="center", va="bottom", fontsize=7)
            d.set_xticks(x, [f"batch {k}" for k in sizes])
            d.margins(y=0.2)
            d.legend()
        d.set_ylabel("output tokens/sec")
        d.set_title("output token throughput (speed-up, 95% CI)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(tasks: pl.DataFrame, ppl: dict[str, float], path: Path, title: str) -> None:
    """Per-task accuracy (dense vs HARP, with standard errors) and held-out perplexity."""
    require("matplotlib", "the accuracy plot needs it").use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    # accuracies share one [0, 1] axis; perplexity-like metrics (LAMBADA) are in the table only
    tasks = tasks.filter(~tasks["metric"].str.contains("perplexity")) if tasks.height else tasks
    if tasks.height:
        labels = [f"{t}\n{m}" for t, m in zip(tasks["task"], tasks["metric"])]
        x = np.arange(len(labels))
        for off, v in ((-0.2, "dense"), (0.2, "harp")):
            err = [e if e is not None else 0.0 for e in tasks[f"{v}_stderr"].to_list()]
            a.bar(x + off, tasks[v].to_list(), 0.4, yerr=err, capsize=3, label="HARP" if v == "harp" else v)
        a.set_xticks(x, labels, fontsize=8)
        a.set_ylabel("accuracy")
        a.set_ylim(0, 1)
        a.legend()
    else:
        a.text(0.5, 0.5, "no lm-eval tasks run", ha="center", va="center", transform=a.transAxes)
    a.set_title("lm-eval tasks")
    if ppl:
        b.bar(["dense", "HARP"], [ppl.get("dense", 0.0), ppl.get("harp", 0.0)], color=["C0", "C1"])
    b.set_title("held-out perplexity")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path: Path, summary: dict[str, Any], speedup: pl.DataFrame, latency: pl.DataFrame,
                 accuracy: pl.DataFrame) -> None:
    s = summary
    lines = [
        f"# HARP bench: {s['model']} ({s['engine']} engine)",
        "",
        f"Pruned layers {s['layers']} with alphas {s['alphas']}; dense and HARP run in one process, "
        f"interleaved, {s['repeats']} repeats after {s['warmup']} warm-up(s); {s['threads']} threads on "
        f"{s['machine']}.",
        "",
        "## Speed-up against the ideal",
        "",
        "`ideal_speedup` is the dense / HARP ratio of FLOPs (`harp_trt/flops.py`); for decode "
        "`ideal_speedup_bytes` is the ratio of bytes read per token (weights + KV cache). "
        "`realised` = (speed-up - 1) / (ideal - 1): the share of the possible gain the engine delivers. "
        f"`ceiling` = L / (L - P) = {s.get('speedup_ceiling') or float('nan'):.4f} bounds every speed-up (attention "
        "removed from P of L layers cannot make a step faster); `above_ceiling` flags an interval wholly above "
        "it, a measurement to investigate, not a gain"
        + (f" (flagged here: {', '.join(s['above_ceiling'])})." if s.get("above_ceiling") else " (none here)."),
        "",
        "`speedup` is the geometric mean of the per-repeat dense/HARP time ratios of the interleaved pairs "
        f"(`pairs` of them); `speedup_ci95_low`/`_high` bound it: {s.get('speedup_ci', 'no interval')}. "
        "The interval covers this run's repeat-to-repeat noise only. `--min-speedup` fails only when the "
        "upper bound is below the threshold; when the interval contains the threshold the gate passes "
        "\"not resolved\". `throughput` rows are the end-to-end time of a batch of requests "
        "(`batch_size`); `dense_median_ms`/`harp_median_ms` are for reading.",
        "",
        markdown_table(speedup),
        "",
        *_figure(path, "latency"),
        *_serving_section(s),
        "## Latency (ms)",
        "",
        markdown_table(latency),
        "",
        "## KV cache",
        "",
        f"Measured on the cache the {s['engine']} runtime holds: dense {s['kv_bytes_per_token']['dense']:.0f} "
        f"B/token, HARP {s['kv_bytes_per_token']['harp']:.0f} B/token (x{s['kv_reduction']:.3g} smaller)"
        + (f"; counted from the dimensions: dense {s['kv_bytes_per_token_counted']['dense']:.0f}, HARP "
           f"{s['kv_bytes_per_token_counted']['harp']:.0f} B/token." if s.get("kv_bytes_per_token_counted") else ".")
        if s.get("kv_bytes_per_token") else "Not measured.",
        "",
        "## Accuracy",
        "",
    ]
    p = s.get("ppl") or {}
    if p:
        lines += [f"Held-out perplexity ({p['tokens']} tokens of `{p['corpus']}`, windows of {p['seq_len']}): "
                  f"dense {p['dense']:.4f}, HARP {p['harp']:.4f} ({100 * p['increase']:+.2f} %). "
                  f"Teacher-forced top-1 agreement {s['top1_agreement']:.4f}; greedy continuations match "
                  f"for {100 * s['greedy_match']:.1f} % of their tokens on average.", ""]
    if accuracy.height:
        lines += ["lm-eval (0-shot, `--limit` applies; `split` = the split evaluated, ARC is its validation "
                  "split):", "", markdown_table(accuracy), ""]
    lines += _figure(path, "accuracy")
    Path(path).write_text("\n".join(lines))


def _figure(report: Path, name: str) -> list[str]:
    """The Markdown image line of ``name``.png beside the report, if it was written (the plots extra)."""
    return [f"![{name}]({name}.png)", ""] if (Path(report).parent / f"{name}.png").exists() else []


def _ci_text(ci: dict[str, Any] | None, pairs: bool = True) -> str:
    if not ci:
        return "–"
    text = f"{ci['speedup']:.3f}x [{ci['speedup_ci95_low']:.3f}, {ci['speedup_ci95_high']:.3f}]"
    return f"{text} ({ci['pairs']} pairs)" if pairs else text


def serving_rows(summary: dict[str, Any], wide: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(latency rows, throughput rows) of a summary in genai-perf's names, for tables. ``wide``
    adds each batch's TTFT / ITL p50 (the report); narrow rows fit a terminal (the CLI)."""
    spd = summary.get("speedups") or {}
    lat = []
    for key in ("time_to_first_token", "inter_token_latency"):
        for v in ("dense", "harp"):
            st = (summary.get(key) or {}).get(v)
            if st:
                lat.append({"metric": key if wide else {"time_to_first_token": "TTFT"}.get(key, "ITL"),
                            "unit": st["unit"], "variant": v, "avg": st["avg"], "p50": st["p50"], "p90": st["p90"],
                            "p99": st["p99"], "n": st["n"],
                            "speed-up [95% CI]": _ci_text(spd.get(key), wide) if v == "harp" else ""})
    thr = []
    for k in sorted(summary.get("throughput") or {}, key=int):
        e = summary["throughput"][k]
        row: dict[str, Any] = {"batch": e["batch_size"]}
        for v in ("dense", "harp"):
            row[f"{v} output tokens/sec" if wide else f"{v} tok/s"] = e[v]["output_token_throughput"]["avg"]
        for v in ("dense", "harp"):
            row[f"{v} requests/sec" if wide else f"{v} req/s"] = e[v]["request_throughput"]["avg"]
        if wide:
            for v in ("dense", "harp"):
                row[f"{v} TTFT p50 ms"] = e[v]["time_to_first_token"]["p50"]
                row[f"{v} ITL p50 ms"] = e[v]["inter_token_latency"]["p50"]
        row["speed-up [95% CI]"] = _ci_text(spd.get(f"throughput_bs{k}"), wide)
        thr.append(row)
    return lat, thr


def _rows_table(rows: list[dict[str, Any]]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _serving_section(s: dict[str, Any]) -> list[str]:
    lat, thr = serving_rows(s)
    if not lat and not thr:
        return []
    out = ["## Serving figures (genai-perf / trtllm-bench names)", "",
           f"Each request: {s.get('decode_context')} prompt tokens, {s.get('decode_tokens', 0) + 1} output tokens "
           "(the first from the prefill), greedy; a batch of B requests starts together (no padding). "
           "`time_to_first_token` (TTFT, ms): prefill + first pick; `inter_token_latency` (ITL, also called "
           "TPOT, ms): each later decode step; both at batch 1, percentiles over every timed sample. "
           "`output_token_throughput` (tokens/sec) and `request_throughput` (requests/sec): total output "
           "tokens (requests) over total time of the timed runs.", ""]
    if lat:
        out += [_rows_table(lat), ""]
    if thr:
        out += [_rows_table(thr), ""]
    return out
