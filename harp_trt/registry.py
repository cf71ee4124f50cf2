"""The pipeline's one registry: its stages and backends as lazy ``"module:Class"`` entries that the
pipeline walks and the CLI reads (``harp_trt.lazy.Registry``: nothing heavy is imported to list or
check a name)."""
from __future__ import annotations

from dataclasses import dataclass

from .lazy import Registry, load_object

__all__ = ["Registry", "load_object", "StageSpec", "Step", "BackendSpec", "STAGES", "BACKENDS", "PHASES"]


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
    ``always``, ``bench`` (only when an ORT bench follows) or ``bench-quant`` (only when that bench
    compares quantized engines, which adds the exact fp32 engines); ``fp32``: build unquantized."""

    name: str
    stage: str
    inputs: tuple[tuple[str, str], ...]
    when: str = "always"
    fp32: bool = False


@dataclass(frozen=True)
class BackendSpec:
    """A ``harp-trt build --backend``: its steps after calibrate, and which steps' artifacts are the
    engines an ORT bench compares (``variant -> step``)."""

    steps: tuple[Step, ...]
    engines: tuple[tuple[str, str], ...]
    help: str


PHASES = ("calibrate", "export", "rewrite", "build", "bench")  # pipeline order, for --force

STAGES: Registry[StageSpec] = Registry("stage")
STAGES.register("calibrate", StageSpec("calib.stage:CalibrateStage", "calib.config:CalibrateConfig", "calibrate",
                                       "score layers, choose P, search alpha (arXiv 2507.01900, Algorithm 1)"))
STAGES.register("export", StageSpec("harp_trt.rewrite.export:ExportStage", "harp_trt.rewrite.config:ExportConfig",
                                    "export", "dense ONNX graph with a KV cache"))
STAGES.register("rewrite", StageSpec("harp_trt.rewrite.stage:RewriteStage", "harp_trt.rewrite.config:RewriteConfig",
                                     "rewrite", "HARP graph surgery (Eq. 4-5), verified against PyTorch"))
STAGES.register("build-ort", StageSpec("builders.ort.builder:OrtBuildStage", "builders.ort.config:OrtBuildConfig",
                                       "build", "ONNX Runtime engine folder"))
STAGES.register("trtllm", StageSpec("builders.trtllm.stage:TrtllmCheckpointStage",
                                    "builders.trtllm.config:TrtllmCheckpointConfig", "build",
                                    "TensorRT-LLM checkpoint + build_engine.sh"))
STAGES.register("triton", StageSpec("builders.triton.repository:TritonRepoStage",
                                    "builders.triton.config:TritonRepoConfig", "build",
                                    "Triton model repository around an engine"))
STAGES.register("genai", StageSpec("builders.genai.stage:GenaiStage", "builders.genai.config:GenaiConfig", "build",
                                   "onnxruntime-genai folder (og.Model) around an engine"))
STAGES.register("gguf", StageSpec("builders.gguf.stage:GgufStage", "builders.gguf.config:GgufConfig", "build",
                                  "llama.cpp deci GGUF (HARP layers as linear attention), verified in llama.cpp"))
STAGES.register("bench", StageSpec("bench.stage:BenchStage", "bench.stage.config:BenchConfig", "bench",
                                   "latency and accuracy, dense vs HARP"))

_ORT_STEPS = (
    Step("export", "export", (("model", "model"),)),
    Step("rewrite", "rewrite", (("plan", "plan"), ("export", "export"), ("model", "model"))),
    Step("build", "build-ort", (("onnx", "rewrite"),)),
    Step("build:dense", "build-ort", (("onnx", "export"),), when="bench"),
    Step("build:dense-fp32", "build-ort", (("onnx", "export"),), when="bench-quant", fp32=True),
    Step("build:harp-fp32", "build-ort", (("onnx", "rewrite"),), when="bench-quant", fp32=True),
)
_ORT_ENGINES = (("harp", "build"), ("dense", "build:dense"), ("dense_fp32", "build:dense-fp32"),
                ("harp_fp32", "build:harp-fp32"))

BACKENDS: Registry[BackendSpec] = Registry("backend")
BACKENDS.register("ort", BackendSpec(_ORT_STEPS, _ORT_ENGINES,
                                     "export + rewrite, then the ONNX Runtime engine (builders/ort)"))
BACKENDS.register("triton", BackendSpec(_ORT_STEPS + (Step("build:triton", "triton", (("engine", "build"),)),),
                                        _ORT_ENGINES, "the ort engine wrapped as a Triton model repository"))
BACKENDS.register("genai", BackendSpec(_ORT_STEPS + (Step("build:genai", "genai", (("engine", "build"),)),),
                                       _ORT_ENGINES, "the ort engine as an onnxruntime-genai folder (og.Model)"))
BACKENDS.register("trtllm", BackendSpec((Step("build", "trtllm", (("plan", "plan"), ("model", "model"))),), (),
                                        "TensorRT-LLM checkpoint + build_engine.sh (engine where tensorrt_llm imports)"))
BACKENDS.register("gguf", BackendSpec(
    (Step("build", "gguf", (("plan", "plan"), ("model", "model"))),
     Step("build:dense", "gguf", (("model", "model"),), when="bench")),  # no plan: the dense GGUF
    (("harp", "build"), ("dense", "build:dense")),
    "llama.cpp deci GGUF from the plan (optionally quantized by llama.cpp), verified in llama.cpp"))
