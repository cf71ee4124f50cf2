"""harp-trt deploy: turn HARP artifacts into deployments.

``deploy trtllm --plan P``: a calibrate plan -> TensorRT-LLM deployment artifact (checkpoint for
trtllm-build, HF DeciLM checkpoint where the family allows it, build_engine.sh), verified by reading
it back in PyTorch.

``deploy triton --artifact A --out REPO``: an ONNX artifact (export, rewrite, ORT engine) or a
TensorRT-LLM artifact -> a Triton Inference Server model repository (config.pbtxt files checked
against Triton's schema, client.py, README.md).

``deploy genai --artifact ENGINE [--out DIR]``: an ORT engine -> a folder onnxruntime-genai opens with
``og.Model(DIR)`` (graph, tokenizer, genai_config.json from the engine's metadata; builders/genai).

``deploy gguf --plan P [--out DIR]``: a calibrate plan -> a llama.cpp ``deci`` GGUF (optionally
quantized by llama.cpp), verified by running it in llama.cpp against the PyTorch HARP model
(builders/gguf)."""
from __future__ import annotations

import argparse
import time

from ._common import add_model_argument

NAME = "deploy"
HELP = ("deploy a HARP plan or artifact: trtllm (TensorRT-LLM checkpoint), triton (model repository), "
        "genai (onnxruntime-genai folder) or gguf (llama.cpp)")
TARGETS = ("trtllm", "triton", "genai", "gguf")


def _common_suppressed(p: argparse.ArgumentParser) -> None:
    """--workdir/--json/-v after the target too; SUPPRESS keeps a value given before the target."""
    from . import common_arguments

    tmp = argparse.ArgumentParser(add_help=False)
    common_arguments(tmp)
    for a in tmp._actions:
        kw = {"help": a.help, "default": argparse.SUPPRESS, "dest": a.dest}
        if a.nargs == 0:  # a flag (store_true)
            p.add_argument(*a.option_strings, action="store_true", **kw)
        else:
            p.add_argument(*a.option_strings, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", required=True, metavar="{trtllm,triton,genai,gguf}")
    t = sub.add_parser("trtllm", help="TensorRT-LLM checkpoint + build_engine.sh for a HARP plan (verified in PyTorch)",
                       description="write a TensorRT-LLM checkpoint + build_engine.sh for a HARP plan")
    add_trtllm_arguments(t)
    _common_suppressed(t)
    r = sub.add_parser("triton", help="Triton model repository for an ONNX or TensorRT-LLM artifact",
                       description="write a Triton model repository (config.pbtxt checked against Triton's "
                                   "schema, client.py, README.md) for an ONNX or TensorRT-LLM artifact")
    add_triton_arguments(r)
    _common_suppressed(r)
    g = sub.add_parser("genai", help="onnxruntime-genai folder (og.Model) for an ORT engine",
                       description="write a folder onnxruntime-genai opens with og.Model: the engine's graph, "
                                   "tokenizer files and a genai_config.json read from its metadata")
    add_genai_arguments(g)
    _common_suppressed(g)
    f = sub.add_parser("gguf", help="llama.cpp deci GGUF for a HARP plan (verified in llama.cpp)",
                       description="write a llama.cpp GGUF (deci architecture: pruned layers as one folded "
                                   "linear attention, no KV cache) for a HARP plan, verified in llama.cpp")
    add_gguf_arguments(f)
    _common_suppressed(f)


def add_trtllm_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("trtllm").config_class()  # defaults, from a light module

    p.add_argument("--plan", required=True, help="calibrate artifact folder (or key) or a plan.json file")
    add_model_argument(p, required=False)
    p.add_argument("--dtype", default=C.default("dtype"), help="float16 | bfloat16 | float32 (default %(default)s)")
    p.add_argument("--tp", type=int, default=C.default("tp_size"), help="tensor-parallel GPUs (default %(default)s)")
    p.add_argument("--pp", type=int, default=C.default("pp_size"), help="pipeline stages (default %(default)s)")
    p.add_argument("--max-batch-size", type=int, default=C.default("max_batch_size"), help="(default %(default)s)")
    p.add_argument("--max-input-len", type=int, default=C.default("max_input_len"), help="(default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=C.default("max_seq_len"), help="(default %(default)s)")
    p.add_argument("--max-num-tokens", type=int, default=C.default("max_num_tokens"), help="(default %(default)s)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF DeciLM checkpoint")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the read-back check (layer by layer against the PyTorch HARP reference)")
    p.add_argument("--build", default=C.default("build"), choices=["auto", "never"],
                   help="auto: run trtllm-build where tensorrt_llm and GPUs exist (default %(default)s)")
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is cached")


def add_triton_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("triton").config_class()  # defaults, from a light module

    p.add_argument("--artifact", required=True,
                   help="export/rewrite/ORT-engine folder with model.onnx, or a trtllm artifact (folder or cache key)")
    p.add_argument("--out", required=True, help="model repository folder to write (must be new or empty)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--triton-release", default=C.default("triton_release"),
                   help="tritonserver release (YY.MM) to serve with: onnx serving: its ONNX Runtime must load the "
                        "graph; TensorRT-LLM: it must carry the TensorRT-LLM the checkpoint targets "
                        "(default %(default)s, the first release that carries it)")
    g = p.add_argument_group("ONNX Runtime model")
    g.add_argument("--model-name", default=C.default("model_name"), help="Triton model name (default %(default)s)")
    g.add_argument("--serving", default=C.default("serving"), choices=["python", "onnx"],
                   help="python: text in/out, generation + KV cache + batching inside the server (vLLM-backend "
                        "I/O); onnx: Triton's onnxruntime backend, the client keeps the cache (default %(default)s)")
    g.add_argument("--max-active", type=int, default=C.default("max_active"),
                   help="python serving: sequences decoded together (default %(default)s)")
    g.add_argument("--prompt-limit", type=int, default=C.default("max_input_len"),
                   help="python serving: longest prompt in tokens, 0 = the model's context (default %(default)s)")
    g.add_argument("--context-limit", type=int, default=C.default("max_seq_len"),
                   help="python serving: prompt + max_tokens limit, 0 = the model's context (default %(default)s)")
    g.add_argument("--device", default=C.default("device"), choices=["cpu", "gpu"],
                   help="instance kind: cpu -> KIND_CPU, gpu -> KIND_GPU (default %(default)s)")
    g.add_argument("--instances", type=int, default=C.default("instances"), help="model instances (default %(default)s)")
    g.add_argument("--threads", type=int, default=C.default("threads"),
                   help="ONNX Runtime intra-op threads, 0 = its default (default %(default)s)")
    g.add_argument("--copy", action="store_true", help="copy model files instead of hard-linking them")
    g = p.add_argument_group("TensorRT-LLM models")
    g.add_argument("--max-batch-size", type=int, default=C.default("max_batch_size"),
                   help="Triton max batch size, 0 = the engine's (default %(default)s)")
    g.add_argument("--engine-dir", default=C.default("engine_dir"),
                   help="engine folder as the server sees it (default: <artifact>/engine, where build_engine.sh writes)")
    g.add_argument("--tokenizer-dir", default=C.default("tokenizer_dir"),
                   help="tokenizer folder to copy (default: the artifact's hf/ or the plan's model folder)")
    g.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, default=C.default("kv_cache_free_gpu_mem_fraction"),
                   help="(default %(default)s)")
    g.add_argument("--batching-strategy", default=C.default("batching_strategy"),
                   choices=["inflight_fused_batching"], help="(default %(default)s; V1 is gone from 1.x executors)")
    g.add_argument("--batch-scheduler-policy", default=C.default("batch_scheduler_policy"),
                   choices=["guaranteed_no_evict", "max_utilization"], help="(default %(default)s)")
    g.add_argument("--decoupled", action="store_true", help="decoupled (streaming) tensorrt_llm model")
    g.add_argument("--include-input", action="store_true", help="return the prompt with the output text")
    g.add_argument("--kv-cache-reuse", action="store_true", help="enable KV cache reuse (prefix caching)")
    g.add_argument("--max-queue-delay-us", type=int, default=C.default("max_queue_delay_microseconds"),
                   help="(default %(default)s)")
    g.add_argument("--preprocessing-instances", type=int, default=C.default("preprocessing_instances"),
                   help="(default %(default)s)")
    g.add_argument("--postprocessing-instances", type=int, default=C.default("postprocessing_instances"),
                   help="(default %(default)s)")


def add_genai_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("genai").config_class()  # defaults, from a light module

    p.add_argument("--artifact", required=True, help="ORT engine folder (build-ort artifact) or its cache key")
    p.add_argument("--out", default=None,
                   help="folder to write (new or empty); default: the cached genai-<key> artifact in --workdir")
    p.add_argument("--context-length", type=int, default=C.default("context_length"),
                   help="longest prompt + new tokens, 0 = the model's max_position_embeddings (default %(default)s)")
    p.add_argument("--copy", action="store_true", help="copy the graph instead of hard-linking it")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check that og.Generator's greedy tokens equal ONNX Runtime's on the graph")
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty / rebuild the cached folder")


def add_gguf_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES

    C = STAGES.get("gguf").config_class()  # defaults, from a light module

    p.add_argument("--plan", required=True, help="calibrate artifact folder (or key) or a plan.json file")
    add_model_argument(p, required=False)
    p.add_argument("--out", default=None,
                   help="folder to write (new or empty); default: the cached gguf-<key> artifact in --workdir")
    p.add_argument("--dtype", default=C.default("dtype"), help="f32 | f16 | bf16 (default %(default)s)")
    p.add_argument("--gguf-type", default=C.default("gguf_type"),
                   help="also quantize with llama.cpp's quantizer: none | q8_0 | q4_k_m | ... (default %(default)s)")
    p.add_argument("--context", type=int, default=C.default("context"),
                   help="context length written, 0 = the model's max_position_embeddings (default %(default)s)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the check that llama.cpp's logits and greedy tokens equal the PyTorch HARP model's")
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty / rebuild the cached artifact")


def run_gguf(args) -> dict:
    from ..registry import STAGES

    GgufConfig = STAGES.get("gguf").config_class()
    from ..models import resolve_model
    from ..plan import open_plan
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = GgufConfig.from_dict({"dtype": args.dtype, "gguf_type": args.gguf_type, "context": args.context,
                                   "verify": not args.no_verify})
    store = ArtifactStore(getattr(args, "workdir", None))
    plan = open_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    from builders.gguf.stage import deploy_gguf

    r = deploy_gguf(plan, resolved, args.out, config, store=store, force=args.force)
    v = r.get("verification") or {}
    return {"folder": r["folder"], "cached": r["cached"], "file": r["file"], "quantized_file": r["quantized_file"],
            "architecture": r["architecture"], "dtype": r["dtype"], "pruned_layers": r["pruned_layers"],
            "kv_bytes_per_token": r["kv_bytes_per_token"], "kv_bytes_per_token_dense": r["kv_bytes_per_token_dense"],
            "kv_bytes_per_token_no_flash_attn": r["kv_bytes_per_token_no_flash_attn"],
            "flash_attn_required": r["flash_attn_required"], "tokenizer": r["tokenizer"]["source"],
            "verify_max_abs_diff": v.get("max_abs_diff"), "verify_tolerance": v.get("tolerance"),
            "greedy_equal": v.get("greedy_equal"), "llama_cpp": r["llama_cpp"]["version"],
            "seconds": round(time.perf_counter() - t0, 3),
            "_tables": {"layers": [{k: ("" if val is None else val) for k, val in row.items()} for row in r["layers"]]}}


def run_genai(args) -> dict:
    from ..registry import STAGES

    GenaiConfig = STAGES.get("genai").config_class()
    from builders.genai.stage import deploy_genai

    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = GenaiConfig.from_dict({"context_length": args.context_length, "link": not args.copy,
                                    "verify": not args.no_verify})
    store = ArtifactStore(getattr(args, "workdir", None))  # resolves a cache key; holds the folder without --out
    r = deploy_genai(args.artifact, args.out, config, force=args.force, store=store)
    return {"folder": r["folder"], "cached": r["cached"], "artifact": r["artifact"]["path"],
            "kv_layers": r["kv_layers"], "pruned_layers": r["pruned_layers"], "quant": r["quant"],
            "past_present_share_buffer": r["past_present_share_buffer"], "context_length": r["context_length"],
            "verified": bool((r.get("verify") or {}).get("equal")), "seconds": round(time.perf_counter() - t0, 3)}


def run(args) -> dict:
    if args.target == "genai":
        return run_genai(args)
    if args.target == "gguf":
        return run_gguf(args)
    if args.target == "triton":
        return run_triton(args)
    return run_trtllm(args)


def run_triton(args) -> dict:
    from ..registry import STAGES

    TritonRepoConfig = STAGES.get("triton").config_class()
    from builders.triton.repository import write_repository

    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = TritonRepoConfig.from_dict({
        "model_name": args.model_name, "serving": args.serving, "max_active": args.max_active,
        "max_input_len": args.prompt_limit, "max_seq_len": args.context_limit,
        "triton_release": args.triton_release, "device": args.device, "instances": args.instances, "threads": args.threads,
        "link": not args.copy, "max_batch_size": args.max_batch_size, "engine_dir": args.engine_dir,
        "tokenizer_dir": args.tokenizer_dir, "kv_cache_free_gpu_mem_fraction": args.kv_cache_free_gpu_mem_fraction,
        "batching_strategy": args.batching_strategy, "batch_scheduler_policy": args.batch_scheduler_policy,
        "decoupled": args.decoupled, "exclude_input_in_output": not args.include_input,
        "enable_kv_cache_reuse": args.kv_cache_reuse, "max_queue_delay_microseconds": args.max_queue_delay_us,
        "preprocessing_instances": args.preprocessing_instances,
        "postprocessing_instances": args.postprocessing_instances})
    store = ArtifactStore(args.workdir) if getattr(args, "workdir", None) else None
    r = write_repository(args.artifact, args.out, config, force=args.force, store=store)
    result = {"repository": r["repository"], "kind": r["kind"], "artifact": r["artifact"]["path"],
              "artifact_stage": r["artifact"]["stage"], "seconds": round(time.perf_counter() - t0, 3)}
    if r["kind"] == "onnx" and r.get("serving") == "python":
        result.update({"model": r["model"], "serving": "python", "instance_kind": r["instance_kind"],
                       "inputs": len(r["inputs"]), "weights": r["placed_by"]})
    elif r["kind"] == "onnx":
        result.update({"model": r["model"], "serving": "onnx", "instance_kind": r["instance_kind"],
                       "inputs": len(r["inputs"]), "outputs": len(r["outputs"]), "kv_layers": r["kv_layers"],
                       "pruned_layers": r["pruned_layers"], "weights": r["placed_by"],
                       "triton_onnxruntime": r["compat"]["triton_onnxruntime"]})
    else:
        v = r["template_values"]
        result.update({"models": ", ".join(r["models"]), "engine_dir": r["engine_dir"], "engine_built": r["engine_built"],
                       "max_batch_size": v["triton_max_batch_size"],
                       "max_attention_window_size": v["max_attention_window_size"],
                       "decoupled": v["decoupled_mode"], "triton_release": r["triton_release"],
                       "tensorrt_llm": r["tensorrt_llm_version"], "image": r["image"]})
        result["_tables"] = {"template keys": [{"key": k, "value": "(backend default)" if val is None else val}
                                               for k, val in v.items()]}
    return result



def run_trtllm(args) -> dict:
    from ..registry import STAGES

    TrtllmCheckpointConfig = STAGES.get("trtllm").config_class()
    from builders.trtllm.stage import TrtllmCheckpointStage

    from ..models import resolve_model
    from ..plan import open_plan
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = TrtllmCheckpointConfig.from_dict({
        "dtype": args.dtype, "tp_size": args.tp, "pp_size": args.pp, "max_batch_size": args.max_batch_size,
        "max_input_len": args.max_input_len, "max_seq_len": args.max_seq_len,
        "max_num_tokens": args.max_num_tokens, "hf_format": not args.no_hf, "verify": not args.no_verify,
        "build": args.build})
    store = ArtifactStore(args.workdir)
    plan = open_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    art = TrtllmCheckpointStage().execute(store, config, {"plan": plan, "model": resolved}, force=args.force)
    m = art.manifest
    ck = m["checkpoint"]
    rows = [{"layer": r["layer"], "kind": r["kind"], "alpha": "" if r["alpha"] is None else r["alpha"],
             "kv_heads": r["kv_heads"], "window": r["window"] or "full"} for r in ck["layers"]]
    return {
        "artifact": str(art.path), "cached": art.cached, "architecture": ck["architecture"],
        "route": ck["route"], "dtype": config.dtype, "tp": config.tp_size, "pp": config.pp_size,
        "kv_bytes_per_token": ck["kv_bytes_per_token"], "kv_bytes_per_token_unpruned": ck["kv_bytes_per_token_unpruned"],
        "kv_bytes_per_sequence": ck["kv_bytes_per_sequence"],
        "kv_bytes_per_sequence_unpruned": ck["kv_bytes_per_sequence_unpruned"],
        "verify_max_abs_diff": (m.get("verification") or {}).get("max_abs_diff"),
        "hf_checkpoint": m["hf_checkpoint"].get("written"), "engine_built": m["engine"]["built"],
        "build_script": str(art.path / "build_engine.sh"), "seconds": round(time.perf_counter() - t0, 3),
        "_tables": {"layers": rows},
    }
