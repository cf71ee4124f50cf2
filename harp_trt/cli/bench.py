"""harp-trt bench: latency and accuracy of a plan's HARP engine against the dense engine."""
from __future__ import annotations

import argparse
import time

from ._common import add_placement_arguments
from ._options import add_config_arguments
from ._options import config_from_args as _config_from_args

NAME = "bench"
HELP = ("latency (prefill sweep, TTFT, ITL, throughput per batch size, KV bytes; speed-ups with 95% CIs) and "
        "accuracy (perplexity, lm-eval) of dense vs HARP")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", help="calibrate artifact folder, its key, or a plan.json")
    src.add_argument("--artifact", dest="plan", help="same as --plan: a calibrate artifact key or folder")
    p.add_argument("--model", default=None, help="override the plan's model reference (same weights; torch engine)")
    p.add_argument("--dense-engine", default=None,
                   help="engines other than torch: folder (or artifact key) of the dense engine")
    p.add_argument("--harp-engine", default=None,
                   help="engines other than torch: folder (or artifact key) of the HARP engine")
    add_config_arguments(p, _bench_config_class())
    add_placement_arguments(p, resident_only=True)   # the torch engine's
    for cls in _bench_spec().cli.options:   # the gates
        add_config_arguments(p, cls)
    p.add_argument("--force", action="store_true", help="re-measure even if the artifact is cached")


def _bench_spec():
    from ..registry import STAGES

    return STAGES.get("bench")


def _bench_config_class() -> type:
    return _bench_spec().config_class()  # a light module: flags without a runtime


def config_from_args(args):
    from ..device import resolve_placement

    placement = resolve_placement(args.device, args.dtype)
    return _config_from_args(_bench_config_class(), args, dtype=placement.dtype, device=placement.kind)


def _open(ref: str, store):
    from pathlib import Path

    p = Path(ref)
    return p if p.exists() else store.open(ref)


def run(args) -> dict:
    from ..errors import ConfigError
    from ..plan import open_plan
    from ..store import ArtifactStore
    from ._common import progress_bar

    t0 = time.perf_counter()
    config = config_from_args(args)
    spec = _bench_spec()
    run_bench, check_gates, serving_rows = (spec.entry(n) for n in ("run_bench", "check_gates", ".report:serving_rows"))
    store = ArtifactStore(args.workdir)
    open_plan(args.plan, store)  # a missing or malformed plan fails here, in one line
    plan_ref = _open(args.plan, store)
    if config.takes_engine_folders():
        if not (args.dense_engine and args.harp_engine):
            raise ConfigError(f"--engine {config.engine} needs --dense-engine DIR and --harp-engine DIR "
                              f"({config.source_help()})",
                              f"build them with `harp-trt build --bench --bench-engine {config.engine}`, "
                              "or use --engine torch")
        source = {"dense": _open(args.dense_engine, store), "harp": _open(args.harp_engine, store)}
    else:
        source = args.model
    with progress_bar(not args.json) as (_, on_phase):
        art = run_bench(plan_ref, source, config, store, force=args.force, on_phase=on_phase)
    s = art.manifest["summary"]
    gates = check_gates(s, args.max_ppl_increase, args.min_speedup)
    out = {"artifact": str(art.path), "report": str(art.path / "report.md"), "cached": art.cached,
           "engine": s["engine"], "model": s["model"], "layers": s["layers"],
           "prefill_speedup": s["prefill_speedup"], "prefill_ideal": s["prefill_ideal"],
           "ttft_speedup": s["ttft_speedup"], "decode_speedup": s["decode_speedup"],
           "speedups": s.get("speedups"), "time_to_first_token": s.get("time_to_first_token"),
           "inter_token_latency": s.get("inter_token_latency"), "throughput": s.get("throughput"),
           "decode_ideal_flops": s["decode_ideal_flops"], "decode_ideal_bytes": s["decode_ideal_bytes"],
           "tokens_per_s": s["tokens_per_s"], "kv_bytes_per_token": s["kv_bytes_per_token"],
           "kv_reduction": s["kv_reduction"], "ppl": s["ppl"], "top1_agreement": s["top1_agreement"],
           "greedy_match": s["greedy_match"],
           "accuracy_delta": {t: {m: v["delta"] for m, v in ms.items()} for t, ms in s["tasks"].items()},
           "gates": gates, "seconds": round(time.perf_counter() - t0, 3)}
    import polars as pl

    spd = pl.read_csv(art.path / "speedup.csv")
    lat, thr = serving_rows(s, wide=False)
    out["_tables"] = {"speed-up vs ideal": [
        {"measure": r["measure"], "tokens": r["seq_len"], "batch": r["batch_size"], "dense ms": r["dense_median_ms"],
         "HARP ms": r["harp_median_ms"], "speed-up": r["speedup"],
         "95% CI": f"{r['speedup_ci95_low']:.3f}-{r['speedup_ci95_high']:.3f}", "pairs": r["pairs"],
         "ideal": r["ideal_speedup"] if r["ideal_speedup"] is not None else "–"} for r in spd.iter_rows(named=True)],
        "latency (ms), batch 1": lat, "throughput": thr, "gates": [{"gate": g} for g in gates]}
    # shown by the tables above (and the gate lines hold brackets that rich would read as markup)
    out["_hide"] = ["speedups", "time_to_first_token", "inter_token_latency", "throughput", "gates"]
    return out
