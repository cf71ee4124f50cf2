"""Accuracy of HARP against the dense model, outside lm-eval: perplexity on the held-out half of
the calibration corpus (the text that chose alpha is never used) and greedy agreement.

* ``top1_agreement``: teacher-forced, the fraction of positions where both engines' most likely
  next token is the same (over the same held-out windows as the perplexity);
* ``greedy_match``: free-running, each engine greedily continues the same prompts; the mean share
  of generated tokens before the first difference (1.0 = identical continuations)."""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from harp_trt.ppl import window_nll

from .engines import EnginePair

__all__ = ["heldout_accuracy", "greedy_match"]

log = logging.getLogger(__name__)


def heldout_accuracy(pair: EnginePair, windows: torch.Tensor,
                     progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Perplexity of both engines and their teacher-forced top-1 agreement on ``windows [n, S]``."""
    nll = {"dense": 0.0, "harp": 0.0}
    count, agree, positions = 0, 0, 0
    for i in range(windows.shape[0]):
        ids = windows[i: i + 1]
        top = {}
        for v, eng in pair.engines().items():
            logits = eng.logits(ids)
            s, n = window_nll(logits, ids)
            nll[v] += s
            top[v] = logits[0, :-1].argmax(-1)
        count += n
        agree += int((top["dense"] == top["harp"]).sum())
        positions += top["dense"].numel()
    out = {"ppl_dense": math.exp(nll["dense"] / count), "ppl_harp": math.exp(nll["harp"] / count),
           "top1_agreement": agree / positions, "tokens": count}
    if progress:
        progress(f"held-out perplexity: dense {out['ppl_dense']:.3f}, harp {out['ppl_harp']:.3f}")
    return out


@torch.inference_mode()
def greedy_match(pair: EnginePair, prompts: torch.Tensor, new_tokens: int) -> dict[str, float]:
    """Greedy continuations of ``prompts [n, P]`` by both engines, compared token by token."""
    gens = {}
    for v, eng in pair.engines().items():
        outs = []
        for i in range(prompts.shape[0]):
            logits, state = eng.prefill(prompts[i: i + 1])
            toks = [int(logits.argmax(-1))]
            for _ in range(new_tokens - 1):
                logits, state = eng.decode(torch.tensor([[toks[-1]]]), state)
                toks.append(int(logits.argmax(-1)))
            outs.append(toks)
        gens[v] = outs
    shares, identical = [], 0
    for d, h in zip(gens["dense"], gens["harp"]):
        same = next((k for k, (a, b) in enumerate(zip(d, h)) if a != b), len(d))
        shares.append(same / len(d))
        identical += int(same == len(d))
    return {"greedy_match": sum(shares) / len(shares), "greedy_identical": identical / len(shares),
            "greedy_prompts": len(shares), "greedy_tokens": new_tokens}
