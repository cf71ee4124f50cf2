"""Typed errors. Every user-facing failure is a ``HarpError``: the CLI prints it in one or two
lines and exits with ``exit_code`` (2 for bad input)."""
from __future__ import annotations

__all__ = [
    "HarpError", "ConfigError", "UnknownNameError", "ModelError", "UnknownModelError",
    "UnsupportedArchitectureError", "HubUnavailableError", "CorruptWeightsError", "CorpusError",
    "CacheError", "StageError", "PreconditionError", "PostconditionError", "VerificationError",
    "GraphError", "GateError", "MissingDependencyError", "ResourceError",
]


class HarpError(Exception):
    """Base of every error harp-trt raises on purpose. ``hint`` says what to do next."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ConfigError(HarpError):
    """A config value or CLI flag is out of range or unknown."""


class UnknownNameError(ConfigError):
    """A registry lookup failed (strategy, backend, preset, family)."""


class ModelError(HarpError):
    """The model could not be resolved or loaded."""


class UnknownModelError(ModelError):
    pass


class UnsupportedArchitectureError(ModelError):
    pass


class HubUnavailableError(ModelError):
    pass


class CorruptWeightsError(ModelError):
    pass


class CorpusError(HarpError):
    """Calibration or evaluation text is missing or too short."""


class CacheError(HarpError):
    """The artifact cache is not usable (not writable, key not found)."""


class StageError(HarpError):
    """A stage failed; ``stage`` names it."""

    def __init__(self, stage: str, message: str, hint: str | None = None):
        super().__init__(f"[{stage}] {message}", hint)
        self.stage = stage


class PreconditionError(StageError):
    pass


class PostconditionError(StageError):
    pass


class VerificationError(StageError):
    """A numeric check against the PyTorch reference failed."""


class GraphError(StageError):
    """An ONNX graph could not be read or rewritten."""


class ResourceError(HarpError):
    """The run would not fit the machine's free memory or disk (said before any work)."""


class MissingDependencyError(HarpError):
    """An optional dependency is not installed; the message names the extra that installs it
    (``harp_trt.extras``)."""


class GateError(HarpError):
    """A benchmark regression gate fell short (exit 1, not a usage error)."""

    exit_code = 1
