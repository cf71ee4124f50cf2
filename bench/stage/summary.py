"""The bench's tables and summary: speed-up rows (measured beside the counted ideal), the parquet
and CSV tables, and ``summary.json`` (what ``--json`` prints)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import BenchConfig
from harp_trt.flops import above_ceiling

__all__ = ["speedup_rows", "write_tables", "summarise_bench", "label"]


def write_tables(out_dir: Path, samples: list[dict], lat_rows: list[dict], speed_rows: list[dict],
                 acc_rows: list[dict]):
    """Write ``latency_samples.parquet`` and ``{latency,speedup,accuracy}.{parquet,csv}``; returns
    the (latency, speedup, accuracy) frames."""
    import polars as pl

    for r in acc_rows:
        r["delta"] = r["harp"] - r["dense"]
    schema = {"task": pl.String, "metric": pl.String, "split": pl.String, "dense": pl.Float64,
              "harp": pl.Float64, "delta": pl.Float64, "dense_stderr": pl.Float64,
              "harp_stderr": pl.Float64, "n": pl.Int64, "higher_is_better": pl.Boolean}
    acc = pl.DataFrame(acc_rows, schema=schema)
    lat = pl.DataFrame(lat_rows, schema={
        "engine": pl.String, "measure": pl.String, "seq_len": pl.Int64, "batch_size": pl.Int64,
        "variant": pl.String,
        "median_ms": pl.Float64, "p90_ms": pl.Float64, "p99_ms": pl.Float64, "mean_ms": pl.Float64,
        "min_ms": pl.Float64, "n": pl.Int64, "tokens_per_s": pl.Float64, "kv_bytes_per_token": pl.Float64})
    spd = pl.DataFrame(speed_rows, schema={
        "measure": pl.String, "seq_len": pl.Int64, "batch_size": pl.Int64, "dense_median_ms": pl.Float64,
        "harp_median_ms": pl.Float64, "speedup": pl.Float64, "speedup_ci95_low": pl.Float64,
        "speedup_ci95_high": pl.Float64, "pairs": pl.Int64, "ceiling": pl.Float64, "above_ceiling": pl.Boolean,
        "ideal_speedup": pl.Float64,
        "ideal_speedup_bytes": pl.Float64, "realised": pl.Float64, "dense_gflops": pl.Float64,
        "harp_gflops": pl.Float64})
    pl.DataFrame(samples, schema={"measure": pl.String, "variant": pl.String, "seq_len": pl.Int64,
                                  "batch_size": pl.Int64, "repeat": pl.Int64, "step": pl.Int64,
                                  "ms": pl.Float64}
                 ).write_parquet(out_dir / "latency_samples.parquet")
    for name, df in (("latency", lat), ("speedup", spd), ("accuracy", acc)):
        df.write_parquet(out_dir / f"{name}.parquet")
        df.write_csv(out_dir / f"{name}.csv")
    return lat, spd, acc


def speedup_rows(lat_rows: list[dict], pairs: dict[tuple, dict], ideal: dict[str, Any],
              config: BenchConfig) -> list[dict]:
    """One row per speed-up: prefill per sequence length, TTFT and decode (inter-token latency) at
    batch 1, and ``throughput`` per ``batch_sizes`` entry (end-to-end time of a batch of requests).
    ``speedup`` and its interval come from the interleaved pairs (``latency.paired_speedup``); the
    medians are for reading."""
    med = {(r["measure"], r["seq_len"], r["batch_size"], r["variant"]): r["median_ms"] for r in lat_rows}
    wanted = {"prefill": {1}, "ttft": {1}, "decode": {1}, "request": {int(b) for b in config.batch_sizes}}
    out = []
    for (measure, seq, batch), ci in sorted(pairs.items()):
        if batch not in wanted.get(measure, ()):
            continue
        d, h = med.get((measure, seq, batch, "dense")), med.get((measure, seq, batch, "harp"))
        if d is None or h is None:
            continue
        bytes_ideal = None
        if measure == "prefill":
            flops = ideal["prefill"].get(seq)
        elif measure == "ttft":
            flops = ideal["ttft"]
        elif measure == "decode":
            flops = ideal["decode"]
            bytes_ideal = ideal["decode_bytes"]["ideal"]
        else:
            flops = None  # a request mixes prefill and decode: no single counted ideal
        idl = flops["ideal"] if flops else None
        speed = ci["speedup"]
        out.append({"measure": "throughput" if measure == "request" else measure, "seq_len": seq,
                    "batch_size": batch, "dense_median_ms": d, "harp_median_ms": h, **ci,
                    "ceiling": ideal["ceiling"], "above_ceiling": above_ceiling(ci["speedup_ci95_low"], ideal["ceiling"]),
                    "ideal_speedup": idl, "ideal_speedup_bytes": bytes_ideal,
                    "realised": (speed - 1) / (idl - 1) if idl and idl > 1 else None,
                    "dense_gflops": flops["dense_flops"] / 1e9 if flops else None,
                    "harp_gflops": flops["harp_flops"] / 1e9 if flops else None})
    order = {"prefill": 0, "ttft": 1, "decode": 2, "throughput": 3}
    return sorted(out, key=lambda r: (order[r["measure"]], r["seq_len"], r["batch_size"]))


def label(measure: str, seq: int, batch: int) -> str:
    """Key of a speed-up in the summary's ``speedups``."""
    return {"prefill": f"prefill_{seq}", "ttft": "time_to_first_token", "decode": "inter_token_latency",
            "throughput": f"throughput_bs{batch}"}[measure]


def summarise_bench(plan, pair, config, machine, spd, lat, acc, cache, ppl, agree, task_info,
             serving) -> dict[str, Any]:
    import polars as pl

    from .latency import CI_METHOD

    def by(measure):
        return {str(r["seq_len"]): r for r in spd.filter(pl.col("measure") == measure).iter_rows(named=True)}

    pre, dec, ttft = by("prefill"), by("decode"), by("ttft")
    dec_row = next(iter(dec.values()), None)
    ttft_row = next(iter(ttft.values()), None)
    tps = {r["variant"]: r["tokens_per_s"] for r in lat.filter((pl.col("measure") == "decode")
                                                               & (pl.col("batch_size") == 1)).iter_rows(named=True)}
    kv = {v: c["kv_bytes_per_token"] for v, c in cache.items()}
    ci_keys = ("speedup", "speedup_ci95_low", "speedup_ci95_high", "pairs", "ceiling", "above_ceiling")
    speedups = {label(r["measure"], r["seq_len"], r["batch_size"]): {k: r[k] for k in ci_keys}
                for r in spd.iter_rows(named=True)}
    tasks = {}
    for r in acc.filter(pl.col("task") != "heldout").iter_rows(named=True):
        tasks.setdefault(r["task"], {})[r["metric"]] = {"dense": r["dense"], "harp": r["harp"], "delta": r["delta"]}
    return {
        "model": plan.model_ref, "model_digest": plan.model_digest, "engine": pair.backend,
        "layers": list(plan.layers), "alphas": list(plan.alphas), "machine": machine["cpu"], "cpu_features": machine["cpu_features"],
        "threads": machine["threads"], "repeats": config.repeats, "warmup": config.warmup,
        "speedups": speedups,
        "speedup_ci": CI_METHOD,
        "speedup_ceiling": next(iter(speedups.values()), {}).get("ceiling"),
        "above_ceiling": sorted(k for k, r in speedups.items() if r.get("above_ceiling")),
        "prefill_speedup": {k: r["speedup"] for k, r in pre.items()},
        "prefill_ideal": {k: r["ideal_speedup"] for k, r in pre.items()},
        "prefill_ms": {k: {"dense": r["dense_median_ms"], "harp": r["harp_median_ms"]} for k, r in pre.items()},
        "decode_context": config.decode_context,
        "decode_tokens": config.decode_tokens,
        "decode_speedup": dec_row["speedup"] if dec_row else None,
        "decode_ideal_flops": dec_row["ideal_speedup"] if dec_row else None,
        "decode_ideal_bytes": dec_row["ideal_speedup_bytes"] if dec_row else None,
        "ttft_speedup": ttft_row["speedup"] if ttft_row else None,
        "time_to_first_token": serving["time_to_first_token"],
        "inter_token_latency": serving["inter_token_latency"],
        "batch_sizes": [int(b) for b in config.batch_sizes],
        "throughput": serving["throughput"],
        "tokens_per_s": tps,
        "kv_bytes_per_token": kv,
        "kv_reduction": (kv["dense"] / kv["harp"]) if kv.get("harp") else None,
        "ppl": ppl, "top1_agreement": agree.get("top1_agreement"), "greedy_match": agree.get("greedy_match"),
        "tasks": tasks, "task_splits": {t: i["split"] for t, i in task_info.items()},
    }
