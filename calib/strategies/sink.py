"""BOS sink score (arXiv 2601.06787): how much attention mass a layer puts on position 0.

At prefill on calibration text, for every head: the mean over query positions 1..S-1 of the
attention weight on key 0; layer score = mean over heads and windows. Heavily sink-dominated
layers move little information, so the P *highest* are pruned, never the first or last layer."""
from __future__ import annotations

import torch

from .base import ScoreContext, Strategy


@torch.inference_mode()
def sink_scores(ctx: ScoreContext, max_windows: int = 8) -> list[float]:
    """Layer by layer over the windows (works on a resident or a sequential ``LayerStack``)."""
    stack = ctx.stack
    model = stack.model
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")  # only eager returns attention weights (and needs a mask)
    try:
        windows = ctx.windows[:max_windows]
        cap = stack.capture(windows)
        scores = []
        for i, layer, h_in, _ in stack.walk(cap.h0, cap):
            total = 0.0
            for h in h_in:
                _, weights = layer.self_attn(layer.input_layernorm(h), **cap.kwargs[i])
                total += float(weights[0, :, 1:, 0].float().mean())  # heads x queries 1..S-1, key 0
            scores.append(total / len(h_in))
        return scores
    finally:
        model.set_attn_implementation(prev)


class SinkStrategy(Strategy):
    name = "sink"
    prune_high = True
    protect_ends = True

    def score(self, ctx: ScoreContext) -> list[float]:
        return sink_scores(ctx)
