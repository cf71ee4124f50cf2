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
FAMILIES.register("qwen3", "harp_trt.families.qwen3:Qwen3Family")
FAMILIES.register("gemma3", "harp_trt.families.gemma3:Gemma3Family")


# model types we know and refuse, with why and what to use instead
REFUSED_MODEL_TYPES = {
    "gemma3": ("the multimodal Gemma3 (Gemma3ForConditionalGeneration: a vision tower plus the text model under "
               "language_model.*) is not supported; the text-only checkpoints (model_type gemma3_text, e.g. "
               "google/gemma-3-1b-pt, preset gemma3-1b) are"),
}


def family_for_model_type(model_type: str) -> FamilySpec:
    for name in FAMILIES:
        spec = FAMILIES.get(name)
        if model_type in spec.model_types:
            return spec()
    if model_type in REFUSED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}",
            "HARP's families: " + ", ".join(FAMILIES.names()))
    raise UnsupportedArchitectureError(
        f"unsupported architecture {model_type!r}; supported: {', '.join(FAMILIES.names())}",
        "HARP needs a decoder with separate q/k/v/o projections; open an issue for a new family",
    )


def family_of(config) -> FamilySpec:
    return family_for_model_type(getattr(config, "model_type", "?"))
