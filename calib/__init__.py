"""Stage 1, calibrate: score layers, choose P, search alpha. ``run_calibrate`` is the entry point
used by the CLI and the ``build`` pipeline."""
from __future__ import annotations

from typing import Callable

__all__ = ["run_calibrate"]


def run_calibrate(model_ref, config, store, naive: bool = False, force: bool = False,
                  progress=None, on_phase: Callable[[str], None] | None = None, placement=None):
    """Resolve the model (a reference, or an already ``ResolvedModel``) and the corpus, then
    return the (cached or new) calibrate ``Artifact``."""
    from harp_trt.models import resolve_model
    from harp_trt.stage import Hooks

    from .stage import CalibrateStage

    resolved = model_ref if hasattr(model_ref, "digest") else resolve_model(model_ref, store.root)
    stage = CalibrateStage()
    inputs = stage.prepare(store, config, {"model": resolved, "naive": naive}, Hooks(progress, on_phase, placement))
    return stage.execute(store, config, inputs, force=force)
