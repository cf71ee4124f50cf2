"""Check a TensorRT-LLM artifact on a host where ``tensorrt_llm`` imports and a GPU exists.

    python bench/trtllm_check.py --artifact <trtllm artifact folder> [--dense <dense trtllm artifact>]

1. builds the engine with the artifact's own ``build_engine.sh`` (TensorRT-LLM 1.2.x);
2. runs it through the LLM API (``tensorrt_llm.LLM`` on the engine, our ``max_attention_window`` and
   the ``TRTLLM_WINDOW_SIZE_SHARES`` of ``serve_engine.sh``), takes the context logits of a fixed
   prompt and compares them with the PyTorch HARP reference computed layer by layer from the
   model folder the plan names (tolerance: the artifact's own verification tolerance for its dtype);
3. reads the KV-cache blocks the runtime allocated (``LLM.get_stats`` -> ``kvCacheStats``) and,
   given ``--dense`` (the same model's artifact with an empty plan), the dense engine's, and
   reports their ratio next to the manifest's ``kv_bytes_per_token_capacity`` ratio.
The last stdout line is one JSON object. Where ``tensorrt_llm`` does not import or no GPU is
visible it refuses with exit 2 (tested on CPU); nothing here has run against TensorRT-LLM yet."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harp_trt.bench._gpu_common import Refused, run_main  # noqa: E402  (after the path above)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", required=True, help="trtllm artifact folder (harp-trt deploy trtllm)")
    ap.add_argument("--dense", default=None, help="the dense model's trtllm artifact, for the KV block ratio")
    ap.add_argument("--tokens", type=int, default=32, help="prompt tokens compared (default %(default)s)")
    return ap.parse_args(argv)


def preflight(artifact: Path) -> dict:
    if not (artifact / "manifest.json").is_file() or not (artifact / "build_engine.sh").is_file():
        raise Refused(f"{artifact} is not a trtllm artifact (no manifest.json / build_engine.sh)")
    if importlib.util.find_spec("tensorrt_llm") is None:
        raise Refused("tensorrt_llm does not import here; run this on a GPU host with TensorRT-LLM 1.2.x")
    import torch

    if not torch.cuda.is_available():
        raise Refused("no CUDA GPU is visible to PyTorch")
    return json.loads((artifact / "manifest.json").read_text())


def build_engine(artifact: Path) -> Path:
    engine = artifact / "engine"
    if not (engine / "config.json").is_file():
        subprocess.run(["bash", str(artifact / "build_engine.sh"), str(engine)], check=True)
    return engine


def run_engine(artifact: Path, manifest: dict, ids: list[int]):
    """(context logits [T, V] as float32 torch tensor, kv cache stats dict)."""
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import KvCacheConfig

    launch = manifest.get("launch") or {}
    kv = launch.get("kv_runtime") or {}
    if kv.get("shares_env"):
        k, v = kv["shares_env"].split("=", 1)
        os.environ[k] = v
    windows = launch.get("window_list")
    kvc = KvCacheConfig(free_gpu_memory_fraction=0.5, enable_block_reuse=False,
                        **({"max_attention_window": windows} if windows else {}))
    llm = LLM(model=str(build_engine(artifact)), tokenizer=str(artifact / "hf") if (artifact / "hf").is_dir() else None,
              kv_cache_config=kvc, enable_iter_perf_stats=True)
    out = llm.generate([ids], SamplingParams(max_tokens=1, return_context_logits=True))[0]
    stats = list(llm.get_stats(timeout=2))
    kv_stats = (stats[-1].get("kvCacheStats") if stats and isinstance(stats[-1], dict) else None) or {}
    logits = out.context_logits.float().cpu()
    llm.shutdown()
    return logits, kv_stats


def reference_logits(manifest: dict, ids: list[int]):
    import torch

    from harp_trt.device import Placement
    from harp_trt.harp import apply_harp
    from harp_trt.layerwise import LayerStack
    from harp_trt.plan import Plan

    stack = LayerStack.open(Path(manifest["model"]["folder"]), Placement("cpu", "float32", sequential=True), stream_embeddings=True)
    plan = Plan.load(Path(manifest.get("_artifact")) / "plan.json")
    apply_harp(stack.model, plan.alpha_map, stack.family)
    x = torch.tensor([ids])
    cap = stack.capture(x)
    return stack.logits(stack.run(cap.h0, cap)[0])[0].float()


def run(args) -> dict:
    art = Path(args.artifact).resolve()
    manifest = preflight(art)
    manifest["_artifact"] = str(art)
    import torch

    t0 = time.perf_counter()
    vocab = int(json.loads((art / "checkpoint" / "config.json").read_text())["vocab_size"])
    ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    got, kv_stats = run_engine(art, manifest, ids)
    want = reference_logits(manifest, ids)
    diff = float((got[: want.shape[0], : want.shape[1]] - want).abs().max())
    tol = float((manifest.get("verification") or {}).get("tolerance") or 0.0)
    out = {"artifact": str(art), "max_abs_diff": diff, "tolerance": tol, "passed": diff <= tol,
           "kv_cache_stats": kv_stats, "manifest_kv": (manifest.get("launch") or {}).get("kv_runtime")}
    if args.dense:
        dense = Path(args.dense).resolve()
        dm = preflight(dense)
        _, dense_stats = run_engine(dense, dm, ids)
        out["dense_kv_cache_stats"] = dense_stats
        if kv_stats.get("maxNumBlocks") and dense_stats.get("maxNumBlocks"):
            out["kv_blocks_ratio"] = kv_stats["maxNumBlocks"] / dense_stats["maxNumBlocks"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_main("trtllm_check", lambda: run(args), passed=lambda r: r["passed"], default=str)


if __name__ == "__main__":
    sys.exit(main())
