"""harp-trt sweep: which P a budget allows.

Calibrates P = 1..``--max-p`` with the same flags (each a cached calibrate artifact: a rerun costs
nothing, and the plan the sweep picks is the very artifact ``calibrate -P <P>`` gives), and puts beside
each plan's held-out perplexity what P buys at the user's ``--context`` x ``--batch``: the decode
ceiling L/(L-P) (no HARP engine can beat it, arXiv 2507.01900 removes attention, not the MLPs), the
KV cache saved (P/L of the dense cache) and the byte ideal of one decode step (weights plus KV read,
``harp_trt/flops.py``). With ``--max-ppl-increase X`` it picks the largest P whose held-out
perplexity is at most (1 + X) x dense and, with ``--plan-out``, writes that plan there.

Held-out perplexity is on text no choice read (``calib.stage.split_sources``). Speed is not measured
here: ``harp-trt bench`` measures the chosen plan's engine."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import option
from ..errors import ConfigError
from ._common import add_calibrate_arguments, add_model_argument, calibrate_config_from_args

NAME = "sweep"
HELP = "calibrate P = 1..--max-p and show the accuracy-speed frontier; pick the largest P within a budget"


@dataclass(frozen=True)
class Sweep:
    """What the sweep tries and what it reports P against (its flags are these fields)."""

    max_p: int = option(0, help="the largest number of pruned layers to try (required)")
    max_ppl_increase: float = option(-1.0, help="budget: held-out perplexity at most (1 + X) x dense, e.g. 0.1 "
                                     "(default: no pick)", cli_default=None)
    context: int = option(8192, help="decode context of the byte ideal (default %(default)s)")
    batch: int = option(4, help="decode batch of the byte ideal (default %(default)s)")
    weight_bytes: float = option(4.0, help="bytes per weight of the engine, for the byte ideal (default "
                                 "%(default)s: fp32)")
    plan_out: str = option("", help="write the picked plan (plan.json and its tensors) to this folder")
    png: str = option("", help="draw the frontier to this PNG (needs matplotlib)")

    def validate(self, layers: int) -> None:
        if not 1 <= self.max_p < layers:
            raise ConfigError(f"--max-p must lie in 1..{layers - 1} for a {layers}-layer model, got {self.max_p}")
        if self.max_ppl_increase is not None and self.max_ppl_increase < 0:
            raise ConfigError(f"--max-ppl-increase must be >= 0, got {self.max_ppl_increase}")
        if self.context < 1 or self.batch < 1 or self.weight_bytes <= 0:
            raise ConfigError("--context, --batch and --weight-bytes must be positive")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ._options import add_config_arguments

    add_model_argument(p)
    add_calibrate_arguments(p)
    add_config_arguments(p, Sweep, group="sweep")


def run(args) -> dict:
    from ..memory import peak_rss_bytes
    from ..models import resolve_model
    from ..pipeline import run_stage
    from ..plan import Plan
    from ..stage import Hooks
    from ..store import ArtifactStore
    from ..versions import provenance
    from ._options import values_from_args

    if args.prune_layers or args.alphas or args.paper_alphas:
        raise ConfigError("sweep chooses the layers by --strategy and searches their alphas",
                          "drop --prune-layers / --alphas / --paper-alphas")
    sw = Sweep(**{"max_ppl_increase": None, **values_from_args(Sweep, args)})
    t0 = time.perf_counter()
    args.layers = 1
    base, placement = calibrate_config_from_args(args)
    store = ArtifactStore(args.workdir)
    resolved = resolve_model(args.model, store.root)
    dims = _dims(resolved.folder)
    layers = dims.num_layers
    sw.validate(layers)
    rows = []
    for p in range(1, sw.max_p + 1):
        t = time.perf_counter()
        art = run_stage("calibrate", dataclasses.replace(base, layers=p), {"model": resolved}, store,
                        hooks=Hooks(None, None, placement))
        plan = Plan.load(art.path)
        rows.append({**_row(plan, dims, sw), "artifact": str(art.path), "cached": art.cached,
                     "seconds": round(time.perf_counter() - t, 3)})
    chosen = _pick(rows, sw.max_ppl_increase)
    if chosen is not None and sw.plan_out:
        Plan.load(chosen["artifact"]).save(_out_dir(sw.plan_out) / "plan.json")
    png = _plot(rows, chosen, Path(sw.png)) if sw.png else None
    return {"model": args.model, "num_layers": layers, "strategy": base.strategy, "replacement": base.replacement,
            "recover": base.recover, "context": sw.context, "batch": sw.batch, "weight_bytes": sw.weight_bytes,
            "frontier": rows, "max_ppl_increase": sw.max_ppl_increase,
            "chosen": None if chosen is None else {"P": chosen["P"], "plan": chosen["artifact"],
                                                   "written_to": sw.plan_out or None},
            "png": png, "seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": peak_rss_bytes(),
            "provenance": provenance(sys.argv[1:]), "_hide": ("frontier", "provenance"),
            "_tables": {"frontier": [{"P": r["P"], "layers": r["layers"], "held-out ppl": r["heldout"],
                                      "increase %": round(r["ppl_increase"] * 100, 2), "ceiling": r["ceiling"],
                                      "byte ideal": r["byte_ideal"], "KV saved": r["kv_saved"],
                                      "picked": chosen is not None and r["P"] == chosen["P"]} for r in rows]}}


def _dims(folder):
    from transformers import AutoConfig

    from ..dims import ModelDims

    return ModelDims.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=False))


def _row(plan, d, sw: Sweep) -> dict:
    """One frontier row: the plan's held-out perplexity against dense, and what P buys."""
    from .. import flops

    ideal = flops.decode_ideal(d, plan.alpha_map, sw.context, sw.batch, sw.weight_bytes, sw.weight_bytes)
    dense, held = plan.ppl["heldout_dense"], plan.ppl["heldout_searched"]
    return {"P": len(plan.layers), "layers": list(plan.layers), "alphas": list(plan.alphas),
            "fitted_layers": list(plan.fitted_layers), "heldout_dense": dense, "heldout": held,
            "ppl_increase": held / dense - 1, "ceiling": flops.speedup_ceiling(d.num_layers, len(plan.layers)),
            "kv_saved": len(plan.layers) / d.num_layers, "byte_ideal": ideal["ideal"]}


def _pick(rows: list[dict], budget: float | None) -> dict | None:
    """The row of the largest P whose held-out perplexity increase is within ``budget``."""
    if budget is None:
        return None
    within = [r for r in rows if r["ppl_increase"] <= budget]
    return max(within, key=lambda r: r["P"]) if within else None


def _out_dir(path: str) -> Path:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _plot(rows: list[dict], chosen: dict | None, path: Path) -> str:
    from ..extras import require

    plt = require("matplotlib.pyplot", "the sweep's frontier PNG")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["ceiling"] for r in rows], [r["ppl_increase"] * 100 for r in rows], "o-", label="held-out perplexity")
    for r in rows:
        ax.annotate(f"P={r['P']}", (r["ceiling"], r["ppl_increase"] * 100), fontsize=7)
    if chosen is not None:
        ax.plot([chosen["ceiling"]], [chosen["ppl_increase"] * 100], "r*", markersize=12, label=f"picked P={chosen['P']}")
    ax.set_xlabel("decode ceiling L/(L-P)")
    ax.set_ylabel("held-out perplexity over dense (%)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
