"""Naive, cached and golden alpha search (Algorithm 1) side by side on SmolLM2-135M.

    python bench/alpha_search.py [--layers 2,4,8] [--tokens 512,2048] [--seq-len 256]

For every (P, tokens) configuration the three searches run in this process on the same windows,
one after the other (cached, golden, naive): naive recomputes the whole model per candidate,
cached reuses everything below the searched layer and batches the candidates, golden is the
cached evaluation under ``--search golden``. Per configuration: seconds, speed-ups over naive,
peak RSS, the number of evaluations golden used, whether it fell back, and whether each search
found the naive alphas (cached perplexities within 1e-5 relative). The last stdout line is one
JSON object ``{"threads", "rows": [...], "min_cached_speedup", "all_identical"}``.
Target: cached >= 4x naive at every configuration with identical alphas."""
from __future__ import annotations

import argparse
import json
import sys


def _peak_rss_gb() -> float:
    from harp_trt.memory import peak_rss_bytes  # the one reading of getrusage (KiB on Linux) into bytes

    return peak_rss_bytes() / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,4,8", help="P values, comma-separated (top P layers)")
    ap.add_argument("--tokens", default="512,2048", help="calibration token counts, comma-separated")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    import torch

    from harp_trt.calib.search import search_alphas
    from harp_trt.cli._common import parse_ints
    from harp_trt.data import load_corpus, token_windows
    from harp_trt.models import load_model, load_tokenizer, resolve_model
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(args.workdir)
    resolved = resolve_model(args.model, store.root)
    corpus = load_corpus("wiki", store.root)
    tok = load_tokenizer(resolved.folder)
    n_layers = load_model(resolved)[0].config.num_hidden_layers
    rows = []
    for tokens in parse_ints(args.tokens, "--tokens"):
        windows = token_windows(tok, corpus, "calib", args.seq_len, tokens)
        for p in parse_ints(args.layers, "--layers"):
            layers = list(range(n_layers - p, n_layers))
            res = {}
            for mode in ("cached", "golden", "naive"):
                model, family = load_model(resolved)
                res[mode] = search_alphas(model, family, windows, layers, naive=(mode == "naive"),
                                          method="golden" if mode == "golden" else "exhaustive")
                print(f"P={p} tokens={tokens} {mode:>6}: {res[mode].seconds:8.1f} s  "
                      f"alphas={[res[mode].alphas[l] for l in layers]}", file=sys.stderr)
            c, g, n = res["cached"], res["golden"], res["naive"]
            rows.append({
                "layers": p, "tokens": int(windows.numel()), "seq_len": args.seq_len,
                "naive_seconds": round(n.seconds, 2), "cached_seconds": round(c.seconds, 2),
                "golden_seconds": round(g.seconds, 2),
                "cached_speedup": round(n.seconds / c.seconds, 2), "golden_speedup": round(n.seconds / g.seconds, 2),
                "cached_identical": c.alphas == n.alphas and all(
                    abs(x["ppl"] / y["ppl"] - 1) < 1e-5 for x, y in zip(c.trace, n.trace)),
                "golden_identical": g.alphas == n.alphas,
                "golden_evaluations": sum(g.evaluations.values()), "exhaustive_evaluations": sum(n.evaluations.values()),
                "golden_fallback_layers": g.fallbacks, "alphas": [n.alphas[l] for l in layers],
                "ppl_searched": round(n.ppl_searched, 4), "peak_rss_gb": round(_peak_rss_gb(), 2)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {"model": args.model, "threads": torch.get_num_threads(), "rows": rows,
           "min_cached_speedup": min(r["cached_speedup"] for r in rows),
           "all_identical": all(r["cached_identical"] for r in rows)}
    print(json.dumps(out))
    return 0 if out["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
