"""The bench's tables as a markdown report and PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import polars as pl

__all__ = ["markdown_table", "write_report", "plot_latency", "plot_accuracy"]


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


def plot_latency(speedup: pl.DataFrame, path: Path, title: str) -> None:
    """Prefill median latency vs sequence length, dense and HARP, plus the ideal HARP line
    (dense latency / ideal speed-up); right panel: measured vs ideal speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pre = speedup.filter(pl.col("measure") == "prefill").sort("seq_len")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    if pre.height:
        s = pre["seq_len"].to_list()
        a.plot(s, pre["dense_median_ms"].to_list(), "o-", label="dense")
        a.plot(s, pre["harp_median_ms"].to_list(), "s-", label="HARP")
        a.plot(s, (pre["dense_median_ms"] / pre["ideal_speedup"]).to_list(), "k--", lw=1,
               label="HARP ideal (FLOPs)")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        b.plot(s, pre["speedup"].to_list(), "o-", label="measured")
        b.plot(s, pre["ideal_speedup"].to_list(), "k--", label="ideal (FLOPs)")
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
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_accuracy(tasks: pl.DataFrame, ppl: dict[str, float], path: Path, title: str) -> None:
    """Per-task accuracy (dense vs HARP, with standard errors) and held-out perplexity."""
    import matplotlib

    matplotlib.use("Agg")
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
        "`ideal_speedup` is the dense / HARP ratio of FLOPs (`bench/flops.py`); for decode "
        "`ideal_speedup_bytes` is the ratio of bytes read per token (weights + KV cache). "
        "`realised` = (speed-up - 1) / (ideal - 1): the share of the possible gain the engine delivers.",
        "",
        markdown_table(speedup),
        "",
        "![latency](latency.png)",
        "",
        "## Latency (ms)",
        "",
        markdown_table(latency),
        "",
        "## KV cache",
        "",
        f"Measured on the cache tensors: dense {s['kv_bytes_per_token']['dense']:.0f} B/token, HARP "
        f"{s['kv_bytes_per_token']['harp']:.0f} B/token (x{s['kv_reduction']:.3g} smaller)."
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
    lines += ["![accuracy](accuracy.png)", ""]
    Path(path).write_text("\n".join(lines))
