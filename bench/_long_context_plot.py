"""The plot of ``bench/long_context.py``: HARP/dense decode speed-up against context, one panel per
runtime, one line per batch with its 95 % interval, the byte ideal as a dashed line. matplotlib is
optional: without it no PNG is written and the JSON says so. Runs made one runtime at a time go into
one figure with ``python -m harp_trt.bench._long_context_plot OUT.png RUN.json [RUN.json ...]``
(each a ``long_context.json`` of the same plan). ``--runs N`` results (a ``summary``) are drawn by
``write_summary_plot``: every run's speed-up with its interval per point, the runs' median, the ideal
and the ceiling L/(L-P), a run above the ceiling in red and named; the same command merges them."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plot", "merge_runs", "write_summary_plot"]


def _save(fig, path: Path) -> None:
    """Write the figure beside ``path`` and rename it there: no half-written PNG."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_plot(result: dict[str, Any], path: Path) -> tuple[str | None, str]:
    """(path written or None, a note)."""
    try:
        import matplotlib
    except ImportError:
        return None, "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runtimes = result["runtimes"]
    fig, axes = plt.subplots(1, max(1, len(runtimes)), figsize=(5 * max(1, len(runtimes)), 4), squeeze=False)
    for ax, (name, r) in zip(axes[0], runtimes.items()):
        for b in sorted({m["batch"] for m in r["decode"]}):
            rows = sorted((m for m in r["decode"] if m["batch"] == b), key=lambda m: m["context"])
            x = [m["context"] for m in rows]
            y = [m["speedup"]["speedup"] for m in rows]
            err = [[m["speedup"]["speedup"] - m["speedup"]["speedup_ci95_low"] for m in rows],
                   [m["speedup"]["speedup_ci95_high"] - m["speedup"]["speedup"] for m in rows]]
            line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"batch {b}")
            ax.plot(x, [m["ideal"]["ideal"] for m in rows], "--", color=line[0].get_color(),
                    label=f"byte ideal, batch {b}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("HARP / dense decode speed-up")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']}, P={result['plan']['pruned']} of {result['plan']['num_layers']} "
                 f"({result['note'].split(':')[0]})", fontsize=9)
    _save(fig, path)
    return str(path), "speed-up vs context per runtime; dashed: the byte ideal"


def merge_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result holding every run's runtimes (the first run's plan and note; runs of another plan
    or model are refused)."""
    first = results[0]
    for r in results[1:]:
        if (r["model"], r["plan"]) != (first["model"], first["plan"]):
            raise ValueError(f"runs of different models or plans: {first['model']} {first['plan']['layers']} "
                             f"vs {r['model']} {r['plan']['layers']}")
    notes = sorted({r["note"].split(":")[0] for r in results})
    return {**first, "note": " / ".join(notes) + ":", "runtimes": {k: v for r in results for k, v in r["runtimes"].items()}}


def write_summary_plot(results: list[dict[str, Any]], path: Path) -> tuple[str | None, str]:
    """(path written or None, a note) for ``--runs N`` results, each holding ``runs`` and ``summary``."""
    try:
        import matplotlib
    except ImportError:
        return None, "matplotlib is not installed: no plot (pip install matplotlib)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(rt, f"{rt}\n{'decode %d x %d' % (p['context'], p['batch']) if 'batch' in p else 'prefill %d' % p['seq_len']}", p)
              for res in results for rt, r in res["summary"]["runtimes"].items() for p in r["decode"] + r["prefill"]]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(points)), 4.2))
    for x, (_, label, p) in enumerate(points):
        n = len(p["per_run"])
        for k, r in enumerate(p["per_run"]):
            above = k + 1 in p["above_ceiling_runs"]
            xo = x + (k - (n - 1) / 2) * 0.12
            ax.errorbar([xo], [r["speedup"]], yerr=[[r["speedup"] - r["ci95_low"]], [r["ci95_high"] - r["speedup"]]],
                        fmt="o", ms=4, capsize=2, color="tab:red" if above else "tab:blue")
            if above:
                ax.annotate("above ceiling", (xo, r["ci95_high"]), fontsize=7, color="tab:red", ha="center",
                            xytext=(0, 4), textcoords="offset points")
        ax.plot([x - 0.3, x + 0.3], [p["speedup_median"]] * 2, color="black", lw=2)
        ax.plot([x - 0.3, x + 0.3], [p["ideal"]] * 2, "--", color="tab:green", lw=1.2)
        ax.plot([x - 0.35, x + 0.35], [p["ceiling"]] * 2, color="tab:red", lw=1)
    ax.set_xticks(range(len(points)), [label for _, label, _ in points], fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_ylabel("HARP / dense speed-up")
    first = results[0]["runs"][0]
    ax.set_title(f"{first['model'].rstrip('/').split('/')[-1]}, P={first['plan']['pruned']} of "
                 f"{first['plan']['num_layers']}: each run (95 % interval), median (black),\n"
                 "ideal (green, dashed), ceiling L/(L-P) (red)", fontsize=8)
    _save(fig, path)
    return str(path), "each run's speed-up per point with the median, the ideal and the ceiling"


if __name__ == "__main__":
    import json
    import sys

    out, runs = Path(sys.argv[1]), [json.loads(Path(f).read_text()) for f in sys.argv[2:]]
    if all("summary" in r for r in runs):
        print(json.dumps({"plot": write_summary_plot(runs, out)[0]}))
    else:
        print(json.dumps({"plot": write_plot(merge_runs(runs), out)[0]}))
