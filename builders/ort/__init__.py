"""ONNX Runtime backend: engine folders (optimized ``model.onnx`` + ``engine.json`` + tokenizer)
built from an exported or HARP-rewritten graph. See ``builder.py`` for the engine format and
``passes.py`` for the graph passes (``gqa.py``: the GroupQueryAttention fusion rule, ``quant.py``:
weight-only quantization)."""
from __future__ import annotations

__all__ = ["OrtBuilder", "OrtBuildConfig", "OrtBuildStage", "graph_passes"]


def __getattr__(name):  # lazy: importing the package does not import onnxruntime
    if name == "OrtBuildConfig":
        from .config import OrtBuildConfig

        return OrtBuildConfig
    if name in ("OrtBuilder", "OrtBuildStage"):
        from . import builder

        return getattr(builder, name)
    if name == "graph_passes":
        from .passes import graph_passes

        return graph_passes
    raise AttributeError(name)
