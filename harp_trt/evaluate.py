"""Perplexity of a plan's model on any text: dense, every pruned layer at alpha = 1 (HARP
unscaled), and the plan itself (searched alphas and, with ``--replacement``, its fitted maps).
``harp-trt eval`` and ``bench/calibration_table.py`` read a second text through it."""
from __future__ import annotations

from typing import Any

__all__ = ["plan_perplexities"]


def plan_perplexities(plan, folder, windows, placement) -> dict[str, Any]:
    """``{"dense", "alpha1", "searched", "path"}`` on ``windows`` (token windows), the model read
    from ``folder`` as ``placement`` says (resident or one layer at a time)."""
    from harp_trt.harp import apply_harp
    from harp_trt.layerwise import LayerStack

    stack = LayerStack.open(folder, placement)
    dense = stack.perplexity(windows)
    apply_harp(stack.model, {l: 1.0 for l in plan.layers}, stack.family)
    alpha1 = stack.perplexity(windows)
    stack.apply_plan(plan.alpha_map, plan.fitted_tensors())
    return {"dense": dense, "alpha1": alpha1, "searched": stack.perplexity(windows),
            "path": "sequential" if stack.sequential else "in-memory"}
