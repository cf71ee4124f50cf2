"""``TritonRepoConfig``: how a Triton model repository is written. Light on purpose: the CLI builds
its flags from the fields' ``option`` declarations."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import DeployTarget, StageCli, StageSpec
from harp_trt.errors import ConfigError

from .releases import DEFAULT_TRITON_RELEASE, KNOWN_RELEASES

__all__ = ["TritonRepoConfig", "CLI"]

ORT, LLM = "ONNX Runtime model", "TensorRT-LLM models"  # help sections


@dataclasses.dataclass(frozen=True)
class TritonRepoConfig(StageConfig):
    """How the repository is written.

    ONNX: ``model_name`` (folder and model name), ``serving`` (``python``: a text-in/text-out
    Python-backend model generating inside the server with the vLLM backend's I/O; ``onnx``: the
    graph on Triton's onnxruntime backend, the client keeps the KV cache), ``device`` (``cpu`` ->
    KIND_CPU, ``gpu`` -> KIND_GPU instances), ``instances``, ``threads`` (ORT intra-op threads; 0 =
    the engine's recorded count, else ORT's default: ``harp_trt.engine_spec.engine_threads``), ``link`` (hard-link model files instead of copying where the filesystem
    allows), ``max_active`` / ``kv_budget`` / ``max_input_len`` / ``max_seq_len`` (python serving: most
    sequences batched together, the KV memory that admits them, prompt and total token limits; 0 =
    the model's), and
    ``triton_release``: the tritonserver release the repository is for (onnx serving: its ONNX Runtime
    must load the graph; TensorRT-LLM: its TensorRT-LLM must be the one the checkpoint targets;
    default: the first release carrying that TensorRT-LLM, ``releases.DEFAULT_TRITON_RELEASE``).
    TensorRT-LLM: ``max_batch_size`` (0 = the engine's), ``engine_dir`` (path *as the server sees
    it*; empty = ``<artifact>/engine``, where build_engine.sh writes), ``tokenizer_dir`` (where to
    copy the tokenizer from; empty = the artifact's ``hf/`` or the plan's model folder), and the
    tensorrtllm-backend settings of the same names."""

    VERSION: ClassVar[int] = 3
    model_name: str = option("harp", group=ORT, help="Triton model name (default %(default)s)")
    serving: str = option("python", group=ORT, choices=("python", "onnx"), help=(
        "python: text in/out, generation + KV cache + batching inside the server (vLLM-backend I/O); onnx: "
        "Triton's onnxruntime backend, the client keeps the cache (default %(default)s)"))
    device: str = option("cpu", group=ORT, choices=("cpu", "gpu"),
                         help="instance kind: cpu -> KIND_CPU, gpu -> KIND_GPU (default %(default)s)")
    instances: int = option(1, group=ORT, help="model instances (default %(default)s)")
    threads: int = option(0, group=ORT, help="ONNX Runtime intra-op threads, 0 = the engine's, else ORT's default (default %(default)s)")
    link: bool = option(True, group=ORT, flag="--copy", negate=True,
                        help="copy model files instead of hard-linking them")
    max_batch_size: int = option(0, group=LLM, help="Triton max batch size, 0 = the engine's (default %(default)s)")
    engine_dir: str = option("", group=LLM, help=(
        "engine folder as the server sees it (default: <artifact>/engine, where build_engine.sh writes)"))
    tokenizer_dir: str = option("", group=LLM, help=(
        "tokenizer folder to copy (default: the artifact's hf/ or the plan's model folder)"))
    kv_cache_free_gpu_mem_fraction: float = option(0.9, group=LLM, help="(default %(default)s)")
    batching_strategy: str = option("inflight_fused_batching", group=LLM, choices=("inflight_fused_batching",),
                                    help="(default %(default)s; 1.x executors refuse V1 at model load)")
    batch_scheduler_policy: str = option("guaranteed_no_evict", group=LLM,
                                         choices=("guaranteed_no_evict", "max_utilization"),
                                         help="(default %(default)s)")
    decoupled: bool = option(False, group=LLM, help="decoupled (streaming) tensorrt_llm model")
    exclude_input_in_output: bool = option(True, group=LLM, flag="--include-input", negate=True,
                                           help="return the prompt with the output text")
    enable_kv_cache_reuse: bool = option(False, group=LLM, flag="--kv-cache-reuse",
                                         help="enable KV cache reuse (prefix caching)")
    max_queue_delay_microseconds: int = option(0, group=LLM, flag="--max-queue-delay-us",
                                               help="(default %(default)s)")
    max_queue_size: int = 0
    preprocessing_instances: int = option(1, group=LLM, help="(default %(default)s)")
    postprocessing_instances: int = option(1, group=LLM, help="(default %(default)s)")
    max_active: int = option(0, group=ORT, help=(
        "python serving: most sequences decoded together; 0 = as many as --kv-budget admits, 8 without a budget "
        "(default %(default)s)"))
    kv_budget: str = option("", group=ORT, help=(
        "python serving: KV memory the admitted sequences may hold at their longest (prompt + max_tokens), as a "
        "size (2GiB, 512MiB) or a share of the memory free when the server loads the model (0.4 or 40%%); the "
        "rest queue (default: none, --max-active alone bounds it)"))
    max_input_len: int = option(0, group=ORT, flag="--prompt-limit", help=(
        "python serving: longest prompt in tokens, 0 = the model's context (default %(default)s)"))
    max_seq_len: int = option(0, group=ORT, flag="--context-limit", help=(
        "python serving: prompt + max_tokens limit, 0 = the model's context (default %(default)s)"))
    triton_release: str = option(DEFAULT_TRITON_RELEASE, help=(
        "tritonserver release (YY.MM) to serve with: onnx serving: its ONNX Runtime must load the graph; "
        "TensorRT-LLM: it must carry the TensorRT-LLM the checkpoint targets (default %(default)s, the first "
        "release that carries it)"))

    def validate(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ConfigError(f"device must be 'cpu' or 'gpu', got {self.device!r}",
                              "cpu -> KIND_CPU instances, gpu -> KIND_GPU instances")
        if not self.model_name or not all(c.isalnum() or c in "_-." for c in self.model_name) \
                or self.model_name in ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm"):
            raise ConfigError(f"model_name {self.model_name!r} is not a usable Triton model name",
                              "use letters, digits, '_', '-' or '.'")
        self.check_ints(("instances", "preprocessing_instances", "postprocessing_instances"), 1)
        self.check_ints(("threads", "max_active", "max_batch_size", "max_queue_delay_microseconds", "max_queue_size",
                         "max_input_len", "max_seq_len"), 0)
        if not 0.0 < float(self.kv_cache_free_gpu_mem_fraction) <= 1.0:
            raise ConfigError(f"kv_cache_free_gpu_mem_fraction must lie in (0, 1], got "
                              f"{self.kv_cache_free_gpu_mem_fraction!r}")
        if self.batching_strategy != "inflight_fused_batching":
            # V1 would load as BatchingType::kSTATIC (the backend's ModelInstanceState::getBatchingTypeFromParams),
            # which the 1.x executor refuses when it creates the model: cpp/tensorrt_llm/executor/executorImpl.cpp
            # Executor::Impl::createModel throws "Static batching type is deprecated ..." (docs/trtllm-contract.md,
            # row tb-batching)
            raise ConfigError(f"batching_strategy must be 'inflight_fused_batching', got {self.batching_strategy!r}",
                              "TensorRT-LLM 1.x refuses V1 (static batching) when it loads the model (\"Static "
                              "batching type is deprecated\"): use inflight_fused_batching")
        if self.kv_budget:
            from harp_trt.memory import kv_budget_bytes

            kv_budget_bytes(self.kv_budget, available=lambda: 1)  # its form only: the share is of the server's memory
        if self.serving not in ("python", "onnx"):
            raise ConfigError(f"serving must be 'python' (text in/out, generation in the server) or 'onnx' "
                              f"(Triton's onnxruntime backend), got {self.serving!r}")
        if self.triton_release not in KNOWN_RELEASES:
            raise ConfigError(f"unknown triton_release {self.triton_release!r}; known: {', '.join(KNOWN_RELEASES)}")
        if self.batch_scheduler_policy not in ("guaranteed_no_evict", "max_utilization"):
            raise ConfigError(f"batch_scheduler_policy must be 'guaranteed_no_evict' or 'max_utilization', "
                              f"got {self.batch_scheduler_policy!r}")


CLI = StageCli(deploy=DeployTarget(
    help="Triton model repository for an ONNX or TensorRT-LLM artifact",
    description="write a Triton model repository (config.pbtxt checked against Triton's schema, client.py, "
                "README.md) for an ONNX or TensorRT-LLM artifact",
    source="artifact", deploy="write_repository", summary="deploy_summary", out="required",
    artifact_help="export/rewrite/ORT-engine folder with model.onnx, or a trtllm artifact (folder or cache key)",
    out_help="model repository folder to write (must be new or empty)",
    force_help="replace --out if it exists and is not empty"))

STAGE = StageSpec("triton", "harp_trt.builders.triton.stage:TritonRepoStage", "harp_trt.builders.triton.config:TritonRepoConfig", "build",
                  "Triton model repository around an engine", CLI)
