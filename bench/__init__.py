"""Stage 4, bench: latency and accuracy of a HARP engine against the dense engine.

Two halves. ``bench/stage/`` is the bench *stage*: ``run_bench(plan_artifact, source, config,
store)`` (used by ``harp-trt bench`` and ``harp-trt build --bench``), its light ``config.py``,
the engines it compares and its measurements; what it imports is the stage's code version. The
``bench/*.py`` files beside it are standalone benchmark *scripts* (``python bench/NAME.py``, or
``python -m harp_trt.bench.NAME`` from an install), each ending its stdout with one JSON object and
each named in the README; ``bench/_*.py`` are the helpers they share. They use the stage and the
pipeline, never the reverse.
Imports are lazy: ``import bench`` loads nothing heavy."""
from __future__ import annotations

__all__ = ["run_bench", "BenchConfig", "check_gates"]


def __getattr__(name):
    if name == "BenchConfig":
        from .stage.config import BenchConfig

        return BenchConfig
    if name in __all__:
        from .stage import stage

        return getattr(stage, name)
    raise AttributeError(name)
