"""The export's step conditions, named by ``harp_trt.registry.Step`` entries as lazy
``"module:function"`` strings (light: no torch/onnx; called with the step's ``ExportConfig``)."""
from __future__ import annotations

import dataclasses

from .config import ExportConfig

__all__ = ["compact", "probe"]


def compact(config: ExportConfig) -> bool:
    """The probe export runs only beside a compact export (the quantized large-model path)."""
    return config.storage == "compact"


def probe(config: ExportConfig) -> ExportConfig:
    """The run's export config, for the plan's probe model (``harp_trt.probe``)."""
    return dataclasses.replace(config, probe=True)
