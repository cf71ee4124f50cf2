"""The export stage's settings. Light on purpose (no torch, no onnx): the CLI builds its flags
from the fields' ``option`` declarations."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import StageConfig
from ..stage_spec import StageSpec
from ..errors import ConfigError

__all__ = ["ExportConfig"]


@dataclass(frozen=True)
class ExportConfig(StageConfig):
    """``opset``: ONNX opset (>= 23). ``verify_atol``: logits tolerance relative to max|logits|.
    ``storage``: ``full`` (every weight at ``dtype``) or ``compact`` (fp32 graph whose weights read
    from bf16/fp16 files stay at that width on disk behind an exact Cast: ``harp_trt.compact``; the
    quantized large-model path). ``probe``: export the plan's probe model (``harp_trt.probe``)
    instead of the full one (takes a ``plan`` input)."""

    VERSION = 2
    opset: int = 23
    verify_atol: float = 1e-4
    dtype: str = "float32"   # float16 / bfloat16 graphs for GPU engines (onnxruntime-gpu)
    storage: str = "full"
    probe: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.opset < 23:
            raise ConfigError(f"ExportConfig.opset must be >= 23, got {self.opset}")
        if not 0 < self.verify_atol < 1:
            raise ConfigError(f"ExportConfig.verify_atol must lie in (0, 1), got {self.verify_atol}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"ExportConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.storage not in ("full", "compact"):
            raise ConfigError(f"ExportConfig.storage must be full or compact, got {self.storage!r}")
        if self.storage == "compact" and self.dtype != "float32":
            raise ConfigError("ExportConfig.storage='compact' applies to float32 graphs")


STAGE = StageSpec("export", "harp_trt.export.export:ExportStage", "harp_trt.export.config:ExportConfig", "export",
                  "dense ONNX graph with a KV cache")
