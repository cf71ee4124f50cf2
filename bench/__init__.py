"""Stage 4, bench: latency and accuracy of a HARP engine against the dense engine.

``run_bench(plan_artifact, source, config, store)`` (``bench.stage``) is the entry point used by
``harp-trt bench`` and ``harp-trt build --bench``; ``bench/gpu_prefill.py`` is the GPU-only
long-context prefill script. Imports are lazy: ``import bench`` loads nothing heavy."""
from __future__ import annotations

__all__ = ["run_bench", "BenchConfig", "check_gates"]


def __getattr__(name):
    if name == "BenchConfig":
        from .config import BenchConfig

        return BenchConfig
    if name in __all__:
        from . import stage

        return getattr(stage, name)
    raise AttributeError(name)
