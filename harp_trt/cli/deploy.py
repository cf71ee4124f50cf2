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
from ._options import add_config_arguments, config_from_args

NAME = "deploy"
HELP = ("deploy a HARP plan or artifact: trtllm (TensorRT-LLM checkpoint), triton (model repository), "
        "genai (onnxruntime-genai folder) or gguf (llama.cpp)")


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


# target -> (help, description, the function adding its flags)
_TARGETS = {
    "trtllm": ("TensorRT-LLM checkpoint + build_engine.sh for a HARP plan (verified in PyTorch)",
               "write a TensorRT-LLM checkpoint + build_engine.sh for a HARP plan", "add_trtllm_arguments"),
    "triton": ("Triton model repository for an ONNX or TensorRT-LLM artifact",
               "write a Triton model repository (config.pbtxt checked against Triton's schema, client.py, "
               "README.md) for an ONNX or TensorRT-LLM artifact", "add_triton_arguments"),
    "genai": ("onnxruntime-genai folder (og.Model) for an ORT engine",
              "write a folder onnxruntime-genai opens with og.Model: the engine's graph, tokenizer files and a "
              "genai_config.json read from its metadata", "add_genai_arguments"),
    "gguf": ("llama.cpp deci GGUF for a HARP plan (verified in llama.cpp)",
             "write a llama.cpp GGUF (deci architecture: pruned layers as one folded linear attention, no KV "
             "cache) for a HARP plan, verified in llama.cpp", "add_gguf_arguments"),
}
TARGETS = tuple(_TARGETS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="target", required=True, metavar="{" + ",".join(_TARGETS) + "}")
    for name, (help_, description, adder) in _TARGETS.items():
        t = sub.add_parser(name, help=help_, description=description)
        globals()[adder](t)
        _common_suppressed(t)


def _config_class(stage: str) -> type:
    from ..registry import STAGES

    return STAGES.get(stage).config_class()  # a light module: flags without the stage's runtime


def add_trtllm_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="calibrate artifact folder (or key) or a plan.json file")
    add_model_argument(p, required=False)
    add_config_arguments(p, _config_class("trtllm"))
    p.add_argument("--force", action="store_true", help="rebuild even if the artifact is cached")


def add_triton_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifact", required=True,
                   help="export/rewrite/ORT-engine folder with model.onnx, or a trtllm artifact (folder or cache key)")
    p.add_argument("--out", required=True, help="model repository folder to write (must be new or empty)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    add_config_arguments(p, _config_class("triton"))


def add_genai_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--artifact", required=True, help="ORT engine folder (build-ort artifact) or its cache key")
    p.add_argument("--out", default=None,
                   help="folder to write (new or empty); default: the cached genai-<key> artifact in --workdir")
    add_config_arguments(p, _config_class("genai"))
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty / rebuild the cached folder")


def add_gguf_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="calibrate artifact folder (or key) or a plan.json file")
    add_model_argument(p, required=False)
    p.add_argument("--out", default=None,
                   help="folder to write (new or empty); default: the cached gguf-<key> artifact in --workdir")
    add_config_arguments(p, _config_class("gguf"))
    p.add_argument("--force", action="store_true", help="replace --out if it is not empty / rebuild the cached artifact")


def run_gguf(args) -> dict:
    from ..models import resolve_model
    from ..plan import open_plan
    from ..registry import STAGES
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = config_from_args(_config_class("gguf"), args)
    store = ArtifactStore(getattr(args, "workdir", None))
    plan = open_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    deploy_gguf = STAGES.get("gguf").entry("deploy_gguf")

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
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = config_from_args(_config_class("genai"), args)
    deploy_genai = STAGES.get("genai").entry("deploy_genai")
    store = ArtifactStore(getattr(args, "workdir", None))  # resolves a cache key; holds the folder without --out
    r = deploy_genai(args.artifact, args.out, config, force=args.force, store=store)
    return {"folder": r["folder"], "cached": r["cached"], "artifact": r["artifact"]["path"],
            "kv_layers": r["kv_layers"], "pruned_layers": r["pruned_layers"], "quant": r["quant"],
            "past_present_share_buffer": r["past_present_share_buffer"], "context_length": r["context_length"],
            "logits": r.get("logits", "all"),   # folders written before --last-logits hold every position's
            "verified": bool((r.get("verify") or {}).get("equal")), "seconds": round(time.perf_counter() - t0, 3)}


def run(args) -> dict:
    """The target's ``run_<target>`` (each target of ``_TARGETS`` has one, as it has ``add_<target>_arguments``)."""
    return globals()[f"run_{args.target}"](args)


def run_triton(args) -> dict:
    from ..registry import STAGES
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = config_from_args(_config_class("triton"), args)
    write_repository = STAGES.get("triton").entry("write_repository")
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
    from ..models import resolve_model
    from ..pipeline import run_stage
    from ..plan import open_plan
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    config = config_from_args(_config_class("trtllm"), args)
    store = ArtifactStore(args.workdir)
    plan = open_plan(args.plan, store)
    resolved = resolve_model(args.model or plan.model_ref, store.root)
    art = run_stage("trtllm", config, {"plan": plan, "model": resolved}, store, force=args.force)
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
