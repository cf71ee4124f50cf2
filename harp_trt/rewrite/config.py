"""The rewrite stage's settings. Light on purpose (no torch, no onnx): the CLI builds
its flags from the fields' ``option`` declarations."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import StageConfig, option
from ..stage_spec import StageSpec
from ..errors import ConfigError
from ..onnx_io import EXTERNAL_DATA_THRESHOLD, PROTOBUF_LIMIT

__all__ = ["RewriteConfig"]


@dataclass(frozen=True)
class RewriteConfig(StageConfig):
    """``verify``: run the ORT-vs-PyTorch check. ``rtol``: logits tolerance relative to
    ``max(1, max|logits|)``. ``decode_steps`` / ``greedy_steps``: decode steps whose logits /
    greedy tokens are compared. ``external_data_mb``: initializers above this total go to
    ``model.onnx.data`` (protobuf cannot exceed 2 GB)."""

    VERSION = 1
    verify: bool = option(True, flag="--no-verify", negate=True, help="skip the ONNX Runtime vs PyTorch check")
    rtol: float = option(1e-4, help="logits tolerance relative to max(1, max|logits|) (default %(default)g)")
    decode_steps: int = option(16, help="decode steps whose logits are compared (default %(default)s)")
    greedy_steps: int = option(32, help="decode steps whose greedy tokens must match (default %(default)s)")
    external_data_mb: int = EXTERNAL_DATA_THRESHOLD >> 20  # the contract's threshold, in MiB (1907)

    def validate(self) -> None:
        if not 0 < self.rtol < 1:
            raise ConfigError(f"RewriteConfig.rtol must lie in (0, 1), got {self.rtol}")
        if self.decode_steps < 0 or self.greedy_steps < 0:
            raise ConfigError("RewriteConfig.decode_steps and greedy_steps must be >= 0")
        if not 0 <= self.external_data_mb <= PROTOBUF_LIMIT >> 20:
            raise ConfigError(f"RewriteConfig.external_data_mb must lie in [0, {PROTOBUF_LIMIT >> 20}] "
                              f"(protobuf's limit), got {self.external_data_mb}")

    def verify_config(self):
        from ..verify import VerifyConfig

        return VerifyConfig(rtol=self.rtol, decode_steps=self.decode_steps, greedy_steps=self.greedy_steps)


STAGE = StageSpec("rewrite", "harp_trt.rewrite.stage:RewriteStage", "harp_trt.rewrite.config:RewriteConfig", "rewrite",
                  "HARP graph surgery (Eq. 4-5), verified against PyTorch")
