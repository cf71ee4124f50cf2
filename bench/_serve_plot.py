"""``serve_load.png``: output tokens/s against p99 ITL, dense and HARP on one figure, one line per
run through the concurrencies (AIPerf's figures from ``bench/serve_load.py``'s points)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(result: dict[str, Any], path: Path) -> str | None:
    """The figure's path, or None without matplotlib (``pip install harp-trt[plots]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = result.get("points") or []
    for model, color in (("dense", "tab:gray"), ("harp", "tab:red")):
        for run in sorted({p["run"] for p in points}):
            mine = sorted((p for p in points if p["model"] == model and p["run"] == run), key=lambda p: p["concurrency"])
            xs = [(p.get("itl_ms") or {}).get("p99") for p in mine]
            ys = [(p.get("output_tokens_per_s") or {}).get("avg") for p in mine]
            ax.plot(xs, ys, "o-", color=color, alpha=0.8, label=model if run == 0 else None)
            for p, x, y in zip(mine, xs, ys):
                if run == 0 and x is not None and y is not None:
                    ax.annotate(f"c={p['concurrency']}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    slo = ((result.get("goodput_per_run") or [{}])[0] or {}).get("slo") or {}
    if slo.get("itl_ms"):
        ax.axvline(slo["itl_ms"], ls="--", color="k", lw=0.8, label="ITL SLO (run 0)")
    a = result.get("args", {})
    ax.set_xlabel("p99 inter-token latency (ms)")
    ax.set_ylabel("output tokens/s (AIPerf)")
    ax.set_title(f"{a.get('model')} {a.get('quant')}: {a.get('isl')} in / {a.get('osl')} out, KV budget {a.get('kv_budget')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
