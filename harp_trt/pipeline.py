"""``harp-trt build``: calibrate -> export -> rewrite -> build (-> bench), every stage cached.

The pipeline walks the registry (``harp_trt.registry``): ``BACKENDS[backend].steps`` name the
stages to run after calibrate and wire each stage's inputs to earlier steps' artifacts; every stage
class is imported from its ``"module:Class"`` entry only when its step runs. Each stage's artifact
key depends only on its config, its code version and its upstream keys/digests, so a rerun with
nothing changed is all cache hits (no model is loaded). ``force="rewrite"`` reruns that phase and
every later one.

The pipeline knows no backend and no option of one: a backend's steps, their conditions
(``Step.when``, ``Step.only_if``), their config adjustments (``Step.adjust``) and its closing notes
(``BackendSpec.after``) are declared in the registry, the conditions as lazy ``"module:function"``
strings that the backend implements beside its stage (e.g. ``builders/ort/steps.py``)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .config import StageConfig
from .errors import ConfigError
from .extras import check
from .memory import peak_rss_bytes
from .plan import Plan
from .registry import BACKENDS, PHASES, STAGES, BackendSpec, Engines, Step, load_object
from .stage import Hooks
from .store import Artifact, ArtifactStore

__all__ = ["StageRecord", "BuildResult", "run_build", "run_stage", "needed_steps"]

log = logging.getLogger(__name__)


@dataclass
class StageRecord:
    stage: str
    artifact: Artifact
    seconds: float
    peak_rss: int = 0   # the process's peak resident bytes so far, when the stage ended


@dataclass
class BuildResult:
    records: list[StageRecord] = field(default_factory=list)
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)
    preflight: dict[str, Any] | None = None

    def artifact(self, stage: str) -> Artifact | None:
        for r in self.records:
            if r.stage == stage:
                return r.artifact
        return None


def _forced(phase: str, force: str | None) -> bool:
    return force is not None and PHASES.index(phase) >= PHASES.index(force)


def needed_steps(spec: BackendSpec, engines: tuple[tuple[str, str], ...]) -> set[str]:
    """The steps the bench's engines are, and every step they read, transitively."""
    inputs = {step.name: [src for _, src in step.inputs] for step in spec.steps}
    todo, seen = [name for _, name in engines], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += inputs.get(name, [])
    return seen


def _step_config(step: Step, needed: set[str], config: StageConfig) -> StageConfig | None:
    """The config ``step`` runs with, or None when it does not run: a ``bench`` step only when the
    bench needs it; then the backend's ``only_if`` and ``adjust`` on its stage config."""
    if step.when == "bench" and step.name not in needed:
        return None
    if step.only_if and not load_object(step.only_if)(config):
        return None
    return load_object(step.adjust)(config) if step.adjust else config


def run_build(model_ref: str, calib_config, store: ArtifactStore, backend: str,
              force: str | None = None, bench_config=None, configs: Mapping[str, StageConfig] | None = None,
              on_phase: Callable[[str], None] | None = None, progress=None, placement=None,
              keep_intermediates: bool = True, engines: Engines | None = None) -> BuildResult:
    """Run the pipeline; returns the per-stage records (cached or built) and the plan. ``configs``
    maps registry stage names (``"build-ort"``, ``"trtllm"``...) to their configs; a stage not
    named runs with its config class's defaults, and one config builds every step of that stage
    alike (up to the step's ``adjust``). ``keep_intermediates=False`` drops the weights of an
    intermediate artifact (``Stage.intermediate``) once every step of the run that reads it has
    run (``harp_trt.store.ArtifactStore.prune``); a later run that needs them rebuilds them.
    ``engines`` (variant -> step, without ``bench_config``): bench-only steps to build as well, with
    no bench (a benchmark script's dense and HARP engines, not every engine the backend's bench reads)."""
    spec, bench_engines, configs = _checked(backend, bench_config, force, configs, engines)
    needed = needed_steps(spec, bench_engines)
    phase = on_phase or (lambda s: log.info(s))
    out = BuildResult()
    ctx: dict[str, Any] = {}
    made: dict[str, tuple] = {}   # step -> (stage, config, inputs): to rebuild a pruned artifact
    weights = _Intermediates(store, ctx, made, keep_intermediates)
    hooks = Hooks(progress=progress, on_phase=on_phase, placement=placement,
                  release=None if keep_intermediates else weights.release)

    def run(record: str, stage_name: str, config: StageConfig, inputs: dict[str, Any]) -> Artifact:
        entry = STAGES.get(stage_name)
        phase(f"{record} ...")
        t = time.perf_counter()
        stage = entry.stage_class()()
        prepared = stage.prepare(store, config, inputs, hooks)
        if store.get(stage.key(store, config, prepared)) is None or _forced(entry.phase, force):
            prepared = {k: restore(v) for k, v in prepared.items()}  # it will run: its inputs' files back
        art = stage.execute(store, config, prepared, force=_forced(entry.phase, force), allow_pruned=True)
        made[record] = (stage_name, config, inputs)
        out.records.append(StageRecord(record, art, time.perf_counter() - t, peak_rss_bytes()))
        return art

    def restore(art: Any) -> Any:  # a pruned input artifact, rebuilt (same key) by its step
        if not isinstance(art, Artifact) or not art.pruned:
            return art
        name = weights.name_of(art)
        stage_name, config, inputs = made[name]
        stage = STAGES.get(stage_name).stage_class()()
        inputs = {k: restore(v) for k, v in inputs.items()}
        phase(f"{name} (rebuilding its pruned weights) ...")
        t = time.perf_counter()
        ctx[name] = stage.execute(store, config, stage.prepare(store, config, inputs, hooks), force=True)
        out.records.append(StageRecord(f"{name}:rebuilt", ctx[name], time.perf_counter() - t, peak_rss_bytes()))
        weights.drop_rebuilt(inputs.values())
        return ctx[name]

    def config_of(stage_name: str) -> StageConfig:
        if stage_name not in configs:
            configs[stage_name] = STAGES.get(stage_name).config_class()()
        return configs[stage_name]

    _check_requirements(spec, bench_config, needed, configs)

    from .models import resolve_model

    resolved = resolve_model(model_ref, store.root)  # once: a GGUF or new folder is hashed here
    _configure(spec, configs, resolved)
    if spec.preflight:  # will it fit? said before calibrate's minutes (ResourceError, exit 2)
        out.preflight = load_object(spec.preflight)(resolved, configs, store.root, keep_intermediates)
    ctx["model"] = resolved
    ctx["calibrate"] = run("calibrate", "calibrate", calib_config, {"model": resolved})
    out.plan = ctx["plan"] = Plan.load(ctx["calibrate"].path)

    steps = [(step, c) for step in spec.steps if (c := _step_config(step, needed, config_of(step.stage))) is not None]
    for k, (step, config) in enumerate(steps):
        weights.at_step(steps, k, bench_engines)
        ctx[step.name] = run(step.name, step.stage, config, {n: ctx[src] for n, src in step.inputs if src in ctx})
        if not keep_intermediates:
            _prune_consumed(store, ctx, steps, k, bench_engines)
    if spec.after:
        out.notes += load_object(spec.after)(ctx)

    if bench_config is not None:
        source = {variant: ctx[name] for variant, name in bench_engines if name in ctx} if bench_engines else resolved
        run("bench", "bench", bench_config, {"calibrate": ctx["calibrate"], "source": source})
    return out


def _checked(backend: str, bench_config, force: str | None, configs,
             engines: Engines | None = None) -> tuple[BackendSpec, tuple, dict]:
    """(the backend's spec, the engines its bench compares or ``engines`` names (variant -> step;
    empty: the bench loads the model), the configs by stage name); typed errors first: unknown
    backend, bench engine, step, ``--force`` stage or stage name."""
    spec: BackendSpec = BACKENDS.get(backend)  # "did you mean"
    bench_engines = spec.bench_engines(bench_config.engine, f"backend {backend}") if bench_config is not None else ()
    if engines is not None:
        steps = {s.name for s in spec.steps}
        unknown = [name for _, name in engines if name not in steps]
        if bench_config is not None or unknown:
            raise ConfigError("run_build takes engines or bench_config, not both" if bench_config is not None else
                              f"backend {backend} has no step {unknown[0]!r}; its steps: {', '.join(sorted(steps))}")
        bench_engines = tuple(engines)
    if force is not None and force not in PHASES:
        raise ConfigError(f"--force takes a stage name; valid: {', '.join(PHASES)}, got {force!r}")
    configs = dict(configs or {})
    for name in configs:
        STAGES.check(name)
    return spec, bench_engines, configs


class _Intermediates:
    """When the weights of intermediate artifacts (``Stage.intermediate``) are dropped while a build
    runs, besides ``_prune_consumed`` after each step: an input a running step has finished reading
    (``Hooks.release``), and an input rebuilt only to rebuild another pruned artifact. Nothing
    with ``keep``; never an artifact a running or later step still reads."""

    def __init__(self, store: ArtifactStore, ctx: dict[str, Any], made: Mapping[str, tuple], keep: bool):
        self.store, self.ctx, self.made, self.keep = store, ctx, made, keep
        self.later: set[str] = set()     # steps only the steps after the running one read
        self.reading: set[str] = set()   # ... and the running one

    def at_step(self, steps: list, k: int, engines) -> None:
        self.later = {src for s, _ in steps[k + 1:] for _, src in s.inputs} | {name for _, name in engines}
        self.reading = self.later | {src for _, src in steps[k][0].inputs}

    def name_of(self, art: Any) -> str | None:
        """The step whose artifact ``art`` is (by key), or None."""
        return next((n for n in self.made if isinstance(self.ctx.get(n), Artifact)
                     and self.ctx[n].key == getattr(art, "key", None)), None)

    def _drop(self, art: Any, unless: set[str]) -> None:
        name = self.name_of(art)
        if not self.keep and name is not None and name not in unless:
            self.ctx[name] = _prune(self.store, self.made[name][0], self.ctx[name])

    def release(self, art: Artifact) -> None:
        """The running step is done reading ``art`` (the ORT build once its staged graph is written)."""
        self._drop(art, self.later)

    def drop_rebuilt(self, inputs) -> None:
        """``inputs`` were rebuilt for another artifact's rebuild, which is done (a second quantized
        build would otherwise hold the rebuilt export beside the rewrite and the engine)."""
        for v in inputs:
            self._drop(v, self.reading)


def _configure(spec: BackendSpec, configs: dict[str, StageConfig], resolved) -> None:
    """The backend's own choices across its stages' configs (e.g. compact intermediates)."""
    if spec.configure:
        for name in {s.stage for s in spec.steps}:
            configs.setdefault(name, STAGES.get(name).config_class()())
        configs.update(load_object(spec.configure)(configs, resolved))


def _prune_consumed(store: ArtifactStore, ctx: Mapping[str, Any], steps: list, done: int, engines) -> None:
    """Drop the weights of every intermediate artifact no step after ``done`` (nor the bench) reads."""
    later = {src for step, _ in steps[done + 1:] for _, src in step.inputs} | {name for _, name in engines}
    for step, _ in steps[:done + 1]:
        art = ctx.get(step.name)
        if step.name in later or not isinstance(art, Artifact) or art.pruned:
            continue
        if any(step.name == src for s, _ in steps[:done + 1] for _, src in s.inputs):
            ctx[step.name] = _prune(store, step.stage, art)  # type: ignore[index]


def _prune(store: ArtifactStore, stage_name: str, art: Artifact) -> Artifact:
    """``art`` with its stage's intermediate files dropped, where the stage declares them and
    this artifact has them (``Stage.prunable``); else ``art``."""
    stage = STAGES.get(stage_name).stage_class()
    if art.pruned or not stage.intermediate or not stage.prunable(art):
        return art
    return store.prune(art, stage.intermediate)


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
    def default(name: str) -> StageConfig:
        return configs.get(name) or STAGES.get(name).config_class()()

    steps = [(s.stage, c) for s in spec.steps if (c := _step_config(s, needed, default(s.stage))) is not None]
    for name, config in steps + ([("bench", bench_config)] if bench_config is not None else []):
        check(STAGES.get(name).stage_class()().requirements(config))

