"""Similarity-based scores: low score = the block changes the residual stream little = prune.

- ``bi``: ShortGPT Block Influence (arXiv 2403.03853), ``1 - cos(h_in, h_out)`` of the whole layer.
- ``attn-sim``: ``1 - cos(h_in, h_in + attn_out)``, the attention block alone (after the post-
  attention norm for Gemma2, i.e. exactly what is added to the residual stream).
Both average over tokens and windows and prune the P *lowest*.""" 
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from harp_trt.ppl import valid_length

from .base import ScoreContext, Strategy


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(1 - F.cosine_similarity(a.double(), b.double(), dim=-1).mean())


@torch.inference_mode()
def similarity_scores(ctx: ScoreContext, attn_only: bool, max_windows: int = 8) -> list[float]:
    """Layer by layer over the windows: each layer's input and output (or its attention block's
    contribution, recomputed from the same input) while the layer is resident."""
    stack, family = ctx.stack, ctx.family
    windows = ctx.windows[:max_windows]
    lengths = [valid_length(w) for w in windows]  # right padding is not scored
    cap = stack.capture(windows)
    scores = []
    for i, layer, h_in, h_out in stack.walk(cap.h0, cap):
        total = 0.0
        for x, y, n in zip(h_in, h_out, lengths):
            if attn_only:
                attn = layer.self_attn(layer.input_layernorm(x), **cap.kwargs[i])[0]
                y = x + family.attn_residual(layer, torch.zeros_like(x), attn)
            total += _one_minus_cos(x[:, :n], y[:, :n])
        scores.append(total / len(h_in))
    return scores


class BlockInfluenceStrategy(Strategy):
    name, prune_high = "bi", False
    scorer = staticmethod(functools.partial(similarity_scores, attn_only=False))


class AttnSimStrategy(BlockInfluenceStrategy):
    name = "attn-sim"
    scorer = staticmethod(functools.partial(similarity_scores, attn_only=True))
