"""harp-trt build: the one-command pipeline (calibrate -> rewrite -> build -> bench)."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from ..config import option
from ._common import add_calibrate_arguments, add_model_argument, calibrate_config_from_args, progress_bar
from ._options import add_config_arguments, config_from_args

NAME = "build"
HELP = "calibrate -> rewrite -> build (-> bench), reusing every cached artifact"


# the bench stage's flags as build takes them (--bench-seq-lens ...), with build's own defaults: a
# shorter sweep, no lm-eval tasks, fewer repeats
BENCH_FIELDS = ("engine", "seq_lens", "tasks", "limit", "repeats", "batch_sizes", "threads")
BENCH_DEFAULTS = {"engine": None, "seq_lens": "128,512,1024,2048", "tasks": "none", "repeats": 3}
QUANT_FIELDS = ("quant", "quant_block_size", "quant_symmetric", "quant_accuracy_level", "quant_embedding")


def stage_flags() -> dict[str, tuple]:
    """stage -> its flag groups as build takes them ((fields, flag prefix), ...), declared by the stage
    (``StageCli.build_flags``): offered under "--backend <stage>" and made into that stage's config
    where the chosen backend runs the stage."""
    from ..registry import STAGES

    return {name: flags for name in STAGES.names() if (flags := STAGES.get(name).cli.build_flags)}


@dataclass(frozen=True)
class Run:
    """What ``harp-trt build`` runs after calibrate: a backend's stages, the bench, what it keeps."""

    backend: str = option("ort", help="the backend whose stages run (default %(default)s)")
    bench: bool = option(False, help="also run the bench stage (dense vs HARP)")
    keep_intermediates: bool = option(False, help="keep the ONNX weights of the export and rewrite artifacts once "
                                                  "the engine is built (default: dropped, their manifests kept; a "
                                                  "run that needs them rebuilds them)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..registry import BACKENDS, PHASES, STAGES

    add_model_argument(p)
    add_calibrate_arguments(p)
    add_config_arguments(p, Run, ("backend",),
                         overrides={"backend": {"help": f"{' | '.join(BACKENDS.names())} (default %(default)s)"}})
    p.add_argument("--force", default=None, metavar="STAGE",
                   help=f"rerun STAGE and every stage after it ({', '.join(PHASES)})")
    add_config_arguments(p, Run, ("bench", "keep_intermediates"))
    bench_help = {"engine": {"help": "runtime the bench compares dense and HARP in, per backend (the first is its "
                                     "default): " + "; ".join(f"{n}: {', '.join(BACKENDS.get(n).bench_names())}"
                                                              for n in BACKENDS.names()),
                             "choices": None},  # checked with "did you mean" against the backend
                  "threads": {"help": "threads the bench's engines run on; 0 = the runtime's default (default 0)"}}
    add_config_arguments(p, STAGES.get("bench").config_class(), BENCH_FIELDS, prefix="bench-",
                         overrides={k: {**({"default": BENCH_DEFAULTS[k]} if k in BENCH_DEFAULTS else {}),
                                        **bench_help.get(k, {})} for k in BENCH_FIELDS},
                         group="with --bench (the bench command's flags, prefixed)")
    add_config_arguments(p, STAGES.get("build-ort").config_class(), QUANT_FIELDS,
                         group="ORT engine quantization (weight-only, onnxruntime.quantization MatMulNBits)")
    for stage, groups in stage_flags().items():
        for fields, prefix in groups:
            add_config_arguments(p, STAGES.get(stage).config_class(), fields, prefix=prefix, group=f"--backend {stage}")


def _stages(backend: str) -> set[str]:
    """The stages backend ``backend`` runs after calibrate (``UnknownNameError`` with "did you mean")."""
    from ..registry import BACKENDS

    return {step.stage for step in BACKENDS.get(backend).steps}


def run(args) -> dict:
    from ..pipeline import run_build
    from ..store import ArtifactStore

    t0 = time.perf_counter()
    store = ArtifactStore(args.workdir)
    calib_config, placement = calibrate_config_from_args(args)
    bench_config = _bench_config(args, placement) if args.bench else None
    stages = _stages(args.backend)
    _check_replacement(calib_config.replacement, args.backend)
    configs = {"build-ort": _ort_config(args, stages)}
    for stage in sorted(stages & set(stage_flags())):
        configs[stage] = _stage_config(stage, args)
    with progress_bar(not args.json) as (on_candidate, on_phase):
        res = run_build(args.model, calib_config, store, backend=args.backend, force=args.force,
                        bench_config=bench_config, configs=configs, on_phase=on_phase,
                        progress=on_candidate, placement=placement, keep_intermediates=args.keep_intermediates)
    plan = res.plan
    out = {"model": args.model, "backend": args.backend, "layers": list(plan.layers), "alphas": list(plan.alphas),
           "ppl": plan.ppl, "stages": {r.stage: {"artifact": str(r.artifact.path), "cached": r.artifact.cached,
                                               "seconds": round(r.seconds, 3), "peak_rss_so_far": r.peak_rss}
                                               for r in res.records},
           "all_cached": all(r.artifact.cached for r in res.records),
           "seconds": round(time.perf_counter() - t0, 3), "notes": res.notes, "preflight": res.preflight}
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


def render(result: dict, console) -> None:
    """The summary a person reads (``harp_trt.cli._summary``); ``--json`` prints ``result`` instead."""
    from ._summary import render_build

    render_build(result, console)


def _refusal(replacement: str, backend: str) -> tuple[str, str] | None:
    """(stage, why) of the first stage of ``backend`` whose format cannot hold ``replacement``'s
    fitted maps (``StageCli.refuses_fitted``), or None."""
    from ..registry import STAGES

    for stage in sorted(_stages(backend)):
        why = dict(STAGES.get(stage).cli.refuses_fitted).get(replacement)
        if why is not None:
            return stage, why
    return None


def _check_replacement(replacement: str, backend: str) -> None:
    """ConfigError before any work where ``backend`` cannot carry ``replacement`` (lmmse's biased
    hidden x hidden map in a GGUF or a TensorRT-LLM checkpoint), naming the backends that can."""
    from ..errors import ConfigError
    from ..registry import BACKENDS

    if (refused := _refusal(replacement, backend)) is not None:
        can = [b for b in BACKENDS.names() if _refusal(replacement, b) is None]
        raise ConfigError(f"--replacement {replacement} cannot go to --backend {backend} (stage {refused[0]}): "
                          f"{refused[1]}", f"build it with --backend {' | '.join(can)}, or --replacement rrr")


def _stage_config(stage: str, args):
    """``stage``'s config from its ``stage_flags()``."""
    from ..registry import STAGES
    from ._options import values_from_args

    cls = STAGES.get(stage).config_class()
    return cls.from_dict({k: v for fields, prefix in stage_flags()[stage]
                          for k, v in values_from_args(cls, args, fields, prefix=prefix).items()})


def _ort_config(args, stages: set[str] | None = None):
    """The ORT engine's config; ``ConfigError`` for --quant on a backend that builds no ORT engine
    (``stages``: the backend's, ``_stages(args.backend)`` by default)."""
    from ..registry import BACKENDS, STAGES

    stages = _stages(args.backend) if stages is None else stages
    if args.quant != "none" and "build-ort" not in stages:
        from ..errors import ConfigError

        ort = [name for name in BACKENDS.names() if "build-ort" in _stages(name)]
        raise ConfigError(f"--quant applies to the ORT engine (backends {', '.join(ort)}), not {args.backend}",
                          next((h for s in sorted(stages) if (h := STAGES.get(s).cli.own_quant)), None))
    return config_from_args(STAGES.get("build-ort").config_class(), args, QUANT_FIELDS)


def _bench_config(args, placement):
    from ..registry import BACKENDS, STAGES
    from ._options import values_from_args

    BenchConfig = STAGES.get("bench").config_class()
    spec = BACKENDS.get(args.backend)  # "did you mean"
    values = values_from_args(BenchConfig, args, BENCH_FIELDS, prefix="bench-")
    engine = values.pop("engine", None) or spec.bench
    # an engine this backend builds for, checked before any work
    spec.bench_engines(BenchConfig.check_engine(engine), f"backend {args.backend}")
    model = not spec.bench_engines(engine)  # the bench loads the model itself (torch): --device/--dtype apply
    return BenchConfig.from_dict({
        "engine": engine, **values, "corpus": args.corpus,
        "dtype": placement.dtype if model else "float32",
        "device": placement.kind if model else "cpu"})
