from __future__ import annotations

from .base import ScoreContext, Strategy


class TopStrategy(Strategy):
    """HARP's choice (arXiv 2507.01900): prune the top P layers. Score = layer index."""

    name = "top"
    needs_data = False

    def score(self, ctx: ScoreContext) -> list[float]:
        return [float(i) for i in range(ctx.config.num_hidden_layers)]


class BottomStrategy(Strategy):
    """The HARP paper's Bottom-P ablation: prune the P lowest layers. Score = layer index."""

    name = "bottom"
    needs_data = False
    prune_high = False

    def score(self, ctx: ScoreContext) -> list[float]:
        return [float(i) for i in range(ctx.config.num_hidden_layers)]
