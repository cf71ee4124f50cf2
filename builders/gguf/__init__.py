"""llama.cpp deploy target: a HARP plan + Hugging Face model -> a ``deci`` GGUF llama.cpp runs
unchanged (``writer.py``), optionally quantized by llama.cpp's own quantizer, verified against the
PyTorch HARP reference in llama.cpp itself (``probe.py``, ``stage.py``). Imports are lazy: importing
the package loads neither torch, gguf nor llama_cpp."""
from __future__ import annotations

import importlib

_EXPORTS = {"GgufConfig": "config", "GgufStage": "stage", "deploy_gguf": "stage", "write_deci_gguf": "writer"}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
