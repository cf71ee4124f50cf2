"""harp-trt build: the one-command pipeline (calibrate -> rewrite -> build -> bench)."""
from __future__ import annotations

import argparse
import time

from ._common import add_calibrate_arguments, add_model_argument, calibrate_config_from_args, progress_bar

NAME = "build"
HELP = "calibrate -> rewrite -> build (-> bench), reusing every cached artifact"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import BACKENDS, PHASES, STAGES

    Q = STAGES.get("build-ort").config_class()  # a light module: defaults without onnxruntime
    add_model_argument(p)
    add_calibrate_arguments(p)
    p.add_argument("--backend", default="ort", help=f"{' | '.join(BACKENDS.names())} (default %(default)s)")
    p.add_argument("--force", default=None, metavar="STAGE",
                   help=f"rerun STAGE and every stage after it ({', '.join(PHASES)})")
    p.add_argument("--bench", action="store_true", help="also run the bench stage (dense vs HARP)")
    p.add_argument("--bench-engine", default=None,
                   help="runtime the bench compares dense and HARP in, per backend (the first is its default): "
                        + "; ".join(f"{n}: {', '.join(BACKENDS.get(n).bench_names())}" for n in BACKENDS.names()))
    p.add_argument("--bench-seq-lens", default="128,512,1024,2048", help="bench prefill lengths (default %(default)s)")
    p.add_argument("--bench-tasks", default="none",
                   help="bench lm-eval tasks, comma-separated, or 'none' (default %(default)s)")
    p.add_argument("--bench-limit", type=int, default=100, help="documents per lm-eval task (default %(default)s)")
    p.add_argument("--bench-repeats", type=int, default=3, help="timed repeats per shape (default %(default)s)")
    p.add_argument("--bench-batch-sizes", default="1,4,16",
                   help="bench throughput request batches, or 'none' (default %(default)s)")
    p.add_argument("--bench-threads", type=int, default=0,
                   help="threads the bench's engines run on; 0 = the runtime's default (default %(default)s)")
    q = p.add_argument_group("ORT engine quantization (weight-only, onnxruntime.quantization MatMulNBits)")
    q.add_argument("--quant", default=Q.default("quant"), help="none (exact fp32) | int4 | int8 (default %(default)s)")
    q.add_argument("--quant-block-size", type=int, default=Q.default("quant_block_size"),
                   help="weights per scale along K (default %(default)s)")
    q.add_argument("--quant-asymmetric", action="store_true", help="zero points per block (default: symmetric)")
    q.add_argument("--quant-accuracy-level", type=int, default=Q.default("quant_accuracy_level"),
                   help="MatMulNBits compute: 0 = fp32 activations, 4 = int8 (default %(default)s, fastest on CPU)")
    G = STAGES.get("gguf").config_class()
    p.add_argument("--gguf-type", default=G.default("gguf_type"),
                   help="gguf: also quantize with llama.cpp to this type, e.g. q8_0, q4_k_m (default %(default)s)")
    p.add_argument("--gguf-dtype", default=G.default("dtype"), help="gguf: f32 | f16 | bf16 (default %(default)s)")
    p.add_argument("--tp", type=int, default=1, help="trtllm: tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="trtllm: pipeline-parallel size")


def run(args) -> dict:
    from ..pipeline import run_build
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    store = ArtifactStore(args.workdir)
    calib_config, placement = calibrate_config_from_args(args)
    bench_config = _bench_config(args, placement) if args.bench else None
    configs = {"build-ort": _ort_config(args)}
    if args.backend == "trtllm":
        from ..registry import STAGES

        TrtllmCheckpointConfig = STAGES.get("trtllm").config_class()
        configs["trtllm"] = TrtllmCheckpointConfig.from_dict({"tp_size": args.tp, "pp_size": args.pp})
    if args.backend == "gguf":
        from ..registry import STAGES

        configs["gguf"] = STAGES.get("gguf").config_class().from_dict({"gguf_type": args.gguf_type,
                                                                        "dtype": args.gguf_dtype})
    with progress_bar(not args.json) as (on_candidate, on_phase):
        res = run_build(args.model, calib_config, store, backend=args.backend, force=args.force,
                        bench_config=bench_config, configs=configs, on_phase=on_phase,
                        progress=on_candidate, placement=placement)
    plan = res.plan
    out = {"model": args.model, "backend": args.backend, "layers": list(plan.layers), "alphas": list(plan.alphas),
           "ppl": plan.ppl, "stages": {r.stage: {"artifact": str(r.artifact.path), "cached": r.artifact.cached,
                                               "seconds": round(r.seconds, 3)} for r in res.records},
           "all_cached": all(r.artifact.cached for r in res.records),
           "seconds": round(time.perf_counter() - t0, 3), "notes": res.notes,
           "_tables": {"stages": [r.row() for r in res.records]}, "_hide": ["stages"]}
    engine = res.artifact("build")
    if engine is not None:
        out["engine"] = str(engine.path)
        kv = (engine.manifest.get("engine") or {}).get("kv") or {}
        if "bytes_per_token" in kv:
            out["kv_bytes_per_token"] = {"harp": kv["bytes_per_token"], "dense": kv.get("dense_bytes_per_token")}
        if "kv_bytes_per_token_dense" in engine.manifest:  # gguf: llama.cpp's own KV accounting
            out["kv_bytes_per_token"] = {"harp": engine.manifest["kv_bytes_per_token"],
                                         "dense": engine.manifest["kv_bytes_per_token_dense"]}
        quant = (engine.manifest.get("engine") or {}).get("quant")
        if quant:
            out["quant"] = quant
    bench = res.artifact("bench")
    if bench is not None:
        out["bench"] = bench.manifest.get("summary", {})
    return out


def _ort_config(args):
    from ..registry import STAGES

    OrtBuildConfig = STAGES.get("build-ort").config_class()
    if args.quant != "none" and args.backend in ("trtllm", "gguf"):
        from ..errors import ConfigError

        raise ConfigError(f"--quant applies to the ORT engine (backends ort, triton and genai), not {args.backend}",
                          "for llama.cpp quantization use --gguf-type" if args.backend == "gguf" else None)
    return OrtBuildConfig(quant=args.quant, quant_block_size=args.quant_block_size,
                          quant_symmetric=not args.quant_asymmetric, quant_accuracy_level=args.quant_accuracy_level)


def _bench_config(args, placement):
    from ..registry import STAGES

    BenchConfig = STAGES.get("bench").config_class()
    from ._common import parse_batch_sizes, parse_ints, parse_tasks
    from ..registry import BACKENDS

    spec = BACKENDS.get(args.backend)  # "did you mean"
    engine = args.bench_engine or spec.bench
    spec.bench_engines(BenchConfig.check_engine(engine), f"backend {args.backend}")  # an engine this backend builds for, before any work
    model = not spec.bench_engines(engine)  # the bench loads the model itself (torch): --device/--dtype apply
    return BenchConfig.from_dict({
        "engine": engine,
        "seq_lens": parse_ints(args.bench_seq_lens, "--bench-seq-lens"), "tasks": parse_tasks(args.bench_tasks),
        "limit": args.bench_limit, "repeats": args.bench_repeats,
        "batch_sizes": parse_batch_sizes(args.bench_batch_sizes, "--bench-batch-sizes"), "corpus": args.corpus,
        "threads": args.bench_threads, "dtype": placement.dtype if model else "float32",
        "device": placement.kind if model else "cpu"})
