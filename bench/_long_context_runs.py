"""Run-to-run statistics of ``bench/long_context.py``: ``--runs N`` starts N independent
processes of the same measurement, each writing its own JSON, and ``summarize`` reduces them.

One run's interval covers that run's repeat-to-repeat noise only; two runs of the same point once
gave 1.286 [1.231, 1.359] and 1.361 [1.356, 1.366], disjoint. So a headline figure is the **median of
the runs' speed-ups** with their spread (min, max), and a claim holds only if it holds **in every
run**: "the lower bound is above 1" (``lower_above_1_every_run``), "at least 90 % of the ideal"
(``fraction_ge_0_9_every_run``). A run whose interval lies wholly above the ceiling L/(L-P) is named
in ``above_ceiling_runs``: a measurement to investigate, never a gain."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["run_processes", "summarize", "point_summary", "CLAIM_FRACTION"]

CLAIM_FRACTION = 0.9   # "at least this share of the ideal speed-up", the bar


SETTLE_S = 150        # the longest wait for the load average to fall before a run


def settle(quiet: float, most_s: float = SETTLE_S) -> float:
    """Wait until the 1-minute load average is at most ``quiet`` (the engine builds' and the previous
    run's threads decay from it in about a minute and a half), at most ``most_s``; seconds waited."""
    t = time.perf_counter()
    while os.getloadavg()[0] > quiet and time.perf_counter() - t < most_s:
        time.sleep(5)
    return time.perf_counter() - t


def run_processes(script: Path, argv: list[str], runs: int, out_dir: Path, quiet: float = 0.5,
                  settle_s: float = SETTLE_S) -> list[dict[str, Any]]:
    """``runs`` processes of ``script argv --runs 1 --out out_dir/runK``, one after another (stderr
    passes through), each after ``settle(quiet, settle_s)``; each run's JSON. A failed run stops the
    measurement (HarpError)."""
    from harp_trt.errors import HarpError

    results = []
    for k in range(1, runs + 1):
        settle(quiet, settle_s)
        folder = out_dir / f"run{k}"
        cmd = [sys.executable, str(script), *argv, "--runs", "1", "--out", str(folder)]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
        if done.returncode:
            raise HarpError(f"long-context run {k} of {runs} exited with {done.returncode}: {' '.join(cmd)}")
        results.append(json.loads((folder / "long_context.json").read_text()))
    return results


def point_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One measured point (a decode context x batch, or a prefill length) across runs: each row
    carries ``speedup`` (``paired_speedup``), ``ideal`` and ``ceiling``."""
    sp = [r["speedup"]["speedup"] for r in rows]
    lo = [r["speedup"]["speedup_ci95_low"] for r in rows]
    hi = [r["speedup"]["speedup_ci95_high"] for r in rows]
    ideal, ceiling = rows[0]["ideal"]["ideal"], rows[0]["ceiling"]
    frac = [s / ideal for s in sp]
    med = statistics.median(sp)
    return {"runs": len(rows), "speedup_median": med, "speedup_min": min(sp), "speedup_max": max(sp),
            "per_run": [{"speedup": s, "ci95_low": a, "ci95_high": b} for s, a, b in zip(sp, lo, hi)],
            "ideal": ideal, "pruned_form": rows[0]["ideal"].get("pruned_form", "vo"), "ceiling": ceiling,
            "fraction_median": statistics.median(frac), "fraction_min": min(frac),
            "lower_above_1_every_run": all(a is not None and a > 1 for a in lo),
            "fraction_ge_0_9_every_run": all(f >= CLAIM_FRACTION for f in frac),
            "above_ceiling_runs": [k + 1 for k, r in enumerate(rows) if r.get("above_ceiling")],
            "median_above_ceiling": med > ceiling * (1 + 1e-9)}


def _decode(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {"context": rows[0]["context"], "batch": rows[0]["batch"], **point_summary(rows)}
    out["tokens_per_s_median"] = {e: statistics.median(r["per_engine"][e]["tokens_per_s"] for r in rows)
                                  for e in rows[0]["per_engine"]}
    out["itl_p50_ms_median"] = {e: statistics.median(r["per_engine"][e]["itl"]["p50"] for r in rows)
                                for e in rows[0]["per_engine"]}
    out["peer_ratio_median"] = {p: statistics.median(r["peer_ratio"][p]["speedup"] for r in rows)
                                for p in rows[0].get("peer_ratio", {})}
    return out


def _prefill(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {"seq_len": rows[0]["seq_len"], **point_summary(rows)}
    out["seconds_median"] = {e: statistics.median(r["per_engine"][e]["seconds"] for r in rows)
                             for e in rows[0]["per_engine"]}
    return out


def _same_points(runs: list[dict[str, Any]], runtime: str, kind: str, key) -> list[list[dict[str, Any]]]:
    first = [key(m) for m in runs[0]["runtimes"][runtime][kind]]
    for r in runs[1:]:
        if [key(m) for m in r["runtimes"][runtime][kind]] != first:
            raise ValueError(f"{runtime} {kind}: the runs measured different points")
    return [[r["runtimes"][runtime][kind][i] for r in runs] for i in range(len(first))]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per runtime: every decode point and prefill length across the runs (``point_summary``), and
    each run's capacity figures side by side."""
    if not runs:
        raise ValueError("no runs to summarize")
    out: dict[str, Any] = {"runs": len(runs), "claim_fraction": CLAIM_FRACTION, "runtimes": {}}
    for rt in runs[0]["runtimes"]:
        s: dict[str, Any] = {
            "decode": [_decode(rows) for rows in _same_points(runs, rt, "decode", lambda m: (m["context"], m["batch"]))],
            "prefill": [_prefill(rows) for rows in _same_points(runs, rt, "prefill", lambda m: m["seq_len"])]}
        for name in ("kv_capacity", "capacity_under_cap"):
            per_run = [r["runtimes"][rt].get(name) for r in runs]
            if any(per_run):
                s[name] = {"ratio_per_run": [c.get("ratio") if c else None for c in per_run]}
                ratios = [x for x in s[name]["ratio_per_run"] if x is not None]
                if ratios:
                    s[name]["ratio_median"] = statistics.median(ratios)
        out["runtimes"][rt] = s
    return out
