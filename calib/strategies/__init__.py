"""Layer-scoring strategies, one module each, looked up by name (``STRATEGIES.get("sink")``)."""
from __future__ import annotations

from harp_trt.registry import Registry

from .base import ScoreContext, Strategy

__all__ = ["STRATEGIES", "ScoreContext", "Strategy", "get_strategy"]

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")
STRATEGIES.register("top", "calib.strategies.top:TopStrategy")
STRATEGIES.register("gate-norm", "calib.strategies.gate_norm:GateNormStrategy")
STRATEGIES.register("gate-norm-folded", "calib.strategies.gate_norm:GateNormFoldedStrategy")
STRATEGIES.register("bottom", "calib.strategies.top:BottomStrategy")
STRATEGIES.register("sink", "calib.strategies.sink:SinkStrategy")
STRATEGIES.register("bi", "calib.strategies.similarity:BlockInfluenceStrategy")
STRATEGIES.register("attn-sim", "calib.strategies.similarity:AttnSimStrategy")


def get_strategy(name: str) -> Strategy:
    return STRATEGIES.get(name)()
