"""One command for a GPU host: the alpha search, prefill and decode of an 8B-shaped model.

    python bench/gpu_check.py [--model llama3.1-8b|qwen2-7b] [--budget-s 280]
    python bench/gpu_check.py --dry-run            # tiny shapes, CPU: the same code path
    python bench/gpu_check.py --engine llamacpp    # prefill/decode on llama.cpp (or genai), see below

Builds a model with Llama-3.1-8B's shapes directly on the GPU (random bf16 weights: time and memory
depend on shapes only) and reports, as one JSON object on the last stdout line:

* ``alpha_search``: Algorithm 1 with P = 8 (the top 8 layers) over the 11-value grid
  {0, 0.1, ..., 1} on 32k calibration tokens (8 windows of 4096), cached path, in seconds
  (target: <= 120 s on one H200; the paper reports < 2 hours on an H100);
* ``naive_vs_cached``: both searches on a smaller grid (P = 2, grid {0, 0.5, 1}, 8k tokens) with the
  speed-up and whether alphas and perplexities agree;
* ``prefill``: dense vs HARP (P = 8) at 1k-64k tokens (``bench/_gpu_torch.py``'s timing, fewer
  repeats), with the paper's H100 figure for reference;
* ``decode``: tokens/s at the largest batch each model fits, and KV bytes per token;
* ``recovery``: ``calibrate --recover maps`` on the searched model, a few steps of one window each
  (two fit windows, one select window): seconds per step and peak GPU memory over the model's bytes.

``--engine genai|llamacpp`` times prefill and decode on onnxruntime-genai (CUDA) or llama.cpp (all
layers on the GPU) instead, from artifacts the pipeline builds (``bench/_gpu_engines.py``; refused,
exit 2, where the runtime or its GPU support is missing, as on the device host). A ``--dry-run``
also builds ``--model``'s real shape on the meta device (``shape_check``).

Only torch, transformers, safetensors and numpy are needed (the harp_trt core imports nothing
else) for the default ``--engine torch``. Stages are skipped, not cut short, once ``--budget-s`` is spent. Without CUDA and without
``--dry-run`` it refuses with exit 2."""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harp_trt.bench._gpu_common import device_or_refuse, run_main  # noqa: E402  (after the path above)
from harp_trt.bench._gpu_engines import add_engine_options, engine_figures, engine_info  # noqa: E402
from harp_trt.bench._gpu_torch import build_models, max_batch, sync, time_decode, time_prefill  # noqa: E402
from harp_trt.bench._shapes import DRY_RUN, GPU_MODELS  # noqa: E402

GRID = tuple(round(0.1 * i, 1) for i in range(11))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=GPU_MODELS)
    ap.add_argument("--layers", type=int, default=8, help="P for the full search and prefill (default %(default)s)")
    ap.add_argument("--recover-steps", type=int, default=4, help="Adam steps of the recovery check (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=32768, help="calibration tokens (default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=4096, help="window length (default %(default)s)")
    ap.add_argument("--seq-lens", default="1024,4096,16384,65536", help="prefill lengths")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=280.0, help="skip stages once this much time is spent")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on any device (CPU included)")
    add_engine_options(ap, "the prefill and decode stage")
    args = ap.parse_args(argv)
    try:
        args.seq_lens = tuple(int(x) for x in args.seq_lens.split(",") if x.strip())
    except ValueError:
        ap.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    if args.dry_run:
        args.shape, args.layers, args.tokens, args.seq_len, args.seq_lens = DRY_RUN, 2, 64, 16, (16, 32)
    else:
        args.shape = args.model
    if args.tokens < args.seq_len:
        ap.error("--tokens must hold at least one window of --seq-len")
    return args


def search_figures(model, family, windows, layers, grid, naive: bool) -> dict:
    import copy

    from harp_trt.calib.search import search_alphas

    m = copy.deepcopy(model) if naive else model
    t0 = time.perf_counter()
    res = search_alphas(m, family, windows, layers, grid, naive=naive)
    sync(next(m.parameters()).device)
    seconds = time.perf_counter() - t0
    if naive:
        del m
    return {"seconds": round(seconds, 2), "alphas": [res.alphas[l] for l in sorted(res.alphas)],
            "ppl_alpha1": res.ppl_alpha1, "ppl_searched": res.ppl_searched}


def naive_vs_cached(dense, family, small) -> dict:
    """The naive and the cached search on the top two layers over a three-point grid: their
    seconds, speed-up and whether they agree (same alphas, perplexity relative difference)."""
    import copy

    n = dense.config.num_hidden_layers
    top2 = list(range(n - 2, n))
    naive = search_figures(dense, family, small, top2, (0.0, 0.5, 1.0), naive=True)
    cached_model = copy.deepcopy(dense)
    cached = search_figures(cached_model, family, small, top2, (0.0, 0.5, 1.0), naive=False)
    del cached_model
    return {"layers": top2, "grid": [0.0, 0.5, 1.0], "tokens": int(small.numel()),
            "naive_s": naive["seconds"], "cached_s": cached["seconds"],
            "speedup": round(naive["seconds"] / max(cached["seconds"], 1e-9), 2),
            "identical_alphas": naive["alphas"] == cached["alphas"],
            "ppl_rel_diff": abs(naive["ppl_searched"] / cached["ppl_searched"] - 1)}


def dense_states(dense, family, windows, layers) -> tuple:
    """Recovery's teacher (``calib/recover.py``): the dense model's states on two windows (fit) and
    one more (select), entering the lowest pruned layer and at the end."""
    from harp_trt.calib.recover import dense_teacher
    from harp_trt.layerwise import LayerStack

    stack = LayerStack.wrap(dense, family)
    return dense_teacher(stack, windows[:2], min(layers)), dense_teacher(stack, windows[2:3], min(layers))


def recovery_figures(model, family, layers, teachers, steps: int) -> dict:
    """``calibrate --recover maps`` at these shapes: a few Adam steps on the searched model's pruned
    V/O (one window each, bf16 autocast on float32 master weights), seconds per step and the peak
    memory beside the model's own bytes (the calibrate stage's bound)."""
    import torch

    from harp_trt.calib.recover import RecoverySettings, recover
    from harp_trt.layerwise import LayerStack

    device = next(model.parameters()).device
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res = recover(LayerStack.wrap(model, family), layers, *teachers,
                  RecoverySettings(steps=steps, eval_every=steps, lr=1e-4))
    sync(device)
    rec = res.record
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"steps": rec["steps"], "tokens_per_step": int(teachers[0].windows.shape[1]), "seconds": rec["seconds"],
            "seconds_per_step": rec["seconds_per_step"], "select_kl_start": rec["select_kl_start"],
            "select_kl_best": rec["select_kl_best"], "kept": rec["kept"], "model_bytes": weights,
            "peak_gpu_bytes": peak, "peak_over_model": round(peak / weights, 3) if peak else None,
            "peak_rss_bytes": rec["peak_rss_bytes"]}


def shape_check(model: str, layers: int = 8) -> dict:
    """``--dry-run``: ``model``'s real shape built on the meta device (no memory) and pruned, so the
    installed transformers' config and model classes are checked at the GPU run's size."""
    import torch

    dense, harp, _ = build_models(model, layers, torch.device("meta"), torch.bfloat16)
    return {"model": model, "params": sum(p.numel() for p in dense.parameters()),
            "harp_params": sum(p.numel() for p in harp.parameters()), "layers_pruned": layers}


def _flag_ceiling(out: dict, speedups: dict, n_layers: int, pruned: int) -> None:
    """L / (L - P) beside the speed-ups (``harp_trt/flops.py``: no step gets faster than that);
    the names of any speed-up above it, a measurement bug to find."""
    from harp_trt.flops import speedup_ceiling

    out["speedup_ceiling"] = round(speedup_ceiling(n_layers, pruned), 4)
    out["above_ceiling"] = sorted(k for k, v in speedups.items() if v > out["speedup_ceiling"])


def _prefill_summary(out: dict, rows: list[dict]) -> None:
    out["prefill"] = {}
    for r in rows:
        out["prefill"].setdefault(str(r["seq_len"]), {})[r["variant"]] = [round(r["mean_s"], 5),
                                                                       round(r["ci95_s"], 5)]
    out["prefill_speedup"] = {k: round(v["dense"][0] / v["harp"][0], 4) for k, v in out["prefill"].items()
                              if "dense" in v and "harp" in v}
    out["paper_prefill"] = {"seq_len": 65536, "dense_s": 5.4466, "harp_s": 4.5394, "gpu": "H100"}


def engine_latency(out: dict, args, info: dict) -> None:
    """Prefill at ``--seq-lens`` and batch-1 decode on ``--engine`` (``bench/_gpu_engines.engine_figures``)."""
    from types import SimpleNamespace

    ctx, steps = (4096, 8) if not args.dry_run else (16, 2)
    ns = SimpleNamespace(engine=args.engine, shape=args.shape, layers=args.layers, workdir=args.workdir,
                         dry_run=args.dry_run, seq_lens=args.seq_lens, repeats=args.repeats, warmup=1,
                         decode_context=ctx, decode_steps=steps)
    pre, dec, batches, label = engine_figures(ns, info)
    _prefill_summary(out, pre)
    out["decode"] = {"context": ctx, "batch": batches, "runtime": label,
                     "tokens_per_s": {r["variant"]: round(r["tokens_per_s"], 1) for r in dec},
                     "kv_bytes_per_token": {r["variant"]: r["kv_bytes_per_token"] for r in dec}}


def latency_figures(out: dict, models: dict, args, device, dtype, vocab: int, spent) -> None:
    """Prefill per ``--seq-lens`` and decode at the largest batch that fits, dense vs HARP, into
    ``out``; what the time budget leaves out is listed in ``out["skipped"]``."""
    import torch

    rows = []
    for s in args.seq_lens:
        if spent() > args.budget_s:
            out["skipped"].append(f"prefill {s}")
            continue
        rows += time_prefill(models, [s], args.repeats, 1, device, vocab)
    _prefill_summary(out, rows)
    if spent() < args.budget_s:
        ctx, steps = (4096, 8) if not args.dry_run else (16, 2)
        batches = max_batch(models, ctx, steps, 0.8, 256, device, torch.finfo(dtype).bits // 8)
        dec = time_decode(models, batches, ctx, steps, device, dtype, vocab)
        best = {r["variant"]: r for r in dec if r["kind"] == "max_batch"}
        equal = {r["variant"]: r for r in dec if r["kind"] == "dense_batch"}
        out["decode"] = {"context": ctx, "batch": batches,
                         "tokens_per_s": {v: round(r["tokens_per_s"], 1) for v, r in best.items()},
                         "kv_bytes_per_token": {v: r["kv_bytes_per_token"] for v, r in best.items()},
                         # both at dense's batch: the per-step speed-up, which the ceiling bounds
                         "equal_batch": {"batch": batches["dense"],
                                         "tokens_per_s": {v: round(r["tokens_per_s"], 1) for v, r in equal.items()}}}
    else:
        out["skipped"].append("decode")


def run(args) -> dict:
    import torch

    from harp_trt.families import family_of

    device, dtype = device_or_refuse("gpu_check.py", args.dry_run)
    info = engine_info(args, "gpu_check.py")  # refuses before the search runs
    t_start = time.perf_counter()
    out: dict = {"model": args.shape, "engine": args.engine, "runtime": info,
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "skipped": []}
    if args.dry_run:
        out["shape_check"] = shape_check(args.model)

    def spent() -> float:
        return time.perf_counter() - t_start

    dense, harp, attn = build_models(args.shape, args.layers, device, dtype)
    del harp  # the search patches its own copy
    if device.type == "cuda":
        torch.cuda.empty_cache()
    family = family_of(dense.config)
    n = dense.config.num_hidden_layers
    vocab = dense.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(0)
    windows = torch.randint(0, vocab, (args.tokens // args.seq_len, args.seq_len), generator=g).to(device)
    out["build_s"] = round(spent(), 1)

    # naive vs cached on a small configuration (runs first: the full search patches the model)
    small = windows[: max(1, 8192 // args.seq_len)] if not args.dry_run else windows
    out["naive_vs_cached"] = naive_vs_cached(dense, family, small)

    # the full search: P layers x 11 candidates on all windows
    layers = list(range(n - args.layers, n))
    # recovery's teacher, taken before the search prunes the model (two fit windows and one select window)
    teachers = dense_states(dense, family, windows, layers) if windows.shape[0] >= 3 else None
    full = search_figures(dense, family, windows, layers, GRID, naive=False)
    out["alpha_search"] = {"layers": layers, "grid": list(GRID), "tokens": int(windows.numel()),
                           "windows": int(windows.shape[0]), "seconds": full["seconds"], "alphas": full["alphas"],
                           "ppl_alpha1": full["ppl_alpha1"], "ppl_searched": full["ppl_searched"],
                           "target_s": 120, "paper": "< 2 hours on one H100"}
    if teachers is not None and spent() < args.budget_s:
        out["recovery"] = recovery_figures(dense, family, layers, teachers, args.recover_steps)
    else:
        out["skipped"].append("recovery")
    del windows, small, teachers
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # prefill and decode: dense vs HARP at alpha = 1 on the top P layers (latency ignores alpha)
    if spent() < args.budget_s:
        del dense  # patched by the search; a fresh pair: dense, and HARP on the top P layers at alpha = 1
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if info:
            engine_latency(out, args, info)
        else:
            dense_model, harp_model, attn = build_models(args.shape, args.layers, device, dtype)
            latency_figures(out, {"dense": dense_model, "harp": harp_model}, args, device, dtype, vocab, spent)
        speedups = dict(out.get("prefill_speedup", {}))
        if "tokens_per_s" in out.get("decode", {}):
            tps = out["decode"]["tokens_per_s"]
            # at each model's own largest batch: throughput from KV capacity (bounded by the same ratio)
            out["decode"]["throughput_ratio"] = round(tps["harp"] / tps["dense"], 4)
            if "equal_batch" in out["decode"]:  # the torch engine's; a runtime engine times batch 1
                eq = out["decode"]["equal_batch"]["tokens_per_s"]
                speedups["decode_equal_batch"] = out["decode"]["equal_batch"]["speedup"] = round(
                    eq["harp"] / eq["dense"], 4)
            else:  # one batch for both: the ratio is a step's speed-up
                speedups["decode"] = out["decode"]["throughput_ratio"]
        _flag_ceiling(out, speedups, n, args.layers)
    else:
        out["skipped"] += ["prefill", "decode"]
    out["attention"] = attn
    out["seconds"] = round(spent(), 1)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_main("gpu_check", lambda: run(args),
                    default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))


if __name__ == "__main__":
    sys.exit(main())
