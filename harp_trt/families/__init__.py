"""Model families. Look a family up by name (``FAMILIES.get("qwen2")``) or from a loaded model's
config (``family_of(config)``)."""
from __future__ import annotations

from ..errors import UnsupportedArchitectureError
from ..lazy import Registry
from .base import ROUTE_LINEAR, ROUTE_WINDOW1, FamilySpec, GgufTarget, TrtllmTarget

__all__ = ["FAMILIES", "FamilySpec", "TrtllmTarget", "GgufTarget", "ROUTE_LINEAR", "ROUTE_WINDOW1", "family_of",
           "family_for_model_type"]

FAMILIES: Registry[type[FamilySpec]] = Registry("model family")
FAMILIES.register("llama", "harp_trt.families.llama:LlamaFamily")
FAMILIES.register("mistral", "harp_trt.families.mistral:MistralFamily")
FAMILIES.register("qwen2", "harp_trt.families.qwen2:Qwen2Family")
FAMILIES.register("gemma2", "harp_trt.families.gemma2:Gemma2Family")


def family_for_model_type(model_type: str) -> FamilySpec:
    for name in FAMILIES:
        spec = FAMILIES.get(name)
        if model_type in spec.model_types:
            return spec()
    raise UnsupportedArchitectureError(
        f"unsupported architecture {model_type!r}; supported: {', '.join(FAMILIES.names())}",
        "HARP needs a decoder with separate q/k/v/o projections; open an issue for a new family",
    )


def family_of(config) -> FamilySpec:
    return family_for_model_type(getattr(config, "model_type", "?"))
