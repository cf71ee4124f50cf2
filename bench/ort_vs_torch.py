"""ORT engine vs PyTorch on one model, side by side in one process (default SmolLM2-135M, fp32).

Measures prefill at 512 and 2048 tokens (full logits and KV on both sides: the same work) and
decode ms/token (``--decode-steps`` greedy steps after a ``--prompt``-token prefill), for the ORT
engine built by ``harp_trt.builders.ort`` and the Hugging Face model (sdpa). Both use ``--threads`` threads.
Runs are interleaved (ORT, PyTorch, PyTorch, ORT, ...) after a warm-up, so load from other
processes hits both sides alike; each figure is the median of ``--repeats``.

    python bench/ort_vs_torch.py [--model smollm2-135m] [--threads 2] [--repeats 5] [--json]

The last stdout line is one JSON object: ``ratio_prefill_512``, ``ratio_prefill_2048``,
``ratio_decode`` (ORT time / PyTorch time, <= 1 means ORT is at least as fast) and the raw times."""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from harp_trt.bench._torch_side import TorchSide

log = logging.getLogger("harp_trt.bench.ort_vs_torch")


def build_engine(model_ref: str, workdir: str | None, threads: int, attention: str):
    from harp_trt.builders.ort.builder import OrtBuildStage
    from harp_trt.builders.ort.config import OrtBuildConfig
    from harp_trt.models import resolve_model
    from harp_trt.export.config import ExportConfig
    from harp_trt.export.export import ExportStage
    from harp_trt.store import ArtifactStore

    store = ArtifactStore(workdir)
    resolved = resolve_model(model_ref, store.root)
    export = ExportStage().execute(store, ExportConfig(), {"model": resolved})
    engine = OrtBuildStage().execute(store, OrtBuildConfig(attention=attention, intra_op_threads=threads),
                                     {"onnx": export})
    return resolved, export, engine


class OrtSide:
    def __init__(self, engine_dir: Path, threads: int):
        from harp_trt.ort_session import OrtCausalLM

        self.lm = OrtCausalLM.from_engine(engine_dir, providers=["CPUExecutionProvider"], intra_op_threads=threads)

    def prefill(self, ids: np.ndarray):
        b, s = ids.shape
        return self.lm.forward(ids, np.ones((b, s), np.int64), np.arange(s)[None].repeat(b, 0))

    def decode(self, ids: np.ndarray, steps: int) -> list[float]:
        """Per-step seconds of the runtime's decode: in place through a ``StaticCache`` on a
        GroupQueryAttention engine (as ``OrtCausalLM.generate``), else a growing past."""
        b, s = ids.shape
        mask = np.ones((b, s), np.int64)
        logits, past = self.lm.forward(ids, mask, np.arange(s)[None].repeat(b, 0))
        cache = self.lm.static_cache(past, s + steps) if self.lm.shares_kv_buffer else None
        times = []
        for i in range(steps):
            tok = logits[:, -1].argmax(-1)[:, None]
            mask = np.concatenate([mask, np.ones((b, 1), np.int64)], 1)
            pos = np.full((b, 1), s + i)
            t0 = time.perf_counter()
            if cache is not None:
                logits = self.lm.decode_step(cache, tok, mask, pos)
            else:
                logits, past = self.lm.forward(tok, mask, pos, past)
            times.append(time.perf_counter() - t0)
        return times


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workdir", default=None, help="artifact cache (default ~/.cache/harp-trt)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prefill", default="512,2048", help="comma-separated prefill lengths")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens before the timed decode steps")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--attention", default="gqa", choices=["gqa", "onnx"], help="ORT engine attention form")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")

    resolved, export, engine = build_engine(args.model, args.workdir, args.threads, args.attention)
    ort_side = OrtSide(engine.path, args.threads)
    torch_side = TorchSide(resolved, args.threads)
    vocab = int(ort_side.lm.vocab_size or 1000)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in args.prefill.split(",") if x]
    result: dict = {"model": args.model, "threads": args.threads, "repeats": args.repeats,
                    "attention": args.attention, "engine": engine.key,
                    "gqa_layers": len(engine.manifest["engine"]["attention"]["converted_layers"]),
                    "load_avg_start": os.getloadavg()[0]}
    sides = (("ort", ort_side), ("torch", torch_side))
    for n in lengths:
        ids = rng.integers(0, vocab, (1, n))
        for _, side in sides:  # warm-up (allocations, ORT arena growth)
            side.prefill(ids)
        times: dict[str, list[float]] = {"ort": [], "torch": []}
        for r in range(args.repeats):
            for name, side in (sides if r % 2 == 0 else sides[::-1]):
                times[name].append(_timed(side.prefill, ids))
        med = {k: statistics.median(v) for k, v in times.items()}
        result[f"ort_prefill_{n}_s"] = round(med["ort"], 4)
        result[f"torch_prefill_{n}_s"] = round(med["torch"], 4)
        result[f"ratio_prefill_{n}"] = round(med["ort"] / med["torch"], 3)
        log.warning("prefill %d: ORT %.3f s, PyTorch %.3f s, ratio %.2f", n, med["ort"], med["torch"],
                    med["ort"] / med["torch"])
    ids = rng.integers(0, vocab, (1, args.prompt))
    for _, side in sides:
        side.decode(ids, 4)
    per_tok: dict[str, list[float]] = {"ort": [], "torch": []}
    for r in range(args.repeats):
        for name, side in (sides if r % 2 == 0 else sides[::-1]):
            per_tok[name].append(statistics.median(side.decode(ids, args.decode_steps)))
    med = {k: statistics.median(v) for k, v in per_tok.items()}
    result["ort_decode_ms_per_token"] = round(1e3 * med["ort"], 3)
    result["torch_decode_ms_per_token"] = round(1e3 * med["torch"], 3)
    result["ratio_decode"] = round(med["ort"] / med["torch"], 3)
    result["load_avg_end"] = os.getloadavg()[0]
    log.warning("decode: ORT %.2f ms/token, PyTorch %.2f ms/token, ratio %.2f", 1e3 * med["ort"],
                1e3 * med["torch"], med["ort"] / med["torch"])
    sys.stdout.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
