"""Build backends: turn an ONNX graph (dense export or HARP rewrite) into something that serves.

``BACKENDS`` is lazy: an entry is a ``"module:attr"`` string imported only when chosen, so
``import builders`` pulls in no runtime (onnxruntime, TensorRT-LLM, Triton). Add a backend with
one line: ``BACKENDS.register("name", "builders.name:NameBuilder")``. A builder has a ``backend``
name and ``build(onnx_path, out_dir, config=None, tokenizer_dir=None) -> dict``."""
from __future__ import annotations

from harp_trt.registry import Registry

__all__ = ["BACKENDS", "get_builder"]

BACKENDS: Registry = Registry("backend")
BACKENDS.register("ort", "builders.ort.builder:OrtBuilder")


def get_builder(name: str):
    """The builder class registered as ``name`` (raises UnknownNameError with "did you mean")."""
    return BACKENDS.get(name)
