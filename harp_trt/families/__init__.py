"""Model families. Look a family up by name (``FAMILIES.get("qwen2")``) or from a loaded model's
config (``family_of(config)``)."""
from __future__ import annotations

from ..errors import UnsupportedArchitectureError
from ..lazy import Registry
from .base import ROUTE_LINEAR, ROUTE_WINDOW1, FamilySpec, GgufTarget, TrtllmTarget

__all__ = ["FAMILIES", "FamilySpec", "TrtllmTarget", "GgufTarget", "ROUTE_LINEAR", "ROUTE_WINDOW1", "family_of",
           "family_for_model_type"]

# every module here but base is one family: its FAMILY, registered under the module's name (which
# is the family's name; tests/test_families.py checks both)
FAMILIES: Registry[type[FamilySpec]] = Registry("model family", FamilySpec)
FAMILIES.register_package(__name__, "FAMILY", skip=("base",))


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
