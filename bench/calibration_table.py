"""Calibration results table: held-out perplexity dense / alpha=1 / searched for several P with
`top`, the other strategies at one P, and with ``--replacements`` the fitted maps
(``calibrate --replacement rrr | lmmse``, each with every ``--fit-inputs``) beside HARP's searched
alpha, on the corpus's held-out half and, with ``--other-corpus``, on the held-out half of a second
text. A fitted plan's row carries its perplexities on the three texts (fit: the search's, select:
the map-or-alpha choice's, held-out), so an in-sample win reads as one.

    python bench/calibration_table.py [--model smollm2-135m] [--ps 2,4,8] [--compare-p 4]
                                      [--strategies gate-norm,sink,bi,attn-sim] [--tokens 4096]
                                      [--replacements harp,rrr,lmmse] [--fit-inputs sequential,dense]
                                      [--recover none,maps]
                                      [--other-corpus c4] [--eval-ps 4,8 --tasks T1,T2 --limit N]
                                      [--out F.json]

``--recover``: each plan without and with end-to-end recovery (``calibrate --recover maps``,
``calib/recover.py``); a recovered plan's row keeps its layer-wise perplexities beside
(``*_layerwise``) and the recovery's record (steps, tokens, seconds, peak RSS, select-text KL).

``--eval-ps``: lm-eval accuracy (``--tasks``, ``--limit`` documents each) of the dense model and of
every plan at those P (PyTorch fp32, fitted maps installed). ``--eval-from F.json``: the same for the
plans of an earlier run's JSON (its artifacts in the cache), without calibrating again.

Every run is a cached calibrate artifact, so rerunning is cheap. Prints a markdown table to stderr;
the last stdout line is one JSON object with one row per (strategy, P, replacement)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _other(plan, art, args, store, resolved) -> dict:
    """Perplexities on the held-out half of ``--other-corpus`` (a text the search never read)."""
    from harp_trt.evaluate import plan_perplexities
    from harp_trt.data import load_corpus, token_windows
    from harp_trt.device import resolve_placement
    from harp_trt.models import load_tokenizer

    corpus = load_corpus(args.other_corpus, store.root)
    windows = token_windows(load_tokenizer(resolved.folder), corpus, "heldout", args.seq_len, args.tokens)
    return {"corpus": corpus.name, "tokens": int(windows.numel()),
            **plan_perplexities(plan, resolved.folder, windows, resolve_placement("cpu", "float32"))}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ps", default="2,4,8")
    ap.add_argument("--compare-p", type=int, default=4)
    ap.add_argument("--strategies", default="gate-norm,sink,bi,attn-sim")
    ap.add_argument("--replacements", default="harp", help="harp,rrr,lmmse: one calibrate run each (default harp)")
    ap.add_argument("--fit-inputs", default="sequential",
                    help="sequential,dense: one run of each fitted replacement per value (default sequential)")
    ap.add_argument("--recover", default="none", help="none,maps: one run of each plan per value (default none)")
    ap.add_argument("--other-corpus", default="", help="a second text's held-out half: c4 or a file (default none)")
    ap.add_argument("--eval-ps", default="", help="P values whose plans get lm-eval accuracy (default none)")
    ap.add_argument("--tasks", default="lambada_openai,hellaswag,piqa,winogrande,arc_easy")
    ap.add_argument("--limit", type=int, default=500, help="documents per lm-eval task; 0 = all (default %(default)s)")
    ap.add_argument("--eval-replacements", default="harp,rrr,lmmse",
                    help="which plans at --eval-ps get lm-eval accuracy (default %(default)s)")
    ap.add_argument("--eval-no-dense", action="store_true",
                    help="leave the dense model out of lm-eval (an earlier JSON with the same --tasks/--limit has it)")
    ap.add_argument("--eval-from", default="", help="an earlier run's JSON: only add lm-eval accuracy of its plans")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    from harp_trt.calib import run_calibrate
    from harp_trt.calib.config import CalibrateConfig
    from harp_trt.models import resolve_model
    from harp_trt.plan import Plan
    from harp_trt.store import ArtifactStore
    from harp_trt.memory import peak_rss_bytes
    from harp_trt.versions import provenance

    store = ArtifactStore(args.workdir)
    if args.eval_from:
        return _eval_from(args, store, argv)
    runs = [("top", int(p)) for p in args.ps.split(",")]
    runs += [(s, args.compare_p) for s in args.strategies.split(",") if s]
    rows = []
    variants = [(rep, fi, rec) for rep in args.replacements.split(",")
                for fi in (["sequential"] if rep == "harp" else args.fit_inputs.split(","))
                for rec in args.recover.split(",")]
    for strategy, p in runs:
        for rep, fit_inputs, recover in variants:
            cfg = CalibrateConfig(layers=p, strategy=strategy, tokens=args.tokens, seq_len=args.seq_len,
                                  replacement=rep, fit_inputs=fit_inputs, recover=recover)
            t = time.perf_counter()
            art = run_calibrate(args.model, cfg, store)
            plan = Plan.load(art.path)
            q = plan.ppl
            row = {"strategy": strategy, "P": p, "replacement": rep, "recover": recover, "layers": list(plan.layers),
                   "fit_inputs": fit_inputs if rep != "harp" else None,
                   "calib_dense": q["dense"], "select_dense": q.get("select_dense"),
                   "select_searched": q.get("select_searched"),
                   "alphas": list(plan.alphas), "fitted_layers": list(plan.fitted_layers),
                   "heldout_dense": q["heldout_dense"], "heldout_alpha1": q["heldout_alpha1"],
                   "heldout_searched": q["heldout_searched"], "calib_searched": q["searched"],
                   "search_seconds": plan.extra["timings"]["search"], "fit_seconds": plan.extra["timings"].get("fit"),
                   "replacement_record": plan.extra.get("replacement"), "artifact": art.key,
                   "recovery": plan.extra.get("recovery"),
                   "layerwise": {k[: -len("_layerwise")]: v for k, v in q.items() if k.endswith("_layerwise")},
                   "plan": str(art.path / "plan.json"),
                   "cached": art.cached, "seconds": round(time.perf_counter() - t, 1)}
            if args.other_corpus:
                row["other"] = _other(plan, art, args, store, resolve_model(args.model, store.root))
            rows.append(row)
            print(f"done {strategy} P={p} {rep} {fit_inputs} recover={recover}: {q['heldout_searched']:.3f}", file=sys.stderr, flush=True)
    print("| strategy | P | replacement | pruned layers | alphas | fitted | held-out PPL dense | alpha=1 | searched |",
          file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    for r in rows:
        print(f"| {r['strategy']} | {r['P']} | {r['replacement']} | {r['layers']} | {r['alphas']} | {r['fitted_layers']} "
              f"| {r['heldout_dense']:.2f} | {r['heldout_alpha1']:.2f} | {r['heldout_searched']:.2f} |", file=sys.stderr)
    accuracy = _accuracy(args, store, rows) if args.eval_ps else []
    out = {"provenance": provenance(sys.argv[1:] if argv is None else list(argv)), "model": args.model,
           "tokens": args.tokens, "seq_len": args.seq_len, "other_corpus": args.other_corpus,
           "rows": rows, "lm_eval": accuracy, "lm_eval_limit": args.limit if args.eval_ps else None,
           "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
    return 0


def _accuracy(args, store, rows: list[dict]) -> list[dict]:
    """lm-eval rows of the dense model and of the ``top`` plans at ``--eval-ps``."""
    from harp_trt.bench._plan_accuracy import plan_accuracy
    from harp_trt.models import resolve_model

    eval_ps = {int(x) for x in args.eval_ps.split(",")}
    plans = {}
    for r in rows:
        if r["P"] in eval_ps and r["strategy"] == "top" and r["replacement"] in args.eval_replacements.split(","):
            extra = f" {r['fit_inputs']}" if r.get("fit_inputs") not in (None, "sequential") else ""
            extra += " recovered" if r.get("recover", "none") != "none" else ""
            plans[f"{r['replacement']} P={r['P']}{extra}"] = r.get("plan") or str(store.root / r["artifact"] / "plan.json")
    return plan_accuracy(resolve_model(args.model, store.root), plans, [t for t in args.tasks.split(",") if t],
                         args.limit or None, store.root, dense=not args.eval_no_dense)


def _eval_from(args, store, argv) -> int:
    """``--eval-from``: the earlier JSON with ``lm_eval`` added (its calibration rows unchanged)."""
    from harp_trt.memory import peak_rss_bytes
    from harp_trt.versions import provenance

    d = json.loads(Path(args.eval_from).read_text())
    args.model = d["model"]
    d["lm_eval"] = _accuracy(args, store, d["rows"])
    d["lm_eval_limit"] = args.limit
    d["lm_eval_provenance"] = provenance(sys.argv[1:] if argv is None else list(argv))
    d["lm_eval_peak_rss_mb"] = round(peak_rss_bytes() / 2**20, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(d, indent=2) + "\n")
    print(json.dumps(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
