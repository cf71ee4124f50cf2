"""harp-trt rewrite: the HARP graph rewrite (arXiv 2507.01900, Eq. 4-5) of an exported model.

``harp-trt rewrite --model M --plan PLAN`` exports M (cached) and rewrites the export;
``harp-trt rewrite --onnx FILE --plan PLAN`` rewrites a user's own graph (optimum,
onnxruntime-genai...), verified against the plan's model (``--model`` overrides it)."""
from __future__ import annotations

import argparse

NAME = "rewrite"
HELP = "replace pruned layers' attention with V.O_fold MatMuls in ONNX, drop their KV cache, verify in ORT"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import STAGES
    from ._options import add_config_arguments

    p.add_argument("--model", default=None,
                   help="model the plan was calibrated on (preset, HF id, folder, .gguf); default: the plan's")
    p.add_argument("--plan", required=True, help="plan.json, a calibrate artifact folder or its key")
    p.add_argument("--onnx", default=None, help="rewrite this ONNX file instead of exporting --model")
    add_config_arguments(p, STAGES.get("rewrite").config_class())  # a light module
    p.add_argument("--force", action="store_true", help="recompute even if the artifact is cached")


def run(args) -> dict:
    from pathlib import Path

    from ..errors import ConfigError
    from ..models import resolve_model
    from ..onnx_io import check_plan_weights
    from ..pipeline import run_stage
    from ..plan import open_plan
    from ..registry import STAGES
    from ..store import ArtifactStore
    from ._options import config_from_args

    if args.onnx and not Path(args.onnx).is_file():
        raise ConfigError(f"--onnx {args.onnx}: no such file", "pass the .onnx file of your export")
    store = ArtifactStore(args.workdir)
    plan = open_plan(args.plan, store)
    config = config_from_args(STAGES.get("rewrite").config_class(), args)
    inputs: dict = {"plan": plan}
    model_ref = args.model or plan.model_ref
    if args.onnx:
        inputs["onnx"] = Path(args.onnx)
        if config.verify or args.model:
            inputs["model"] = resolve_model(model_ref, store.root)
    else:
        resolved = resolve_model(model_ref, store.root)
        # before spending minutes on an export
        check_plan_weights(plan.model_digest, resolved.digest, "rewrite", f"--model {model_ref!r}")
        inputs["model"] = resolved
        inputs["export"] = run_stage("export", STAGES.get("export").config_class()(), {"model": resolved}, store)
    art = run_stage("rewrite", config, inputs, store, force=args.force)
    man = art.manifest
    return {"artifact": str(art.path), "onnx": str(art.path / man["onnx"]), "layers": man["layers"],
            "alphas": man["alphas"], "kv_inputs": man["kv_inputs"], "removed_params": man["removed_params"],
            "max_abs_diff": man["max_abs_diff"], "tolerance": man["tolerance"], "cached": art.cached}
