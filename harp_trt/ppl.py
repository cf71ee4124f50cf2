"""Perplexity: ``exp(mean NLL)`` of next-token prediction over non-overlapping windows (each
window predicts tokens 1..S-1 from its own prefix; no cross-window context)."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["window_nll", "perplexity", "perplexity_from_logits_fn"]


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (float64) and token count of ``logits [B,S,V]`` predicting ``ids[:, 1:]``."""
    lp = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    return float(lp.double()), ids[:, 1:].numel()


def perplexity_from_logits_fn(logits_fn: Callable[[int, torch.Tensor], torch.Tensor],
                              windows: torch.Tensor) -> float:
    total, count = 0.0, 0
    for i in range(windows.shape[0]):
        ids = windows[i: i + 1]
        s, n = window_nll(logits_fn(i, ids), ids)
        total, count = total + s, count + n
    return math.exp(total / count)


@torch.inference_mode()
def perplexity(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Perplexity of a HF causal LM on ``windows [n, S]``, one window per forward pass."""
    return perplexity_from_logits_fn(lambda i, ids: model(input_ids=ids, use_cache=False).logits, windows)
