"""``TrtllmCheckpointConfig``: the TensorRT-LLM build stage's settings. Light on purpose (no torch):
the CLI builds its flags from the fields' ``option`` declarations."""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import DeployTarget, StageCli, StageSpec
from harp_trt.errors import ConfigError
from harp_trt.versions import TRTLLM_VERSION  # the TensorRT-LLM these checkpoints target

__all__ = ["TrtllmCheckpointConfig", "DTYPE_NAMES", "TRTLLM_VERSION", "CLI"]

DTYPE_NAMES = ("float16", "bfloat16", "float32")  # checkpoint dtypes (the keys of checkpoint.DTYPES)


@dataclasses.dataclass(frozen=True)
class TrtllmCheckpointConfig(StageConfig):
    """Config of the TensorRT-LLM build stage. ``build``: ``auto`` runs ``build_engine.sh`` where
    ``tensorrt_llm`` imports and a GPU is present, ``never`` only writes it."""

    VERSION: ClassVar[int] = 1
    dtype: str = option("float16", help="float16 | bfloat16 | float32 (default %(default)s)")
    tp_size: int = option(1, flag="--tp", help="tensor-parallel GPUs (default %(default)s)")
    pp_size: int = option(1, flag="--pp", help="pipeline stages (default %(default)s)")
    max_batch_size: int = option(8, help="(default %(default)s)")
    max_input_len: int = option(1024, help="(default %(default)s)")
    max_seq_len: int = option(2048, help="(default %(default)s)")
    max_num_tokens: int = option(8192, help="(default %(default)s)")
    tokens_per_block: int = 32
    hf_format: bool = option(True, flag="--no-hf", negate=True, help="skip the HF DeciLM checkpoint")
    verify: bool = option(True, flag="--no-verify", negate=True, help=(
        "skip the read-back check (layer by layer against the PyTorch HARP reference)"))
    verify_tokens: int = 32
    build: str = option("auto", choices=("auto", "never"), help=(
        "auto: run trtllm-build where tensorrt_llm and GPUs exist (default %(default)s)"))

    def validate(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"unsupported TensorRT-LLM dtype {self.dtype!r}; valid: {', '.join(DTYPE_NAMES)}",
                              "fp16 -> float16, bf16 -> bfloat16, fp32 -> float32")
        self.check_ints(("tp_size", "pp_size", "max_batch_size", "max_input_len", "max_seq_len",
                         "max_num_tokens", "verify_tokens"), 1)
        if self.max_input_len > self.max_seq_len:
            raise ConfigError(f"max_input_len ({self.max_input_len}) exceeds max_seq_len ({self.max_seq_len})",
                              "max_seq_len counts prompt plus generated tokens")
        t = self.tokens_per_block
        if not isinstance(t, int) or t < 2 or t & (t - 1):
            raise ConfigError(f"tokens_per_block must be a power of two >= 2, got {t!r}")
        if self.build not in ("auto", "never"):
            raise ConfigError(f"build must be 'auto' or 'never', got {self.build!r}")


CLI = StageCli(
    build_flags=((("tp_size", "pp_size"), ""),),
    refuses_fitted=(("lmmse", "DeciLM's linear attention holds one hidden x hidden matrix without a bias "
                              "(folded from rrr's V/O): lmmse's bias has no place there"),),
    deploy=DeployTarget(
        help="TensorRT-LLM checkpoint + build_engine.sh for a HARP plan (verified in PyTorch)",
        description="write a TensorRT-LLM checkpoint + build_engine.sh for a HARP plan",
        source="plan", summary="deploy_summary", out="none",  # the pipeline runs the stage: a cached artifact
        force_help="rebuild even if the artifact is cached"))

STAGE = StageSpec("trtllm", "harp_trt.builders.trtllm.stage:TrtllmCheckpointStage", "harp_trt.builders.trtllm.config:TrtllmCheckpointConfig", "build",
                  "TensorRT-LLM checkpoint + build_engine.sh", CLI)
