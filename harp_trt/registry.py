"""The pipeline's one registry: its stages and backends as lazy ``"module:Class"`` entries that the
pipeline walks and the CLI reads (``harp_trt.lazy.Registry``: nothing heavy is imported to list or
check a name)."""
from __future__ import annotations

from dataclasses import dataclass

from .lazy import Registry, load_object, package_modules
from .stage_spec import DeployTarget, StageCli, StageSpec

__all__ = ["Registry", "load_object", "StageSpec", "StageCli", "DeployTarget", "Step", "BackendSpec", "Engines",
           "STAGES", "BACKENDS", "PHASES"]


# ---- the pipeline's stages and backends: the one registry the pipeline and the CLI walk ---------
@dataclass(frozen=True)
class Step:
    """One pipeline step: run stage ``stage`` and record its artifact as ``name``. ``inputs`` maps
    the stage's input names to earlier steps' names (or ``"model"`` / ``"plan"``). ``when``:
    ``always`` or ``bench`` (only when the bench that follows compares engines that need this step:
    its ``BackendSpec.bench_engines`` name it or a step reading it). The backend declares the rest
    beside its stage, as lazy ``"module:function"`` strings called with the step's stage config:
    ``only_if`` (run only when it answers true) and ``adjust`` (the config the step runs with)."""

    name: str
    stage: str
    inputs: tuple[tuple[str, str], ...]
    when: str = "always"
    only_if: str = ""
    adjust: str = ""


Engines = tuple[tuple[str, str], ...]  # variant ("dense", "harp", "dense_fp32"...) -> step name


@dataclass(frozen=True)
class BackendSpec:
    """A ``harp-trt build --backend``: its steps after calibrate; ``bench``, the bench engine
    (``harp_trt.bench.stage.config.ENGINES``) that ``build --bench`` runs unless told otherwise, and
    ``engines``, the steps whose artifacts it compares (``variant -> step``; empty: the bench
    engine loads the plan's model itself, as ``torch`` does). ``also``: other bench engines the
    backend's artifacts serve, each with its own ``variant -> step`` table. ``after``: lazy
    ``"module:function"`` called with the run's artifacts (step name -> ``Artifact``) after the
    steps, returning notes for the user (e.g. what is left to run elsewhere). ``configure``: lazy
    ``"module:function"`` called with the run's stage configs (stage name -> config), returning
    those it replaces (the ORT backend stores a quantized run's intermediates compactly).
    ``preflight``: lazy ``"module:function"`` called with the resolved model, the stage configs
    and the cache folder before any work, raising ``ResourceError`` when the run cannot fit."""

    steps: tuple[Step, ...]
    engines: Engines
    help: str
    bench: str = "torch"
    also: tuple[tuple[str, Engines], ...] = ()
    after: str = ""
    configure: str = ""
    preflight: str = ""

    def bench_names(self) -> list[str]:
        return [self.bench, *(name for name, _ in self.also)]

    def bench_engines(self, engine: str, backend: str = "this backend") -> Engines:
        """``variant -> step`` of the engines bench engine ``engine`` compares (empty: it loads the
        model); ``ConfigError`` for a bench engine this backend builds nothing for."""
        table = {self.bench: self.engines, **dict(self.also)}
        if engine not in table:
            from .errors import ConfigError

            raise ConfigError(f"{backend} builds no engines for the {engine} bench; its bench engines: "
                              f"{', '.join(self.bench_names())}", "pick one of them with --bench-engine, or "
                              "another --backend")
        return table[engine]


PHASES = ("calibrate", "export", "rewrite", "build", "bench")  # pipeline order, for --force

# Where stages live: a package here, or a package directly under one, whose ``config`` module
# defines ``STAGE`` (a ``StageSpec``) is a stage. A new stage is a folder; no line is added here.
STAGE_ROOTS = ("harp_trt.calib", "harp_trt.export", "harp_trt.rewrite", "harp_trt.builders", "harp_trt.bench.stage")


def find_stages(roots: tuple[str, ...] = STAGE_ROOTS) -> list[StageSpec]:
    """The ``STAGE`` of every ``config`` module in ``roots`` and the packages directly under them,
    in name order. Config modules are light (the CLI reads them for flags); nothing else loads."""
    import importlib

    found = []
    for root in roots:
        for pkg in [root] + [f"{root}.{m.name}" for m in package_modules(root) if m.ispkg]:
            if any(m.name == "config" and not m.ispkg for m in package_modules(pkg)):
                spec = getattr(importlib.import_module(f"{pkg}.config"), "STAGE", None)
                if spec is not None:
                    if not isinstance(spec, StageSpec):
                        raise TypeError(f"{pkg}.config.STAGE is not a harp_trt.stage_spec.StageSpec")
                    found.append(spec)
    return sorted(found, key=lambda s: s.name)


STAGES: Registry[StageSpec] = Registry("stage", discover=lambda: ((s.name, s) for s in find_stages()))

_ORT_QUANTIZED, _ORT_EXACT = "harp_trt.builders.ort.steps:quantized", "harp_trt.builders.ort.steps:exact"
_ORT_STEPS = (
    Step("export", "export", (("model", "model"),)),
    # a compact (quantized, large-model) run checks its rewrite through the plan's probe model
    Step("export:probe", "export", (("model", "model"), ("plan", "plan")), only_if="harp_trt.export.steps:compact",
         adjust="harp_trt.export.steps:probe"),
    Step("rewrite", "rewrite", (("plan", "plan"), ("export", "export"), ("model", "model"),
                                ("probe", "export:probe"))),
    Step("build", "build-ort", (("onnx", "rewrite"),)),
    Step("build:dense", "build-ort", (("onnx", "export"),), when="bench"),
    Step("build:dense-fp32", "build-ort", (("onnx", "export"),), when="bench", only_if=_ORT_QUANTIZED,
         adjust=_ORT_EXACT),
    Step("build:harp-fp32", "build-ort", (("onnx", "rewrite"),), when="bench", only_if=_ORT_QUANTIZED,
         adjust=_ORT_EXACT),
)
_ORT_ENGINES = (("harp", "build"), ("dense", "build:dense"), ("dense_fp32", "build:dense-fp32"),
                ("harp_fp32", "build:harp-fp32"))
_MODEL = (("torch", ()),)  # the PyTorch reference bench: dense vs apply_harp on the plan's model
_GENAI_STEPS = _ORT_STEPS + (Step("build:genai", "genai", (("engine", "build"),)),
                             Step("build:genai-dense", "genai", (("engine", "build:dense"),), when="bench"))

BACKENDS: Registry[BackendSpec] = Registry("backend")
_ORT_HOOKS = dict(configure="harp_trt.builders.ort.steps:configure", preflight="harp_trt.builders.ort.steps:preflight")
BACKENDS.register("ort", BackendSpec(_ORT_STEPS, _ORT_ENGINES,
                                     "export + rewrite, then the ONNX Runtime engine (builders/ort)", "ort", _MODEL,
                                     **_ORT_HOOKS))
BACKENDS.register("triton", BackendSpec(_ORT_STEPS + (Step("build:triton", "triton", (("engine", "build"),)),),
                                        _ORT_ENGINES, "the ort engine wrapped as a Triton model repository", "ort",
                                        _MODEL, **_ORT_HOOKS))
BACKENDS.register("genai", BackendSpec(_GENAI_STEPS, (("harp", "build:genai"), ("dense", "build:genai-dense")),
                                       "the ort engine as an onnxruntime-genai folder (og.Model)", "genai",
                                       (("ort", _ORT_ENGINES), *_MODEL), **_ORT_HOOKS))
BACKENDS.register("trtllm", BackendSpec((Step("build", "trtllm", (("plan", "plan"), ("model", "model"))),), (),
                                        "TensorRT-LLM checkpoint + build_engine.sh (engine where tensorrt_llm imports)",
                                        after="harp_trt.builders.trtllm.steps:engine_note"))
BACKENDS.register("gguf", BackendSpec(
    (Step("build", "gguf", (("plan", "plan"), ("model", "model"))),
     Step("build:dense", "gguf", (("model", "model"),), when="bench")),  # no plan: the dense GGUF
    (("harp", "build"), ("dense", "build:dense")),
    "llama.cpp deci GGUF from the plan (optionally quantized by llama.cpp), verified in llama.cpp", "llamacpp", _MODEL))
