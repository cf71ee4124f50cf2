"""Triton Inference Server model repositories for HARP artifacts: an ``onnxruntime`` model for ONNX
graphs (export / rewrite / ORT engine) and the tensorrtllm-backend ensemble for TensorRT-LLM
artifacts. Every ``config.pbtxt`` is checked against Triton's own ``model_config.proto`` (via
``tritonclient``); a server is needed only to run them. Imports are lazy."""
from __future__ import annotations

import importlib

# public name -> submodule that defines it
_EXPORTS = {
    "TritonRepoConfig": "config",
    "TensorSpec": "onnx_repo", "external_data_files": "onnx_repo", "onnx_io": "onnx_repo",
    "onnx_model_config": "onnx_repo",
    "model_metadata": "pbtxt", "parse_model_config": "pbtxt", "render_pbtxt": "pbtxt", "string_params": "pbtxt",
    "ArtifactInfo": "artifact", "inspect_artifact": "artifact", "validate_repository": "validate",
    "TritonRepoStage": "stage", "write_repository": "stage",
    "TEMPLATE_KEYS": "trtllm_repo", "TRTLLM_MODELS": "trtllm_repo", "trtllm_model_configs": "trtllm_repo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
