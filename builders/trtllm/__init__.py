"""TensorRT-LLM build stage: HARP-pruned checkpoints (``config.json`` + ``rank{N}.safetensors``), an
HF heterogeneous (DeciLM ``block_configs``) checkpoint where the family allows it, and the
``trtllm-build`` command. Nothing here imports ``tensorrt_llm``; ``reader.py`` verifies a written
checkpoint in plain PyTorch."""
from .checkpoint import DTYPES, ModelDims, check_layout, pp_layers, valid_tp_sizes, write_checkpoint
from .hf_format import write_hf_decilm
from .reader import TrtllmCheckpoint, read_checkpoint, read_hf_decilm
from .stage import TrtllmCheckpointConfig, TrtllmCheckpointStage, build_command
from .targets import TARGETS, TrtllmTarget, target_for

__all__ = ["TrtllmCheckpointStage", "TrtllmCheckpointConfig", "build_command", "write_checkpoint",
           "write_hf_decilm", "read_checkpoint", "read_hf_decilm", "TrtllmCheckpoint", "TARGETS", "TrtllmTarget",
           "target_for", "DTYPES", "ModelDims", "check_layout", "pp_layers", "valid_tp_sizes"]
