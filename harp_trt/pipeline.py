"""``harp-trt build``: calibrate -> export -> rewrite -> build (-> bench), every stage cached.

The pipeline walks the registry (``harp_trt.registry``): ``BACKENDS[backend].steps`` name the
stages to run after calibrate and wire each stage's inputs to earlier steps' artifacts; every stage
class is imported from its ``"module:Class"`` entry only when its step runs. Each stage's artifact
key depends only on its config, its code version and its upstream keys/digests, so a rerun with
nothing changed is all cache hits (no model is loaded). ``force="rewrite"`` reruns that phase and
every later one. Backends:

- ``ort``    export + rewrite, then the ONNX Runtime engine (``builders/ort``); with a bench, the
             dense engine is built too so both are measured on the same backend (which steps a
             bench needs follows from the engines ``BackendSpec.bench_engines`` names for it).
- ``trtllm`` TensorRT-LLM checkpoint + build_engine.sh from the plan (``builders/trtllm``); the
             engine itself is built only where ``tensorrt_llm`` imports and a GPU exists.
- ``triton`` the ``ort`` engine wrapped as a Triton model repository (``builders/triton``).
- ``genai``  the ``ort`` engine as a folder onnxruntime-genai opens (``builders/genai``); its bench
             compares the dense and HARP genai folders in onnxruntime-genai (``--bench-engine ort``:
             the ORT engines)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .config import StageConfig
from .errors import ConfigError
from .extras import check
from .plan import Plan
from .registry import BACKENDS, PHASES, STAGES, BackendSpec, Step
from .stage import Hooks
from .store import Artifact, ArtifactStore

__all__ = ["StageRecord", "BuildResult", "run_build", "run_stage"]

log = logging.getLogger(__name__)


@dataclass
class StageRecord:
    stage: str
    artifact: Artifact
    seconds: float

    def row(self) -> dict[str, Any]:
        return {"stage": self.stage, "status": "cached" if self.artifact.cached else "built",
                "seconds": round(self.seconds, 2), "artifact": str(self.artifact.path)}


@dataclass
class BuildResult:
    records: list[StageRecord] = field(default_factory=list)
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)

    def artifact(self, stage: str) -> Artifact | None:
        for r in self.records:
            if r.stage == stage:
                return r.artifact
        return None


def _forced(phase: str, force: str | None) -> bool:
    return force is not None and PHASES.index(phase) >= PHASES.index(force)


def _needed(spec: BackendSpec, engines: tuple[tuple[str, str], ...]) -> set[str]:
    """The steps the bench's engines are, and every step they read, transitively."""
    inputs = {step.name: [src for _, src in step.inputs] for step in spec.steps}
    todo, seen = [name for _, name in engines], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += inputs.get(name, [])
    return seen


def _wanted(step: Step, needed: set[str], configs: Mapping[str, StageConfig]) -> bool:
    if step.when == "bench":
        return step.name in needed
    if step.when == "bench-quant":
        return step.name in needed and getattr(configs.get(step.stage), "quant", "none") != "none"
    return True


def run_build(model_ref: str, calib_config, store: ArtifactStore, backend: str = "ort",
              force: str | None = None, bench_config=None, configs: Mapping[str, StageConfig] | None = None,
              on_phase: Callable[[str], None] | None = None, progress=None, placement=None) -> BuildResult:
    """Run the pipeline; returns the per-stage records (cached or built) and the plan. ``configs``
    maps registry stage names (``"build-ort"``, ``"trtllm"``...) to their configs; a stage not
    named runs with its config class's defaults. The ORT config (e.g. ``quant="int4"``) builds
    every ORT engine of the run alike."""
    spec: BackendSpec = BACKENDS.get(backend)  # "did you mean"
    # the engines the bench compares (variant -> step; empty: it loads the model); ConfigError first
    bench_engines = spec.bench_engines(bench_config.engine, f"backend {backend}") if bench_config is not None else ()
    needed = _needed(spec, bench_engines)
    if force is not None and force not in PHASES:
        raise ConfigError(f"--force takes a stage name; valid: {', '.join(PHASES)}, got {force!r}")
    configs = dict(configs or {})
    for name in configs:
        STAGES.check(name)
    hooks = Hooks(progress=progress, on_phase=on_phase, placement=placement)
    phase = on_phase or (lambda s: log.info(s))
    out = BuildResult()

    def run(record: str, stage_name: str, config: StageConfig, inputs: dict[str, Any]) -> Artifact:
        entry = STAGES.get(stage_name)
        phase(f"{record} ...")
        t = time.perf_counter()
        stage = entry.stage_class()()
        art = stage.execute(store, config, stage.prepare(store, config, inputs, hooks),
                            force=_forced(entry.phase, force))
        out.records.append(StageRecord(record, art, time.perf_counter() - t))
        return art

    def config_of(stage_name: str) -> StageConfig:
        if stage_name not in configs:
            configs[stage_name] = STAGES.get(stage_name).config_class()()
        return configs[stage_name]

    _check_requirements(spec, bench_config, needed, configs)

    from .models import resolve_model

    resolved = resolve_model(model_ref, store.root)  # once: a GGUF or new folder is hashed here
    ctx: dict[str, Any] = {"model": resolved}
    ctx["calibrate"] = run("calibrate", "calibrate", calib_config, {"model": resolved})
    out.plan = ctx["plan"] = Plan.load(ctx["calibrate"].path)

    for step in spec.steps:
        if not _wanted(step, needed, configs):
            continue
        config = config_of(step.stage)
        if step.fp32:  # the exact engines behind the bench's perplexity_fp32 row
            config = dataclasses.replace(config, quant="none")
        ctx[step.name] = run(step.name, step.stage, config, {k: ctx[src] for k, src in step.inputs})
    if backend == "trtllm" and not _trtllm_importable():
        out.notes.append("TensorRT-LLM is not importable here: stopped after the checkpoint; run "
                         f"{out.artifact('build').path / 'build_engine.sh'} on a GPU host")

    if bench_config is not None:
        source = {variant: ctx[name] for variant, name in bench_engines if name in ctx} if bench_engines else resolved
        run("bench", "bench", bench_config, {"calibrate": ctx["calibrate"], "source": source})
    return out


def run_stage(name: str, config: StageConfig, refs: Mapping[str, Any], store: ArtifactStore,
              force: bool = False, hooks: Hooks | None = None) -> Artifact:
    """One registered stage on its own (``harp-trt calibrate``, ``rewrite``, ``deploy trtllm``):
    ``prepare`` the references, then the cached ``execute``."""
    stage = STAGES.get(name).stage_class()()
    return stage.execute(store, config, stage.prepare(store, config, refs, hooks or Hooks()), force=force)


def _check_requirements(spec: BackendSpec, bench_config, needed: set[str],
                        configs: Mapping[str, StageConfig]) -> None:
    """``MissingDependencyError`` (``harp_trt.extras``) for the first optional dependency a step of
    this run needs and lacks: before calibrate's minutes, not after them."""
    steps = [(s.stage, configs.get(s.stage)) for s in spec.steps if _wanted(s, needed, configs)]
    for name, config in steps + ([("bench", bench_config)] if bench_config is not None else []):
        entry = STAGES.get(name)
        check(entry.stage_class()().requirements(config or entry.config_class()()))


def _trtllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_llm") is not None
