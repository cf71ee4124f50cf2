"""The plot of ``bench/long_context.py``: HARP/dense decode speed-up against context, one panel per
runtime, one line per batch with its 95 % interval, the byte ideal as a dashed line. matplotlib is
optional: without it no PNG is written and the JSON says so. Runs made one runtime at a time go into
one figure with ``python -m harp_trt.bench._long_context_plot OUT.png RUN.json [RUN.json ...]``
(each a ``long_context.json`` of the same plan)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plot", "merge_runs"]


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
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
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


if __name__ == "__main__":
    import json
    import sys

    out, runs = Path(sys.argv[1]), [json.loads(Path(f).read_text()) for f in sys.argv[2:]]
    print(json.dumps({"plot": write_plot(merge_runs(runs), out)[0]}))
