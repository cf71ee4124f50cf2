"""The TensorRT-LLM backend's after-steps note, named by its ``harp_trt.registry.BackendSpec`` as a
lazy ``"module:function"`` string (light: ``tensorrt_llm`` is looked up, never imported)."""
from __future__ import annotations

import importlib.util
from typing import Any, Mapping

__all__ = ["engine_note"]


def engine_note(artifacts: Mapping[str, Any]) -> list[str]:
    """Where ``tensorrt_llm`` does not import, the build stops after the checkpoint: say where the
    engine script is (``artifacts``: step name -> ``Artifact``)."""
    if importlib.util.find_spec("tensorrt_llm") is not None:
        return []
    return ["TensorRT-LLM is not importable here: stopped after the checkpoint; run "
            f"{artifacts['build'].path / 'build_engine.sh'} on a GPU host"]
