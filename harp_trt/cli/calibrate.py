"""harp-trt calibrate: choose the pruned layers and search their alphas (Algorithm 1)."""
from __future__ import annotations

import argparse
import time

from ._common import add_calibrate_arguments, add_model_argument, calibrate_config_from_args, progress_bar

NAME = "calibrate"
HELP = "score layers, choose P and search alpha; writes a cached plan artifact"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_argument(p)
    add_calibrate_arguments(p)
    p.add_argument("--force", action="store_true", help="recompute even if the artifact is cached")


def run(args) -> dict:
    from ..models import resolve_model
    from ..pipeline import run_stage
    from ..stage import Hooks
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config, placement = calibrate_config_from_args(args)
    store = ArtifactStore(args.workdir)
    resolved = resolve_model(args.model, store.root)
    with progress_bar(not args.json) as (on_candidate, on_phase):
        art = run_stage("calibrate", config, {"model": resolved, "naive": args.naive}, store, force=args.force,
                        hooks=Hooks(on_candidate, on_phase, placement))
    return calibrate_summary(art, time.perf_counter() - t0)


def calibrate_summary(art, seconds: float) -> dict:
    from ..plan import Plan

    plan = Plan.load(art.path)
    return {"artifact": str(art.path), "plan": str(art.path / "plan.json"), "model": plan.model_ref,
            "strategy": plan.strategy, "layers": list(plan.layers), "alphas": list(plan.alphas),
            "ppl": plan.ppl, "search_split": plan.search_split, "placement": plan.extra.get("placement"),
            **_replacement(plan),
            "seconds": round(seconds, 3),
            "cached": art.cached}


def _replacement(plan) -> dict:
    """With ``--replacement rrr | lmmse``: the method, the layers where its fitted map won, and its
    cost per token beside HARP's V.O (``calib/fit.py: cost_record``)."""
    rec = plan.extra.get("replacement")
    if not rec:
        return {}
    return {"replacement": rec["method"], "fit_inputs": rec.get("fit_inputs"), "fitted_layers": list(plan.fitted_layers),
            "replacement_cost": rec["cost"]}
