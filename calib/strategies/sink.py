"""BOS sink score (arXiv 2601.06787): how much attention mass a layer puts on the ``<BOS>`` token.

Every scoring window starts with the tokenizer's BOS (``harp_trt.data.prefix_token_id``: BOS,
else EOS), followed by calibration text. At prefill, for every head: the mean over the real query
positions 1..S-1 of the attention weight on key 0 (the BOS); layer score = mean over heads and
windows. Heavily sink-dominated layers move little information, so the P *highest* are pruned,
never the first or the last layer (the paper's exclusion)."""
from __future__ import annotations

import torch

from harp_trt.ppl import valid_length

from .base import ScoreContext, Strategy


def with_prefix(windows: torch.Tensor, prefix_id: int | None) -> torch.Tensor:
    """``[prefix] + window`` for every window (the last column dropped: same width). Windows that
    already start with it are kept."""
    if prefix_id is None:
        return windows
    body = windows[:, :-1]
    out = torch.cat([torch.full_like(windows[:, :1], prefix_id), body], 1)
    keep = windows[:, 0] == prefix_id
    out[keep] = windows[keep]
    return out


@torch.inference_mode()
def sink_scores(ctx: ScoreContext, max_windows: int = 8) -> list[float]:
    """Layer by layer over the windows (works on a resident or a sequential ``LayerStack``)."""
    stack = ctx.stack
    model = stack.model
    prev = model.config._attn_implementation
    model.set_attn_implementation("eager")  # only eager returns attention weights (and needs a mask)
    try:
        windows = with_prefix(ctx.windows[:max_windows], ctx.prefix_id)
        lengths = [valid_length(w) for w in windows]
        cap = stack.capture(windows)
        scores = []
        for i, layer, h_in, _ in stack.walk(cap.h0, cap):
            total = 0.0
            for h, n in zip(h_in, lengths):
                _, weights = layer.self_attn(layer.input_layernorm(h), **cap.kwargs[i])
                total += float(weights[0, :, 1:n, 0].float().mean())  # heads x real queries 1.., key 0
            scores.append(total / len(h_in))
        return scores
    finally:
        model.set_attn_implementation(prev)


class SinkStrategy(Strategy):
    name, prune_high, protect_ends = "sink", True, True
    scorer = staticmethod(sink_scores)
