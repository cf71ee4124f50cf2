"""Perplexity: ``exp(mean NLL)`` of next-token prediction over non-overlapping windows (each
window predicts tokens 1..S-1 from its own prefix; no cross-window context).

Windows may carry two marks (the rolling document windows of ``--objective paper``,
``harp_trt.data.rolling_windows``): ``PAD`` (-1) right padding, fed to the model as token 0, and
``context(t)`` (-2 - t), a real token t the model reads but whose prediction is not scored (the
overlap of a document's last window). Right padding is exact under causal attention: no real
position attends to a later one."""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["PAD", "context", "model_ids", "valid_length", "window_nll", "perplexity",
           "perplexity_from_logits_fn"]

PAD = -1  # a window position that holds no token


def context(token: int) -> int:
    """Mark a real token as context only: read by the model, its prediction not scored."""
    return -2 - token


def model_ids(ids: torch.Tensor) -> torch.Tensor:
    """What the model reads: ``PAD`` becomes token 0, ``context(t)`` becomes t."""
    return torch.where(ids >= 0, ids, (-2 - ids).clamp_min(0))


def valid_length(window: torch.Tensor) -> int:
    """Number of real tokens in a right-padded window ``[S]`` or ``[1, S]``."""
    return int((window.reshape(-1) != PAD).sum())


def window_nll(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL (float64) and token count of ``logits [B,S,V]`` predicting ``ids[:, 1:]``
    (``PAD`` and ``context`` labels are skipped)."""
    labels = ids[:, 1:].flatten()
    scored = labels >= 0
    lp = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.where(scored, -100), reduction="sum",
                         ignore_index=-100)
    return float(lp.double()), int(scored.sum())


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
    return perplexity_from_logits_fn(lambda i, ids: model(input_ids=model_ids(ids), use_cache=False).logits, windows)
