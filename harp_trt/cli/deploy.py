"""harp-trt deploy: turn a calibrate plan into a TensorRT-LLM deployment artifact (checkpoint for
trtllm-build, HF DeciLM checkpoint where the family allows it, build_engine.sh), verified by reading
it back in PyTorch."""
from __future__ import annotations

import argparse
import time

from ._common import add_model_argument

NAME = "deploy"
HELP = "write a TensorRT-LLM checkpoint + build_engine.sh for a HARP plan (verified in PyTorch)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from builders.trtllm.stage import TrtllmCheckpointConfig as C

    p.add_argument("--plan", required=True, help="calibrate artifact folder (or key) or a plan.json file")
    add_model_argument(p, required=False)
    p.add_argument("--backend", default="trtllm", choices=["trtllm"], help="deployment target (default %(default)s)")
    p.add_argument("--dtype", default=C.default("dtype"), help="float16 | bfloat16 | float32 (default %(default)s)")
    p.add_argument("--tp", type=int, default=C.default("tp_size"), help="tensor-parallel GPUs (default %(default)s)")
    p.add_argument("--pp", type=int, default=C.default("pp_size"), help="pipeline stages (default %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=C.default("max_batch_size"), help="(default %(default)s)")
    p.add_argument("--max-input-len", type=int, default=C.default("max_input_len"), help="(default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=C.default("max_seq_len"), help="(default %(default)s)")
    p.add_argument("--max-num-tokens", type=int, default=C.default("max_num_tokens"), help="(default %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF DeciLM checkpoint")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the read-back check (it holds a second fp32 copy of the model in memory)")
    p.add_argument("--build", default=C.default("build"), choices=["auto", "never"],
                   help="auto: run trtllm-build where tensorrt_llm and GPUs exist (default %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is cached")


def _load_plan(ref: str, store):
    from pathlib import Path

    from ..plan import Plan

    p = Path(ref)
    if p.is_file() or (p / "plan.json").is_file():
        return Plan.load(p)
    return Plan.load(store.open(ref).path)


def run(args) -> dict:
    from builders.trtllm.stage import TrtllmCheckpointConfig, TrtllmCheckpointStage

    from ..errors import PreconditionError
    from ..models import load_model, load_tokenizer, resolve_model
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = TrtllmCheckpointConfig.from_dict({
        "dtype": args.dtype, "tp_size": args.tp, "pp_size": args.pp, "max_batch_size": args.max_batch_size,
        "max_input_len": args.max_input_len, "max_seq_len": args.max_seq_len,
        "max_num_tokens": args.max_num_tokens, "hf_format": not args.no_hf, "verify": not args.no_verify,
        "build": args.build})
    store = ArtifactStore(args.workdir)
    plan = _load_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    if resolved.digest != plan.model_digest:
        raise PreconditionError("trtllm", f"model {resolved.ref} (weights {resolved.digest[:12]}) is not the model "
                                f"the plan was calibrated on ({plan.model_digest[:12]})",
                                "pass --model with the calibrated weights, or calibrate this model first")
    model, _ = load_model(resolved, dtype="float32")
    try:
        tokenizer = load_tokenizer(resolved.folder)
    except (OSError, ValueError):
        tokenizer = None
    art = TrtllmCheckpointStage().execute(
        store, config, {"plan": plan, "model": model, "tokenizer": tokenizer, "model_digest": resolved.digest},
        force=args.force)
    m = art.manifest
    ck = m["checkpoint"]
    rows = [{"layer": r["layer"], "kind": r["kind"], "alpha": "" if r["alpha"] is None else r["alpha"],
             "kv_heads": r["kv_heads"], "window": r["window"] or "full"} for r in ck["layers"]]
    return {
        "artifact": str(art.path), "cached": art.cached, "architecture": ck["architecture"],
        "route": ck["route"], "dtype": config.dtype, "tp": config.tp_size, "pp": config.pp_size,
        "kv_bytes_per_sequence": ck["kv_bytes_per_sequence"],
        "kv_bytes_per_sequence_unpruned": ck["kv_bytes_per_sequence_unpruned"],
        "verify_max_abs_diff": (m.get("verification") or {}).get("max_abs_diff"),
        "hf_checkpoint": m["hf_checkpoint"].get("written"), "engine_built": m["engine"]["built"],
        "build_script": str(art.path / "build_engine.sh"), "seconds": round(time.perf_counter() - t0, 3),
        "_tables": {"layers": rows},
    }
