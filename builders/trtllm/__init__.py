"""TensorRT-LLM build stage: HARP-pruned checkpoints (``config.json`` + ``rank{N}.safetensors``), an
HF heterogeneous (DeciLM ``block_configs``) checkpoint where the family allows it, and the
``trtllm-build`` command. Nothing here imports ``tensorrt_llm``; ``reader.py`` verifies a written
checkpoint in plain PyTorch. Imports are lazy: ``harp_trt.builders.trtllm.config`` stays free of torch."""
from __future__ import annotations

import importlib

# public name -> submodule that defines it
_EXPORTS = {
    "TrtllmCheckpointConfig": "config",
    "TrtllmCheckpointStage": "stage", "build_command": "stage",
    "write_checkpoint": "checkpoint", "DTYPES": "checkpoint",
    "check_layout": "checkpoint", "valid_tp_sizes": "checkpoint",
    "write_hf_decilm": "hf_format",
    "TrtllmCheckpoint": "reader", "read_checkpoint": "reader", "read_hf_decilm": "reader",
    "target_for": "targets",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
