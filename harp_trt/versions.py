"""Library versions recorded in every artifact (and hashed where they change the result)."""
from __future__ import annotations

import importlib.metadata as md
import platform

import harp_trt

__all__ = ["library_versions"]

DEFAULT_PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "safetensors")


def library_versions(packages: tuple[str, ...] = DEFAULT_PACKAGES) -> dict[str, str]:
    out = {"python": platform.python_version(), "harp-trt": harp_trt.__version__}
    for pkg in packages:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
