"""BOS sink score (arXiv 2601.06787): how much attention mass a layer puts on position 0.

At prefill on calibration text, for every head: the mean over query positions 1..S-1 of the
attention weight on key 0; layer score = mean over heads and windows. Heavily sink-dominated
layers move little information, so the P *highest* are pruned, never the first or last layer."""
from __future__ import annotations

import torch

from .base import ScoreContext, Strategy


@torch.inference_mode()
def sink_scores(ctx: ScoreContext, max_windows: int = 8) -> list[float]:
    model = ctx.model
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")  # only eager returns attention weights
    try:
        total = None
        windows = ctx.windows[:max_windows]
        for i in range(windows.shape[0]):
            out = model(input_ids=windows[i: i + 1], output_attentions=True, use_cache=False)
            s = torch.stack([a[0, :, 1:, 0].float().mean() for a in out.attentions])  # heads+queries
            total = s if total is None else total + s
        return [float(x) for x in total / windows.shape[0]]
    finally:
        model.set_attn_implementation(prev)


class SinkStrategy(Strategy):
    name = "sink"
    prune_high = True
    protect_ends = True

    def score(self, ctx: ScoreContext) -> list[float]:
        return sink_scores(ctx)
