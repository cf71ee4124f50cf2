"""ONNX Runtime backend: engine folders (optimized ``model.onnx`` + ``engine.json`` + tokenizer)
built from an exported or HARP-rewritten graph. See ``builder.py`` for the engine format and
``gqa.py`` for the GroupQueryAttention pass."""
from __future__ import annotations

__all__ = ["OrtBuilder", "OrtBuildConfig", "OrtBuildStage", "fuse_group_query_attention"]


def __getattr__(name):  # lazy: importing the package does not import onnxruntime
    if name == "OrtBuildConfig":
        from .config import OrtBuildConfig

        return OrtBuildConfig
    if name in ("OrtBuilder", "OrtBuildStage"):
        from . import builder

        return getattr(builder, name)
    if name == "fuse_group_query_attention":
        from .gqa import fuse_group_query_attention

        return fuse_group_query_attention
    raise AttributeError(name)
