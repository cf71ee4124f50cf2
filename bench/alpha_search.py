"""Naive vs cached alpha search (Algorithm 1) side by side on SmolLM2-135M.

    python bench/alpha_search.py [--layers 8] [--tokens 2048] [--seq-len 512]

Both searches run in this process on the same windows; the last stdout line is one JSON object
with naive_seconds, cached_seconds, speedup and identical (same alphas and perplexities within a
relative 1e-5). Target: speedup >= 2.5 at P=8."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)

    import torch

    from calib.search import search_alphas
    from harp_trt.data import load_corpus, token_windows
    from harp_trt.models import load_model, load_tokenizer, resolve_model
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(args.workdir)
    resolved = resolve_model(args.model, store.root)
    corpus = load_corpus("wiki", store.root)
    windows = token_windows(load_tokenizer(resolved.folder), corpus, "calib", args.seq_len, args.tokens)
    n_layers = load_model(resolved)[0].config.num_hidden_layers
    layers = list(range(n_layers - args.layers, n_layers))
    results = {}
    for mode in ("cached", "naive"):
        model, family = load_model(resolved)
        res = search_alphas(model, family, windows, layers, naive=(mode == "naive"))
        results[mode] = res
        print(f"{mode:>6}: {res.seconds:8.1f} s  alphas={[res.alphas[l] for l in layers]} "
              f"ppl={res.ppl_searched:.4f}", file=sys.stderr)
    c, n = results["cached"], results["naive"]
    identical = c.alphas == n.alphas and all(
        abs(x["ppl"] / y["ppl"] - 1) < 1e-5 for x, y in zip(c.trace, n.trace))
    out = {"model": args.model, "layers": layers, "tokens": int(windows.numel()), "seq_len": args.seq_len,
           "threads": torch.get_num_threads(), "naive_seconds": round(n.seconds, 3),
           "cached_seconds": round(c.seconds, 3), "speedup": round(n.seconds / c.seconds, 3),
           "identical": identical, "alphas": [c.alphas[l] for l in layers],
           "ppl_searched": c.ppl_searched}
    print(json.dumps(out))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
