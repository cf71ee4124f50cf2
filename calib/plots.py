"""PNG of the alpha search: alpha per pruned layer, and perplexity per candidate in search order."""
from __future__ import annotations

from pathlib import Path

from harp_trt.extras import require

__all__ = ["plot_search"]


def plot_search(plan, trace: list[dict], path: Path) -> None:
    require("matplotlib", "the alpha-search plot needs it").use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    fitted = set(plan.fitted_layers)
    a1.bar([str(l) for l in plan.layers], plan.alphas,
           color=["tab:orange" if l in fitted else "tab:blue" for l in plan.layers])  # orange: a fitted map
    a1.set_ylim(0, 1.05)
    a1.set_xlabel("pruned layer")
    a1.set_ylabel("alpha")
    a1.set_title(f"{plan.model_ref}: {'given' if plan.extra.get('alphas_given') else 'searched'} alpha "
                  f"(P={len(plan.layers)}, {plan.strategy})")
    xs = list(range(len(trace)))
    a2.plot(xs, [r["ppl"] for r in trace], ".-", label="candidate")
    a2.plot(xs, [r["best_ppl"] for r in trace], "-", label="best so far")
    fits = [(x, r["ppl"]) for x, r in zip(xs, trace) if r.get("candidate", "harp") != "harp"]
    if fits:
        a2.plot(*zip(*fits), "o", color="tab:orange", label=f"fitted {plan.replacement}")
    a2.axhline(plan.ppl.get("dense", float("nan")), color="k", ls="--", lw=1, label="dense")
    a2.set_yscale("log")
    a2.set_xlabel("candidate (top-down, grid order)")
    a2.set_ylabel("calibration perplexity")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
