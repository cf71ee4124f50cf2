"""Stage 1, calibrate: score layers, choose P, search alpha. ``run_calibrate`` is the entry point
used by the CLI and the ``build`` pipeline."""
from __future__ import annotations

from typing import Callable

__all__ = ["run_calibrate"]


def run_calibrate(model_ref, config, store, naive: bool = False, force: bool = False,
                  progress=None, on_phase: Callable[[str], None] | None = None, placement=None):
    """Resolve the model (a reference, or an already ``ResolvedModel``) and the corpus, then
    return the (cached or new) calibrate ``Artifact``."""
    from harp_trt.data import load_corpus
    from harp_trt.models import resolve_model

    from .stage import CalibrateInputs, CalibrateStage

    resolved = model_ref if hasattr(model_ref, "digest") else resolve_model(model_ref, store.root)
    corpus = load_corpus(config.corpus, store.root)
    inputs = {"calibrate": CalibrateInputs(resolved, corpus, naive=naive, progress=progress, on_phase=on_phase,
                                           placement=placement)}
    return CalibrateStage().execute(store, config, inputs, force=force)
