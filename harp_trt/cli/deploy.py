"""harp-trt deploy TARGET: turn HARP artifacts into deployments. The targets are generated from the
stages that declare one (``DeployTarget`` in their light config module's ``CLI``, e.g.
``builders/gguf/config.py``): its flags, its inputs (``--plan``/``--model`` or ``--artifact``,
``--out``), the function that deploys and the one that summarises the result. Today: ``trtllm``
(TensorRT-LLM checkpoint + build_engine.sh, verified in PyTorch), ``triton`` (model repository),
``genai`` (onnxruntime-genai folder) and ``gguf`` (llama.cpp deci GGUF, verified in llama.cpp)."""
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


PLAN_HELP = "calibrate artifact folder (or key) or a plan.json file"


def targets() -> dict:
    """``{stage name: DeployTarget}`` of every stage that declares one (the target is named as its
    stage), in registry order."""
    from ..registry import STAGES

    declared = {name: STAGES.get(name).cli.deploy for name in STAGES.names()}
    return {name: target for name, target in declared.items() if target is not None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    found = targets()
    sub = p.add_subparsers(dest="target", required=True, metavar="{" + ",".join(found) + "}")
    for stage, target in found.items():
        t = sub.add_parser(stage, help=target.help, description=target.description)
        add_target_arguments(t, stage, target)
        _common_suppressed(t)


def add_target_arguments(p: argparse.ArgumentParser, stage: str, target) -> None:
    """The target's inputs (``DeployTarget.source`` / ``out``), its stage config's flags, ``--force``."""
    from ..registry import STAGES

    if target.source == "plan":
        p.add_argument("--plan", required=True, help=PLAN_HELP)
        add_model_argument(p, required=False)
    else:
        p.add_argument("--artifact", required=True, help=target.artifact_help)
    if target.out != "none":
        p.add_argument("--out", required=target.out == "required", default=None, help=target.out_help)
    add_config_arguments(p, STAGES.get(stage).config_class())  # a light module: flags without the stage's runtime
    p.add_argument("--force", action="store_true", help=target.force_help)


def run(args) -> dict:
    """Deploy with the target's stage: its ``deploy`` function, or the pipeline's run of the stage;
    the result as the target's ``summary`` gives it."""
    from ..pipeline import run_stage
    from ..registry import STAGES
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    stage, target = args.target, targets()[args.target]
    spec = STAGES.get(stage)
    config = config_from_args(spec.config_class(), args)
    store = ArtifactStore(getattr(args, "workdir", None))  # resolves cache keys; holds a cached artifact
    if target.source == "plan":
        from ..models import resolve_model
        from ..plan import open_plan

        plan = open_plan(args.plan, store)
        sources = (plan, resolve_model(args.model or plan.model_ref, store.root))
    else:
        sources = (args.artifact,)
    out = getattr(args, "out", None)
    if target.deploy:
        report = spec.entry(target.deploy)(*sources, out, config, store=store, force=args.force)
    else:
        report = run_stage(stage, config, {"plan": sources[0], "model": sources[1]}, store, force=args.force)
    result = spec.entry(target.summary)(report, config)
    tables = result.pop("_tables", None)
    result["seconds"] = round(time.perf_counter() - t0, 3)
    return {**result, **({"_tables": tables} if tables is not None else {})}
