"""Layer-scoring strategy contract.

A strategy returns one score per decoder layer (layer order) and picks the P layers to prune from
them. ``prune_high`` says which end of the ranking is pruned."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from harp_trt.errors import ConfigError
from harp_trt.families import FamilySpec

__all__ = ["ScoreContext", "Strategy"]


@dataclass
class ScoreContext:
    """What a strategy may use. ``stack`` and ``windows`` are None for data-free scoring."""

    family: FamilySpec
    config: Any                          # HF config
    folder: Path | None = None           # safetensors folder, for streaming weight reads
    stack: Any = None                    # harp_trt.layerwise.LayerStack (resident or sequential)
    windows: torch.Tensor | None = None  # calibration token windows [n, S] (may hold ppl.PAD)
    prefix_id: int | None = None         # the BOS (else EOS) token: data.prefix_token_id


class Strategy:
    """A name, how the scores are read (the flags) and ``scorer``, the function that computes them
    (a ``staticmethod`` of the subclass); two strategies that score alike share a parent."""

    name: ClassVar[str]
    needs_data: ClassVar[bool] = True
    prune_high: ClassVar[bool] = True     # prune the P highest scores (else the P lowest)
    protect_ends: ClassVar[bool] = False  # never select the first or the last layer
    scorer: ClassVar[Callable[[ScoreContext], list[float]]]

    def score(self, ctx: ScoreContext) -> list[float]:
        return self.scorer(ctx)

    def select(self, scores: list[float], p: int) -> list[int]:
        """Indices of the P layers to prune, ascending. Ties break towards higher layers."""
        n = len(scores)
        candidates = list(range(1, n - 1)) if self.protect_ends else list(range(n))
        if not 0 < p <= len(candidates) or p >= n:
            raise ConfigError(f"--layers must be in 1..{min(len(candidates), n - 1)} for a {n}-layer model "
                              f"with strategy {self.name!r}, got {p}")
        sign = 1.0 if self.prune_high else -1.0
        ranked = sorted(candidates, key=lambda i: (sign * scores[i], i), reverse=True)
        return sorted(ranked[:p])
