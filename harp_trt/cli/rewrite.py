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

    C = STAGES.get("rewrite").config_class()  # defaults, from a light module

    p.add_argument("--model", default=None,
                   help="model the plan was calibrated on (preset, HF id, folder, .gguf); default: the plan's")
    p.add_argument("--plan", required=True, help="plan.json, a calibrate artifact folder or its key")
    p.add_argument("--onnx", default=None, help="rewrite this ONNX file instead of exporting --model")
    p.add_argument("--no-verify", action="store_true", help="skip the ONNX Runtime vs PyTorch check")
    p.add_argument("--rtol", type=float, default=C.default("rtol"),
                   help="logits tolerance relative to max(1, max|logits|) (default %(default)g)")
    p.add_argument("--decode-steps", type=int, default=C.default("decode_steps"),
                   help="decode steps whose logits are compared (default %(default)s)")
    p.add_argument("--greedy-steps", type=int, default=C.default("greedy_steps"),
                   help="decode steps whose greedy tokens must match (default %(default)s)")
    p.add_argument("--force", action="store_true", help="recompute even if the artifact is cached")


def run(args) -> dict:
    from pathlib import Path

    from ..errors import ConfigError
    from ..models import resolve_model
    from ..onnx_io import check_plan_weights
    from ..plan import open_plan
    from ..rewrite.config import RewriteConfig
    from ..rewrite.stage import RewriteStage
    from ..store import ArtifactStore

    if args.onnx and not Path(args.onnx).is_file():
        raise ConfigError(f"--onnx {args.onnx}: no such file", "pass the .onnx file of your export")
    store = ArtifactStore(args.workdir)
    plan = open_plan(args.plan, store)
    config = RewriteConfig.from_dict({"verify": not args.no_verify, "rtol": args.rtol,
                                      "decode_steps": args.decode_steps, "greedy_steps": args.greedy_steps})
    inputs: dict = {"plan": plan}
    model_ref = args.model or plan.model_ref
    if args.onnx:
        inputs["onnx"] = Path(args.onnx)
        if config.verify or args.model:
            inputs["model"] = resolve_model(model_ref, store.root)
    else:
        from ..rewrite.config import ExportConfig
        from ..rewrite.export import ExportStage

        resolved = resolve_model(model_ref, store.root)
        # before spending minutes on an export
        check_plan_weights(plan.model_digest, resolved.digest, "rewrite", f"--model {model_ref!r}")
        inputs["model"] = resolved
        inputs["export"] = ExportStage().execute(store, ExportConfig(), {"model": resolved})
    art = RewriteStage().execute(store, config, inputs, force=args.force)
    man = art.manifest
    return {"artifact": str(art.path), "onnx": str(art.path / man["onnx"]), "layers": man["layers"],
            "alphas": man["alphas"], "kv_inputs": man["kv_inputs"], "removed_params": man["removed_params"],
            "max_abs_diff": man["max_abs_diff"], "tolerance": man["tolerance"], "cached": art.cached}
