"""Triton Inference Server model repositories for HARP artifacts: an ``onnxruntime`` model for ONNX
graphs (export / rewrite / ORT engine) and the tensorrtllm-backend ensemble for TensorRT-LLM
artifacts. Every ``config.pbtxt`` is checked against Triton's own ``model_config.proto`` (via
``tritonclient``); a server is needed only to run them."""
from .onnx_repo import TensorSpec, external_data_files, onnx_io, onnx_model_config
from .pbtxt import model_metadata, parse_model_config, render_pbtxt, string_params
from .repository import (ArtifactInfo, TritonRepoConfig, TritonRepoStage, inspect_artifact, validate_repository,
                         write_repository)
from .trtllm_repo import TEMPLATE_KEYS, TRTLLM_MODELS, trtllm_model_configs

__all__ = ["write_repository", "validate_repository", "inspect_artifact", "TritonRepoConfig", "TritonRepoStage",
           "ArtifactInfo", "onnx_io", "onnx_model_config", "external_data_files", "TensorSpec",
           "trtllm_model_configs", "TRTLLM_MODELS", "TEMPLATE_KEYS", "render_pbtxt", "parse_model_config",
           "model_metadata", "string_params"]
