"""Layer-scoring strategies, one module each, looked up by name (``STRATEGIES.get("sink")``)."""
from __future__ import annotations

from harp_trt.lazy import Registry


__all__ = ["STRATEGIES", "ScoreContext", "Strategy", "get_strategy"]

STRATEGIES: Registry = Registry("strategy", base="harp_trt.calib.strategies.base:Strategy")
STRATEGIES.register("top", "harp_trt.calib.strategies.top:TopStrategy")
STRATEGIES.register("gate-norm", "harp_trt.calib.strategies.gate_norm:GateNormStrategy")
STRATEGIES.register("gate-norm-folded", "harp_trt.calib.strategies.gate_norm:GateNormFoldedStrategy")
STRATEGIES.register("bottom", "harp_trt.calib.strategies.top:BottomStrategy")
STRATEGIES.register("sink", "harp_trt.calib.strategies.sink:SinkStrategy")
STRATEGIES.register("bi", "harp_trt.calib.strategies.similarity:BlockInfluenceStrategy")
STRATEGIES.register("attn-sim", "harp_trt.calib.strategies.similarity:AttnSimStrategy")
STRATEGIES.register("cca", "harp_trt.calib.strategies.cca:CcaStrategy")
STRATEGIES.register("cca-attn", "harp_trt.calib.strategies.cca:CcaAttnStrategy")


def get_strategy(name: str):
    """An instance of the strategy registered as ``name`` (imports its module)."""
    return STRATEGIES.get(name)()


def __getattr__(name):  # ScoreContext / Strategy import torch: only when asked for
    if name in ("ScoreContext", "Strategy"):
        from . import base

        return getattr(base, name)
    raise AttributeError(name)
