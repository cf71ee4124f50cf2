"""Calibration results table: held-out perplexity dense / alpha=1 / searched for several P with
`top`, and the other strategies at one P, all on the same model, corpus and budget.

    python bench/calibration_table.py [--model smollm2-135m] [--ps 2,4,8] [--compare-p 4]
                                      [--strategies gate-norm,sink,bi,attn-sim] [--tokens 4096]

Every run is a cached calibrate artifact, so rerunning is cheap. Prints a markdown table to stderr;
the last stdout line is one JSON object with one row per (strategy, P)."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ps", default="2,4,8")
    ap.add_argument("--compare-p", type=int, default=4)
    ap.add_argument("--strategies", default="gate-norm,sink,bi,attn-sim")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    from harp_trt.calib import run_calibrate
    from harp_trt.calib.config import CalibrateConfig
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(args.workdir)
    runs = [("top", int(p)) for p in args.ps.split(",")]
    runs += [(s, args.compare_p) for s in args.strategies.split(",") if s]
    rows = []
    for strategy, p in runs:
        cfg = CalibrateConfig(layers=p, strategy=strategy, tokens=args.tokens, seq_len=args.seq_len)
        art = run_calibrate(args.model, cfg, store)
        plan = Plan.load(art.path)
        q = plan.ppl
        rows.append({"strategy": strategy, "P": p, "layers": list(plan.layers), "alphas": list(plan.alphas),
                     "heldout_dense": q["heldout_dense"], "heldout_alpha1": q["heldout_alpha1"],
                     "heldout_searched": q["heldout_searched"], "calib_searched": q["searched"],
                     "search_seconds": plan.extra["timings"]["search"], "artifact": art.key})
        print(f"done {strategy} P={p}: {q['heldout_searched']:.3f}", file=sys.stderr, flush=True)
    print("| strategy | P | pruned layers | alphas | held-out PPL dense | alpha=1 | searched |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['strategy']} | {r['P']} | {r['layers']} | {r['alphas']} | {r['heldout_dense']:.2f} | "
              f"{r['heldout_alpha1']:.2f} | {r['heldout_searched']:.2f} |", file=sys.stderr)
    print(json.dumps({"model": args.model, "tokens": args.tokens, "seq_len": args.seq_len, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
