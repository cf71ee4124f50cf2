"""Similarity-based scores: low score = the block changes the residual stream little = prune.

- ``bi``: ShortGPT Block Influence (arXiv 2403.03853), ``1 - cos(h_in, h_out)`` of the whole layer.
- ``attn-sim``: ``1 - cos(h_in, h_in + attn_out)``, the attention block alone (after the post-
  attention norm for Gemma2, i.e. exactly what is added to the residual stream).
Both average over tokens and windows and prune the P *lowest*."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import ScoreContext, Strategy


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(1 - F.cosine_similarity(a.double(), b.double(), dim=-1).mean())


@torch.inference_mode()
def similarity_scores(ctx: ScoreContext, attn_only: bool, max_windows: int = 8) -> list[float]:
    """Layer inputs/outputs are taken with hooks on each decoder layer (and its ``self_attn``)."""
    model, family = ctx.model, ctx.family
    layers = family.layers(model)
    sums = [0.0] * len(layers)
    h_in: dict[int, torch.Tensor] = {}
    hooks = []

    def make(i, layer):
        def pre(mod, args, kwargs):
            h_in[i] = args[0] if args else kwargs["hidden_states"]

        def post_layer(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            sums[i] += _one_minus_cos(h_in[i], out)

        def post_attn(mod, args, output):
            attn = output[0] if isinstance(output, tuple) else output
            added = family.attn_residual(layer, torch.zeros_like(h_in[i]), attn)
            sums[i] += _one_minus_cos(h_in[i], h_in[i] + added)

        hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        if attn_only:
            hooks.append(layer.self_attn.register_forward_hook(post_attn))
        else:
            hooks.append(layer.register_forward_hook(post_layer))

    for i, layer in enumerate(layers):
        make(i, layer)
    try:
        windows = ctx.windows[:max_windows]
        for w in range(windows.shape[0]):
            model(input_ids=windows[w: w + 1], use_cache=False)
        return [s / windows.shape[0] for s in sums]
    finally:
        for h in hooks:
            h.remove()


class BlockInfluenceStrategy(Strategy):
    name = "bi"
    prune_high = False

    def score(self, ctx: ScoreContext) -> list[float]:
        return similarity_scores(ctx, attn_only=False)


class AttnSimStrategy(Strategy):
    name = "attn-sim"
    prune_high = False

    def score(self, ctx: ScoreContext) -> list[float]:
        return similarity_scores(ctx, attn_only=True)
