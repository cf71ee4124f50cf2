"""The plan and the dense and HARP engines a benchmark script times, made by the pipeline's own
stages and cached in its ``--workdir`` (``long_context.py``, ``serve_load.py``, the GPU scripts'
``--engine``). ``args`` is the script's namespace: ``--plan``, or ``--model`` / ``--shape`` (a random-
weight model of a real shape, ``bench/_random_model.py``) with ``--prune-layers`` at ``--alpha``,
and the engines' ``--quant`` (declared once for every script, ``add_quant_argument``) / ``--gguf-type``."""
from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from harp_trt.bench._random_model import random_model
from harp_trt.builders.ort.config import QUANT_MODES

log = logging.getLogger("long_context")

RUNTIMES = {"ort": "ort", "genai": "genai", "llamacpp": "gguf"}   # runtime -> pipeline backend


def add_quant_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """The scripts' ``--quant``, declared once: the ORT engine's weights (a genai folder runs the same
    graph), one of the ORT build's modes (``builders/ort/config.QUANT_MODES``)."""
    parser.add_argument("--quant", default=default, choices=list(QUANT_MODES),
                        help="ORT engine weights, as harp-trt build --quant (a genai folder runs the same graph; "
                             "default %(default)s)")


def shape_model(shape: str, tokenizer: str, seed: int, root: Path) -> Path:
    """The random-weight model of ``shape`` (``bench/_random_model.py``: the real config, bf16 weights
    drawn with ``seed``, ``tokenizer``'s files), written once under ``root``."""
    from harp_trt.models import resolve_model

    folder = root / "long_context_models" / f"{shape}-seed{seed}"
    if not (folder / "config.json").is_file():
        log.info("writing a random-weight %s model to %s ...", shape, folder)
        random_model(shape, folder, resolve_model(tokenizer, root).folder, seed)
    return folder


def calib_config(args):
    """The calibrate config of a plan made from ``--model``/``--shape`` and ``--prune-layers``."""
    from harp_trt.registry import STAGES

    return STAGES.get("calibrate").config_class()(
        layers=len(args.layers), prune_layers=tuple(args.layers), alphas=(float(args.alpha),) * len(args.layers),
        corpus=args.corpus, tokens=args.calib_tokens, seq_len=min(128, args.calib_tokens))


def make_plan(args, store):
    """(plan, resolved model, calibrate artifact or None)."""
    from harp_trt.models import resolve_model
    from harp_trt.pipeline import run_stage
    from harp_trt.plan import Plan, open_plan

    if args.plan:
        plan = open_plan(args.plan, store)
        return plan, resolve_model(plan.model_ref, store.root), None
    model = str(shape_model(args.shape, args.tokenizer, args.seed, Path(store.root))) if args.shape else args.model
    resolved = resolve_model(model, store.root)
    art = run_stage("calibrate", calib_config(args), {"model": resolved}, store)
    return Plan.load(art.path), resolved, art


def stage_configs(backend: str, args) -> dict[str, Any]:
    """Every stage config of the backend's steps: defaults, with ``--quant`` / ``--gguf-type`` where
    the stage takes them and the last position's logits only where a generator reads them."""
    from harp_trt.registry import BACKENDS, STAGES

    configs = {}
    for name in {s.stage for s in BACKENDS.get(backend).steps}:
        cfg = STAGES.get(name).config_class()()
        for field, value in (("quant", args.quant), ("gguf_type", args.gguf_type), ("last_logits", True)):
            if hasattr(cfg, field):
                cfg = dataclasses.replace(cfg, **{field: value})
        configs[name] = cfg
    return configs


def build_sources(runtime: str, plan, resolved, calib_art, store, args) -> dict[str, Any]:
    """The dense and HARP artifacts the runtime's bench compares. From ``--model``/``--shape``: the
    pipeline's ``run_build`` with those two engines (the backend's own choices, e.g. compact
    intermediates at 7B, and its intermediates dropped once read: a 7B int4 pair fits the disk; with
    ``--gguf-type`` the unquantized GGUFs dropped once verified and quantized, ``drop_unquantized``);
    from ``--plan``: the backend's steps that lead to them, walked here."""
    from harp_trt.pipeline import needed_steps, run_build, run_stage
    from harp_trt.registry import BACKENDS

    backend = RUNTIMES[runtime]
    spec = BACKENDS.get(backend)
    # only the dense and HARP engines (not the fp32 references a quantized bench also reads)
    engines = tuple((v, name) for v, name in spec.bench_engines(runtime, f"backend {backend}")
                    if v in ("dense", "harp"))
    configs = stage_configs(backend, args)
    if calib_art is not None:
        res = run_build(str(resolved.folder), calib_config(args), store, backend, configs=configs,
                        engines=engines, keep_intermediates=False)
        arts = {v: res.artifact(name) for v, name in engines}
        if args.gguf_type != "none":   # the bench times the quantized files only
            from harp_trt.bench.stage.engine_llamacpp import drop_unquantized

            arts = {v: drop_unquantized(store, a) for v, a in arts.items()}
        return arts
    needed = needed_steps(spec, engines)
    ctx: dict[str, Any] = {"model": resolved, "plan": plan}
    for step in spec.steps:
        if step.name in needed:
            log.info("%s: %s ...", runtime, step.name)
            ctx[step.name] = run_stage(step.stage, configs[step.stage], {k: ctx[src] for k, src in step.inputs}, store)
    return {v: ctx[name] for v, name in engines}
