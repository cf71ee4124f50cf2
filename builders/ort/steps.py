"""The ORT backend's step conditions, named by its ``harp_trt.registry.Step`` entries as lazy
``"module:function"`` strings (light: no onnx/torch; the pipeline calls them with the step's
``OrtBuildConfig``)."""
from __future__ import annotations

import dataclasses

from .config import OrtBuildConfig

__all__ = ["quantized", "exact"]


def quantized(config: OrtBuildConfig) -> bool:
    """The exact (fp32) engines behind the bench's ``perplexity_fp32`` row are built only when the
    run's ORT engines are quantized (otherwise the engines are already exact)."""
    return config.quant != "none"


def exact(config: OrtBuildConfig) -> OrtBuildConfig:
    """The run's ORT config, unquantized: the exact engine of the same graph."""
    return dataclasses.replace(config, quant="none")
