"""Library versions recorded in every artifact (and hashed where they change the result), and the
versions of the external runtimes our artifacts are written for."""
from __future__ import annotations

import importlib.metadata as md
import platform

import harp_trt

__all__ = ["library_versions", "TRTLLM_VERSION"]

# The TensorRT-LLM our checkpoints and launch files are written for (docs/trtllm-contract.md reads its
# 1.2 source). An engine is built and served by one version: the trtllm manifest and every launch file
# name it, and the Triton image is chosen to carry it (builders/triton/releases.py). Defined here, in
# the core, because both harp_trt.builders.trtllm and harp_trt.builders.triton need it and no stage imports another.
TRTLLM_VERSION = "1.2.1"

DEFAULT_PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "safetensors")


def library_versions(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict[str, str]:
    out = {"python": platform.python_version(), "harp-trt": harp_trt.__version__}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
