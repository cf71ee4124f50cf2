"""Tiny models exported once per test session (an export takes ~10 s on 2 cores), shared by
test_export.py and test_ort_engine.py. Not a test module."""
from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from conftest import make_tiny

HARP_ALPHAS = {1: 0.5, 3: 1.0}


def head_dim(family: str) -> int:
    """The tiny model's head size (16; Qwen3's is its own, 32: heads * head_dim != hidden)."""
    from harp_trt.families import FAMILIES

    return FAMILIES.get(family)().tiny_config().head_dim


def tiny(family: str, harp: bool = False):
    """A fresh tiny model (seed 0), HARP-patched on layers {1, 3} when ``harp``."""
    from harp_trt.harp import apply_harp

    model = make_tiny(family)
    if harp:
        apply_harp(model, dict(HARP_ALPHAS))
    return model


@functools.cache
def _root() -> Path:
    """One folder per test session, made on first use and removed when the session ends."""
    root = Path(tempfile.mkdtemp(prefix="harp-ort-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def exported(family: str, harp: bool = False) -> Path:
    """``model.onnx`` of ``tiny(family, harp)``."""
    from harp_trt.export.export import export_dense

    return export_dense(tiny(family, harp), _root() / f"{family}{'-harp' if harp else ''}")


@functools.cache
def engine(family: str, harp: bool = False, attention: str = "gqa") -> Path:
    """An ORT engine folder built from ``exported(family, harp)``."""
    from harp_trt.builders.ort.builder import OrtBuilder
    from harp_trt.builders.ort.config import OrtBuildConfig

    out = _root() / f"engine-{family}{'-harp' if harp else ''}-{attention}"
    OrtBuilder().build(exported(family, harp), out, OrtBuildConfig(attention=attention, intra_op_threads=2))
    return out
