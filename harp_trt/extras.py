"""Optional dependencies: which extra of ``pyproject.toml`` installs each, and one typed error when
one is missing.

The base install runs ``harp-trt build`` on the ort backend once an ONNX Runtime wheel is chosen:
``harp-trt[cpu]`` (onnxruntime) or ``harp-trt[gpu]`` (onnxruntime-gpu), never both, since the two
wheels install the same ``onnxruntime`` package over each other. What one optional stage alone
needs is an extra: ``eval`` (lm-eval, the bench's accuracy tasks), ``triton`` (tritonclient, the
Triton repository's config check), ``plots`` (matplotlib: the PNGs, skipped with a warning
without it), ``genai`` (onnxruntime-genai), ``gguf`` (llama-cpp-python: llama.cpp). Nothing here imports a library until asked."""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Iterable

from .errors import MissingDependencyError

__all__ = ["EXTRAS", "available", "require", "check", "figures_skipped"]

_IN_CHECKOUT = "pip install -e '.[%s]' in the harp-trt checkout"
# top-level import name -> (distribution, what installs it: harp-trt installs from its checkout, not PyPI)
EXTRAS: dict[str, tuple[str, str]] = {
    "onnxruntime": ("onnxruntime", "pip install -e '.[cpu]' (or '.[gpu]' on a CUDA host) in the harp-trt checkout"),
    "lm_eval": ("lm-eval", _IN_CHECKOUT % "eval"),
    "tritonclient": ("tritonclient", _IN_CHECKOUT % "triton"),
    "matplotlib": ("matplotlib", _IN_CHECKOUT % "plots"),
    "onnxruntime_genai": ("onnxruntime-genai", _IN_CHECKOUT % "genai"),
    "llama_cpp": ("llama-cpp-python", _IN_CHECKOUT % "gguf" + " (it builds llama.cpp from source: ~10 CPU-minutes)"),
}


def available(module: str) -> bool:
    """Whether top-level ``module`` is installed (found without importing it)."""
    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, what: str) -> ModuleType:
    """Import and return ``module`` (dotted names too); ``MissingDependencyError`` naming the extra
    when it does not import. ``what`` ends the message "{dist} is not installed: {what}", e.g. "the bench's accuracy tasks
    need it"."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(module, what, e) from e


def check(requirements: Iterable[tuple[str, str]]) -> None:
    """``MissingDependencyError`` for the first (module, what) pair whose module is not installed;
    nothing is imported (a stage checks before its work, ``harp_trt.stage.Stage.requirements``)."""
    for module, what in requirements:
        if not available(module):
            raise _missing(module, what, None)


def figures_skipped(names: Iterable[str]) -> str:
    """The warning a stage logs when it leaves out its PNGs (``Stage.figures``)."""
    return f"{', '.join(names)} not written: matplotlib is not installed; {EXTRAS['matplotlib'][1]}"


def _missing(module: str, what: str, err: ImportError | None) -> MissingDependencyError:
    top = module.split(".")[0]
    dist, install = EXTRAS.get(top, (top, f"pip install {top}"))
    state = "is not installed" if err is None or not available(top) else f"does not import ({err})"
    return MissingDependencyError(f"{dist} {state}: {what}; {install}")
