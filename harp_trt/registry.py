"""The pipeline's one registry: its stages and backends as lazy ``"module:Class"`` entries that the
pipeline walks and the CLI reads (``harp_trt.lazy.Registry``: nothing heavy is imported to list or
check a name)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import DeployTarget, StageCli  # declared beside each stage's config
from .lazy import Registry, load_object

__all__ = ["Registry", "load_object", "StageSpec", "StageCli", "DeployTarget", "Step", "BackendSpec", "Engines",
           "STAGES", "BACKENDS", "PHASES"]


# ---- the pipeline's stages and backends: the one registry the pipeline and the CLI walk ---------
@dataclass(frozen=True)
class StageSpec:
    """A stage, named as its ``Stage.name``. ``stage``: ``"module:Class"`` of the ``harp_trt.stage.Stage``
    subclass (importing it loads the stage's runtime); ``config``: ``"module:Class"`` of its
    ``StageConfig``, in a light module (no torch/onnx) so the CLI can read defaults; ``phase``: the
    pipeline phase it belongs to (``--force PHASE`` reruns it and every later phase)."""

    stage: str
    config: str
    phase: str
    help: str

    def stage_class(self) -> type:
        from .stage import Stage

        cls = load_object(self.stage)
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise TypeError(f"{self.stage} is not a harp_trt.stage.Stage subclass")
        return cls

    def entry(self, target: str):
        """A public function of the stage's package, for the CLI's commands that are not one
        ``Stage.execute`` (``deploy triton --out``, the bench's gates): ``"name"`` in the stage's
        module, or ``".sub:name"`` in a module beside it; imported now."""
        import importlib.util

        module = importlib.import_module(self.stage.partition(":")[0])
        sub, _, attr = target.rpartition(":")
        if sub:
            module = importlib.import_module(importlib.util.resolve_name(sub, module.__package__))
        return getattr(module, attr)

    def cli(self) -> StageCli:
        """The stage's ``StageCli``: ``CLI`` of its config module (light), or none declared."""
        import importlib

        cli = getattr(importlib.import_module(self.config.partition(":")[0]), "CLI", StageCli())
        if not isinstance(cli, StageCli):
            raise TypeError(f"CLI of {self.config} is not a harp_trt.registry.StageCli")
        return cli

    def config_class(self) -> type:
        from .config import StageConfig

        cls = load_object(self.config)
        if not (isinstance(cls, type) and issubclass(cls, StageConfig)):
            raise TypeError(f"{self.config} is not a harp_trt.config.StageConfig subclass")
        return cls


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

STAGES: Registry[StageSpec] = Registry("stage")
STAGES.register("calibrate", StageSpec("harp_trt.calib.stage:CalibrateStage", "harp_trt.calib.config:CalibrateConfig", "calibrate",
                                       "score layers, choose P, search alpha (arXiv 2507.01900, Algorithm 1)"))
STAGES.register("export", StageSpec("harp_trt.export.export:ExportStage", "harp_trt.export.config:ExportConfig",
                                    "export", "dense ONNX graph with a KV cache"))
STAGES.register("rewrite", StageSpec("harp_trt.rewrite.stage:RewriteStage", "harp_trt.rewrite.config:RewriteConfig",
                                     "rewrite", "HARP graph surgery (Eq. 4-5), verified against PyTorch"))
STAGES.register("build-ort", StageSpec("harp_trt.builders.ort.builder:OrtBuildStage", "harp_trt.builders.ort.config:OrtBuildConfig",
                                       "build", "ONNX Runtime engine folder"))
STAGES.register("trtllm", StageSpec("harp_trt.builders.trtllm.stage:TrtllmCheckpointStage",
                                    "harp_trt.builders.trtllm.config:TrtllmCheckpointConfig", "build",
                                    "TensorRT-LLM checkpoint + build_engine.sh"))
STAGES.register("triton", StageSpec("harp_trt.builders.triton.stage:TritonRepoStage",
                                    "harp_trt.builders.triton.config:TritonRepoConfig", "build",
                                    "Triton model repository around an engine"))
STAGES.register("genai", StageSpec("harp_trt.builders.genai.stage:GenaiStage", "harp_trt.builders.genai.config:GenaiConfig", "build",
                                   "onnxruntime-genai folder (og.Model) around an engine"))
STAGES.register("gguf", StageSpec("harp_trt.builders.gguf.stage:GgufStage", "harp_trt.builders.gguf.config:GgufConfig", "build",
                                  "llama.cpp deci GGUF (HARP layers as linear attention), verified in llama.cpp"))
STAGES.register("bench", StageSpec("harp_trt.bench.stage.stage:BenchStage", "harp_trt.bench.stage.config:BenchConfig", "bench",
                                   "latency and accuracy, dense vs HARP"))

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
