"""Dense vs HARP prefill latency on one CUDA GPU at the paper's model sizes (random bf16 weights).

    python bench/gpu_prefill.py --out results/ [--model llama3.1-8b|qwen2-7b] [--layers 8]
    python bench/gpu_prefill.py --dry-run --out /tmp/x        # tiny shapes, runs on CPU too
    python bench/gpu_prefill.py --engine genai --out results/ # onnxruntime-genai (CUDA) or llamacpp

Builds a model with Llama-3.1-8B's (or Qwen2-7B's) shapes directly on the GPU with random bf16
weights (latency does not depend on the values), deep-copies it and prunes the top ``--layers``
layers of the copy with ``harp_trt.harp.apply_harp``. Prefill of 1024..65536 tokens runs with the
fastest attention PyTorch has there (FlashAttention-2 when ``flash_attn`` is installed, else sdpa
restricted to its flash / memory-efficient kernels), dense and HARP interleaved, ``--repeats``
timed runs after warm-up, reported as mean with a 95 % confidence interval (Student t) and median.
Decode: the KV cache is filled with random tensors (no prefill needed) at ``--decode-context``
tokens for the largest batch that fits in free GPU memory for each model — the smaller HARP cache
fits more sequences — and tokens/s is timed over ``--decode-steps`` steps, plus both models at the
dense model's batch for a like-for-like figure.

Writes ``gpu_prefill.csv``, ``gpu_decode.csv`` and ``gpu_prefill.png`` to ``--out``; the last stdout
line is one JSON object. Paper (H100, Llama-3.1-8B, P=8, 65536 tokens): 5.4466 s dense vs 4.5394 s
pruned. Without a GPU (and without ``--dry-run``) it refuses with exit 2. ``--engine genai|llamacpp``
writes the same files from onnxruntime-genai's CUDA provider or llama.cpp with every layer on the
GPU (decode at batch 1; ``bench/_gpu_engines.py``), and refuses where that runtime is missing."""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harp_trt.bench._gpu_common import device_or_refuse, run_main  # noqa: E402  (after the path above)
from harp_trt.bench._gpu_engines import add_engine_options, engine_figures, engine_info  # noqa: E402
from harp_trt.bench._gpu_torch import build_models, max_batch, time_decode, time_prefill  # noqa: E402
from harp_trt.bench._shapes import DRY_RUN, GPU_MODELS, SHAPES  # noqa: E402

DEFAULT_SEQ_LENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
DRY_SEQ_LENS = (16, 32, 64)
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=GPU_MODELS)
    ap.add_argument("--layers", type=int, default=8, help="top layers pruned by HARP (default %(default)s)")
    ap.add_argument("--seq-lens", default=None, help=f"comma-separated (default {','.join(map(str, DEFAULT_SEQ_LENS))})")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--decode-context", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=512, help="cap on the decode batch")
    ap.add_argument("--memory-fraction", type=float, default=0.85, help="share of free memory the KV cache may use")
    ap.add_argument("--out", required=True, help="folder for the CSV and PNG files")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, any device (CPU included)")
    add_engine_options(ap, "the prefill and decode timings")
    args = ap.parse_args(argv)
    try:
        lens = tuple(int(x) for x in args.seq_lens.split(",") if x.strip()) if args.seq_lens else None
    except ValueError:
        ap.error(f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}")
    args.seq_lens = lens or (DRY_SEQ_LENS if args.dry_run else DEFAULT_SEQ_LENS)
    if args.dry_run:
        args.shape = DRY_RUN
        args.layers = min(args.layers, 2)
        args.decode_context = min(args.decode_context, 32)
        args.max_batch = min(args.max_batch, 8)
    else:
        args.shape = args.model
    if args.repeats < 2:
        ap.error("--repeats must be >= 2 (a confidence interval needs two samples)")
    n = SHAPES[args.shape]["num_hidden_layers"]
    if not 0 < args.layers < n:
        ap.error(f"--layers must lie in 1..{n - 1} for {args.shape}")
    too_long = [s for s in args.seq_lens if s > SHAPES[args.shape]["max_position_embeddings"] or s < 1]
    if too_long:
        ap.error(f"--seq-lens {too_long} outside 1..{SHAPES[args.shape]['max_position_embeddings']}")
    return args


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for v, marker in (("dense", "o"), ("harp", "s")):
        rs = sorted((r for r in rows if r["variant"] == v), key=lambda r: r["seq_len"])
        ax.errorbar([r["seq_len"] for r in rs], [r["mean_s"] for r in rs], yerr=[r["ci95_s"] for r in rs],
                    marker=marker, capsize=3, label="HARP" if v == "harp" else "dense")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill (s), mean ± 95 % CI")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _torch_figures(args, device, dtype) -> tuple[list[dict], list[dict], dict, str]:
    """(prefill rows, decode rows, decode batches, attention) of the PyTorch models."""
    import torch

    dense, harp, attn = build_models(args.shape, args.layers, device, dtype)
    models = {"dense": dense, "harp": harp}
    vocab = dense.config.vocab_size
    pre = time_prefill(models, args.seq_lens, args.repeats, args.warmup, device, vocab)
    batches = max_batch(models, args.decode_context, args.decode_steps, args.memory_fraction, args.max_batch,
                        device, torch.finfo(dtype).bits // 8)
    dec = time_decode(models, batches, args.decode_context, args.decode_steps, device, dtype, vocab)
    return pre, dec, batches, attn


def run(args) -> dict:
    import torch

    device, dtype = device_or_refuse("gpu_prefill.py", args.dry_run)
    info = engine_info(args, "gpu_prefill.py")  # refuses before anything is written
    t_start = time.perf_counter()
    pre, dec, batches, attn = engine_figures(args, info) if info else _torch_figures(args, device, dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(pre, out / "gpu_prefill.csv")
    _write_csv(dec, out / "gpu_decode.csv")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    n = SHAPES[args.shape]["num_hidden_layers"]
    plot(pre, out / "gpu_prefill.png", f"{args.shape} ({gpu}, {attn}), HARP top {args.layers}/{n} layers")
    speed = {}
    for seq in args.seq_lens:
        d = next(r for r in pre if r["variant"] == "dense" and r["seq_len"] == seq)
        h = next(r for r in pre if r["variant"] == "harp" and r["seq_len"] == seq)
        speed[str(seq)] = d["mean_s"] / h["mean_s"]
    longest = str(max(args.seq_lens))
    dmax = {r["variant"]: r for r in dec if r["kind"] != "dense_batch"}  # max_batch (torch) or engine
    return {"model": args.shape, "device": gpu, "engine": args.engine, "runtime": info, "attention": attn,
            "dtype": info["weights"] if info else str(dtype).replace("torch.", ""),
            "pruned_layers": list(range(n - args.layers, n)), "repeats": args.repeats,
            "prefill_s": {str(r["seq_len"]): {r2["variant"]: [round(r2["mean_s"], 5), round(r2["ci95_s"], 5)]
                                              for r2 in pre if r2["seq_len"] == r["seq_len"]} for r in pre},
            "prefill_speedup": {k: round(v, 4) for k, v in speed.items()},
            "headline": {"seq_len": int(longest), "speedup": round(speed[longest], 4),
                         "paper": {"seq_len": 65536, "dense_s": 5.4466, "harp_s": 4.5394,
                                   "speedup": round(5.4466 / 4.5394, 4)}},
            "decode": {"context": args.decode_context, "batch": batches,
                       "tokens_per_s": {v: round(r["tokens_per_s"], 1) for v, r in dmax.items()},
                       "throughput_gain": round(dmax["harp"]["tokens_per_s"] / dmax["dense"]["tokens_per_s"], 4)},
            "files": [str(out / f) for f in ("gpu_prefill.csv", "gpu_decode.csv", "gpu_prefill.png")],
            "seconds": round(time.perf_counter() - t_start, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_main("gpu_prefill", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
