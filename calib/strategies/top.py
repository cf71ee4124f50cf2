from __future__ import annotations

from .base import ScoreContext, Strategy


def layer_index_scores(ctx: ScoreContext) -> list[float]:
    return [float(i) for i in range(ctx.config.num_hidden_layers)]


class TopStrategy(Strategy):
    """HARP's choice (arXiv 2507.01900): prune the top P layers. Score = layer index."""

    name, needs_data = "top", False
    scorer = staticmethod(layer_index_scores)


class BottomStrategy(TopStrategy):
    """The HARP paper's Bottom-P ablation: prune the P lowest layers."""

    name, prune_high = "bottom", False
