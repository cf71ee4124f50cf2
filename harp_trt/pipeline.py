"""``harp-trt build``: calibrate -> export -> rewrite -> build (-> bench), every stage cached.

Each stage's artifact key depends only on its config and its upstream keys/digests, so a rerun
with nothing changed is all cache hits (no model is loaded). ``force="rewrite"`` reruns that stage
and every stage after it. Backends:

- ``ort``    export + rewrite, then the ONNX Runtime engine (``builders/ort``); with bench, the
             dense engine is built too so both are measured on the same backend.
- ``trtllm`` TensorRT-LLM checkpoint + build_engine.sh from the plan (``builders/trtllm``); the
             engine itself is built only where ``tensorrt_llm`` imports and a GPU exists.
- ``triton`` the ``ort`` engine wrapped as a Triton model repository (``builders/triton``)."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError
from .plan import Plan
from .store import Artifact, ArtifactStore

__all__ = ["STAGES", "BACKEND_NAMES", "StageRecord", "BuildResult", "run_build"]

log = logging.getLogger(__name__)

STAGES = ("calibrate", "export", "rewrite", "build", "bench")
BACKEND_NAMES = ("ort", "trtllm", "triton")


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


def _forced(stage: str, force: str | None) -> bool:
    base = stage.split(":")[0]
    return force is not None and STAGES.index(base) >= STAGES.index(force)


def run_build(model_ref: str, calib_config, store: ArtifactStore, backend: str = "ort",
              force: str | None = None, bench_config=None, trtllm_config=None, ort_config=None,
              on_phase: Callable[[str], None] | None = None, progress=None, placement=None) -> BuildResult:
    """Run the pipeline; returns the per-stage records (cached or built) and the plan.
    ``ort_config`` (an ``OrtBuildConfig``, e.g. ``quant="int4"``) builds both ORT engines alike."""
    if backend not in BACKEND_NAMES:
        import difflib

        close = difflib.get_close_matches(backend, BACKEND_NAMES, n=1)
        raise ConfigError(f"unknown backend {backend!r}; valid: {', '.join(BACKEND_NAMES)}",
                          f"did you mean {close[0]!r}?" if close else None)
    if force is not None and force not in STAGES:
        raise ConfigError(f"--force takes a stage name; valid: {', '.join(STAGES)}, got {force!r}")
    phase = on_phase or (lambda s: log.info(s))
    out = BuildResult()

    def step(name: str, fn: Callable[[bool], Artifact]) -> Artifact:
        phase(f"{name} ...")
        t = time.perf_counter()
        art = fn(_forced(name, force))
        out.records.append(StageRecord(name, art, time.perf_counter() - t))
        return art

    from calib import run_calibrate

    from .models import resolve_model

    resolved = resolve_model(model_ref, store.root)  # once: a GGUF or new folder is hashed here
    calib = step("calibrate", lambda f: run_calibrate(resolved, calib_config, store, force=f,
                                                      progress=progress, on_phase=on_phase, placement=placement))
    plan = out.plan = Plan.load(calib.path)

    engines: dict[str, Artifact] = {}
    if backend in ("ort", "triton"):
        from builders.ort.builder import OrtBuildConfig, OrtBuildStage

        from .rewrite.export import ExportConfig, ExportStage
        from .rewrite.stage import RewriteConfig, RewriteStage

        ort_config = ort_config or OrtBuildConfig()
        export = step("export", lambda f: ExportStage().execute(store, ExportConfig(), {"model": resolved}, force=f))
        rewrite = step("rewrite", lambda f: RewriteStage().execute(
            store, RewriteConfig(), {"plan": plan, "export": export, "model": resolved}, force=f))
        engines["harp"] = step("build", lambda f: OrtBuildStage().execute(
            store, ort_config, {"onnx": rewrite}, force=f))
        if bench_config is not None and bench_config.engine == "ort":
            engines["dense"] = step("build:dense", lambda f: OrtBuildStage().execute(
                store, ort_config, {"onnx": export}, force=f))
            if ort_config.quant != "none":  # the exact fp32 engines, for the bench's perplexity_fp32 row
                fp32 = dataclasses.replace(ort_config, quant="none")
                engines["dense_fp32"] = step("build:dense-fp32", lambda f: OrtBuildStage().execute(
                    store, fp32, {"onnx": export}, force=f))
                engines["harp_fp32"] = step("build:harp-fp32", lambda f: OrtBuildStage().execute(
                    store, fp32, {"onnx": rewrite}, force=f))
        if backend == "triton":
            from builders.triton import TritonRepoConfig, TritonRepoStage

            step("build:triton", lambda f: TritonRepoStage().execute(
                store, TritonRepoConfig(), {"engine": engines["harp"]}, force=f))
    else:
        step("build", lambda f: _trtllm(store, plan, resolved, trtllm_config, f))
        if not _trtllm_importable():
            out.notes.append("TensorRT-LLM is not importable here: stopped after the checkpoint; run "
                             f"{out.artifact('build').path / 'build_engine.sh'} on a GPU host")

    if bench_config is not None:
        from bench.stage import run_bench

        source = engines if bench_config.engine == "ort" else resolved
        step("bench", lambda f: run_bench(calib, source, bench_config, store, force=f, on_phase=on_phase))
    return out


def _trtllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorrt_llm") is not None


def _trtllm(store: ArtifactStore, plan: Plan, resolved, config, force: bool) -> Artifact:
    """The checkpoint stage reads weights from the resolved model's files only on a cache miss."""
    from builders.trtllm.stage import TrtllmCheckpointConfig, TrtllmCheckpointStage

    return TrtllmCheckpointStage().execute(store, config or TrtllmCheckpointConfig(),
                                           {"plan": plan, "model": resolved}, force=force)
