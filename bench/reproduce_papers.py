"""Reproduction tables for the three papers on one model: every strategy's layers and held-out
perplexity at alpha = 1 (HARP unscaled), searched (HARP, Algorithm 1) and alpha = 0 (the sublayer
removed, as Gate-Norm and the sink paper do), the HARP paper's Bottom-P ablation included; then
lm-eval accuracy of the dense model and of chosen searched plans, with standard errors.

    python bench/reproduce_papers.py [--model smollm2-135m] [--ps 2,4] [--tokens 2048]
        [--strategies top,bottom,gate-norm,gate-norm-folded,sink,bi,attn-sim]   (name@P: only at that P)
        [--eval-p 4] [--eval-strategies top,bottom,gate-norm,sink] [--tasks hellaswag,piqa,arc_easy,winogrande]
        [--limit 1000]

Every calibration is a cached artifact (rerunning is cheap). Markdown tables go to stderr; the last
stdout line is one JSON object with every row."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time


def _calibrate_rows(args, store, resolved) -> list[dict]:
    from harp_trt.calib import run_calibrate
    from harp_trt.calib.config import CalibrateConfig
    from harp_trt.plan import Plan

    rows = []
    runs = []  # "name" runs at every P, "name@2" only at P = 2
    for p in (int(x) for x in args.ps.split(",")):
        for entry in (s for s in args.strategies.split(",") if s):
            name, _, only = entry.partition("@")
            if not only or int(only) == p:
                runs.append((p, name))
    for p, strategy in runs:
        t = time.perf_counter()
        cfg = CalibrateConfig(layers=p, strategy=strategy, tokens=args.tokens, seq_len=args.seq_len,
                              corpus=args.corpus)
        art = run_calibrate(resolved, cfg, store)
        plan = Plan.load(art.path)
        q = plan.ppl
        rows.append({"strategy": strategy, "P": p, "layers": list(plan.layers), "alphas": list(plan.alphas),
                     "heldout_dense": q["heldout_dense"], "heldout_alpha1": q["heldout_alpha1"],
                     "heldout_searched": q["heldout_searched"], "heldout_alpha0": q["heldout_alpha0"],
                     "plan": str(art.path / "plan.json"), "seconds": round(time.perf_counter() - t, 1)})
        print(f"calibrated {strategy} P={p}: {rows[-1]['layers']} searched {q['heldout_searched']:.2f} "
              f"({rows[-1]['seconds']} s)", file=sys.stderr, flush=True)
    return rows


def _eval_rows(args, resolved, plans: dict[str, str]) -> list[dict]:
    """lm-eval on the dense model and on each plan's HARP model (PyTorch, fp32, CPU)."""
    from harp_trt.bench._plan_accuracy import plan_accuracy

    return plan_accuracy(resolved, plans, [t for t in args.tasks.split(",") if t], args.limit, args.workdir_root)


def _markdown(calib: list[dict], evals: list[dict]) -> None:
    out = sys.stderr
    print("\n| P | strategy | pruned layers | searched alphas | held-out PPL dense | alpha = 1 | searched | alpha = 0 |",
          file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for r in calib:
        print(f"| {r['P']} | `{r['strategy']}` | {', '.join(map(str, r['layers']))} | "
              f"{', '.join(f'{a:g}' for a in r['alphas'])} | {r['heldout_dense']:.2f} | {r['heldout_alpha1']:.2f} | "
              f"{r['heldout_searched']:.2f} | {r['heldout_alpha0']:.2f} |", file=out)
    if not evals:
        return
    dense = {(e["task"], e["metric"]): e for e in evals if e["variant"] == "dense"}
    print("\n| variant | task | metric | n | value ± s.e. | minus dense | |diff| > 2 s.e. of the difference |",
          file=out)
    print("|---|---|---|---|---|---|---|", file=out)
    for e in evals:
        if e["stderr"] is None:  # lm-eval's bookkeeping rows (sample_len)
            continue
        d = dense.get((e["task"], e["metric"]))
        diff = sig = ""
        if d is not None and e["variant"] != "dense":
            se = math.sqrt((e["stderr"] or 0) ** 2 + (d["stderr"] or 0) ** 2)
            diff = f"{e['value'] - d['value']:+.4f}"
            sig = "yes" if se and abs(e["value"] - d["value"]) > 2 * se else "no"
        print(f"| {e['variant']} | {e['task']} | {e['metric']} | {e['n']} | {e['value']:.4f} ± {e['stderr'] or 0:.4f} "
              f"| {diff} | {sig} |", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ps", default="2,4")
    ap.add_argument("--strategies", default="top,bottom,gate-norm,gate-norm-folded,sink,bi,attn-sim")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--corpus", default="wiki")
    ap.add_argument("--eval-p", type=int, default=4)
    ap.add_argument("--eval-strategies", default="top,bottom,gate-norm,sink")
    ap.add_argument("--tasks", default="hellaswag,piqa,arc_easy,winogrande")
    ap.add_argument("--limit", type=int, default=1000, help="examples per task (lm-eval --limit)")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    from harp_trt.models import resolve_model
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(args.workdir)
    args.workdir_root = store.root
    resolved = resolve_model(args.model, store.root)
    t0 = time.perf_counter()
    calib = _calibrate_rows(args, store, resolved)
    wanted = [s for s in args.eval_strategies.split(",") if s]
    plans = {f"{r['strategy']} P={r['P']}": r["plan"] for r in calib if r["P"] == args.eval_p and r["strategy"] in wanted}
    evals = _eval_rows(args, resolved, plans) if args.tasks else []
    _markdown(calib, evals)
    print(json.dumps({"model": args.model, "tokens": args.tokens, "seq_len": args.seq_len, "limit": args.limit,
                      "seconds": round(time.perf_counter() - t0, 1), "calibration": calib, "lm_eval": evals}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
