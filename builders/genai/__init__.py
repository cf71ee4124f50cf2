"""onnxruntime-genai deploy target: an ORT engine folder -> a folder ``og.Model(folder)`` opens
(graph, tokenizer files, ``genai_config.json`` written from the engine's own metadata). See
``stage.py``. Imports are lazy: importing the package loads neither onnx nor onnxruntime-genai."""
from __future__ import annotations

import importlib

_EXPORTS = {"GenaiConfig": "config", "GenaiStage": "stage", "genai_config_for": "stage",
            "inspect_engine": "stage", "write_genai_folder": "stage", "measure_kv_rss": "probe"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
