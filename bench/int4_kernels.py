"""Which int4 weight kernel runs a prompt's GEMMs fastest on this CPU: ONNX
Runtime's MatMulNBits at each block size and accuracy level, against fp32 MatMul and the w8a8 integer
GEMM, at a prefill's M and at decode's M = 1, one process, interleaved.

    python bench/int4_kernels.py [--shapes 576x1536,3584x18944] [--m 1,2048] [--blocks 32,64,128,256]
        [--levels 0,4] [--threads 2] [--repeats 5] [--out FILE.json]

Each repeat times every kernel once (best of 3 calls), the order rotating; a figure is the median over
repeats, and each kernel's speed-up over fp32 MatMul (the same shape and M) carries a 95 % interval
from the paired repeats (``paired_speedup``). The ceiling beside it is the GEMM's FLOPs at this run's
fastest rate for that shape and M over fp32's time, so no speed-up above it can be real. Why it
matters: a prefill's weight GEMMs are the only part an int4 engine changes (attention and the rest
run in fp32 in every engine), so an int4 engine cannot prefill faster than our fp32 engine unless one
of these kernels beats fp32 MatMul at the prompt's M. The shapes are MLP GEMMs (hidden x intermediate)
of SmolLM2-135M and Qwen2-7B. Block sizes above our engines' 32 change int4's accuracy (not measured
here). The CPU's features (``harp_trt.machine``) and peak RSS go with the figures. The last stdout line
is the JSON object (also written to ``--out``)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harp_trt.bench._gemm_peak import best_seconds, gemm_session  # noqa: E402
from harp_trt.bench.stage.latency import paired_speedup, rotation  # noqa: E402
from harp_trt.config import parse_ints  # noqa: E402
from harp_trt.machine import describe  # noqa: E402

__all__ = ["main", "kernels"]

PACKAGES = ("onnxruntime",)
REFERENCE = "fp32"


def kernels(blocks: list[int], levels: list[int]) -> dict[str, dict[str, Any]]:
    """name -> gemm_session arguments: fp32 MatMul, every int4 (block, level), the w8a8 GEMM."""
    out: dict[str, dict[str, Any]] = {REFERENCE: {"quant": "none"}}
    for b in blocks:
        for lvl in levels:
            out[f"int4_b{b}_acc{lvl}"] = {"quant": "int4", "block": b, "accuracy_level": lvl}
    out["w8a8"] = {"quant": "w8a8"}
    return out


def measure(k: int, n: int, m: int, table: dict[str, dict[str, Any]], threads: int, repeats: int) -> dict[str, Any]:
    sessions = {name: gemm_session(m, k, n, threads=threads, **kw) for name, kw in table.items()}
    names = list(sessions)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in rotation(names, r):
            times[name].append(best_seconds(*sessions[name]))
    flops = 2 * m * k * n
    fastest = min(min(t) for t in times.values())
    ref = times[REFERENCE]
    rows = {}
    for name in names:
        med = statistics.median(times[name])
        sp = paired_speedup(ref, times[name])
        rows[name] = {"seconds": med, "gflops": round(flops / med / 1e9, 1),
                      "speedup_vs_fp32": round(sp["speedup"], 3), "ci95": [round(sp["speedup_ci95_low"], 3),
                                                                       round(sp["speedup_ci95_high"], 3)],
                      "ceiling": round(statistics.median(ref) / fastest, 2), **table[name]}
    best_int4 = max((r for nm, r in rows.items() if nm.startswith("int4")), key=lambda r: r["speedup_vs_fp32"])
    return {"k": k, "n": n, "m": m, "flops": flops, "kernels": rows,
            "best_int4": {"block": best_int4["block"], "accuracy_level": best_int4["accuracy_level"],
                          "speedup_vs_fp32": best_int4["speedup_vs_fp32"], "ci95": best_int4["ci95"]}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="576x1536,3584x18944", help="K x N of each GEMM (hidden x intermediate)")
    p.add_argument("--m", default="1,2048", help="rows (tokens) of each GEMM")
    p.add_argument("--blocks", default="32,64,128,256")
    p.add_argument("--levels", default="0,4", help="MatMulNBits accuracy levels")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    from harp_trt.memory import peak_rss_bytes
    from harp_trt.versions import provenance

    table = kernels(parse_ints(args.blocks, "--blocks", positive=True), parse_ints(args.levels, "--levels"))
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    out: dict[str, Any] = {
        "issue": 36, "provenance": provenance(sys.argv[1:] if argv is None else argv, PACKAGES),
        "machine": {**describe(args.threads), "load_avg_start": list(os.getloadavg())},
        "threads": args.threads, "repeats": args.repeats, "reference": REFERENCE, "gemms": []}
    for k, n in shapes:
        for m in parse_ints(args.m, "--m", positive=True):
            out["gemms"].append(measure(k, n, m, table, args.threads, args.repeats))
            print(f"{k}x{n} M={m}: best int4 {out['gemms'][-1]['best_int4']}", file=sys.stderr, flush=True)
    out["machine"]["load_avg_end"] = list(os.getloadavg())
    out["peak_rss_gb"] = round(peak_rss_bytes() / 1e9, 2)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    sys.stdout.write(json.dumps(out) + "\n")
    return out


if __name__ == "__main__":
    main()
