"""The PyTorch side of the in-process comparisons (``ort_vs_torch.py``, ``prefill_profile.py``): the
Hugging Face model, loaded by ``harp_trt.models.load_model`` as a user would run it."""
from __future__ import annotations

import time

import numpy as np


class TorchSide:
    """The model in PyTorch: fp32, sdpa, ``threads`` intra-op threads; ``prefill`` returns the full
    output (logits at every position and the cache), ``decode`` each greedy step's seconds."""

    def __init__(self, resolved, threads: int):
        import torch

        from harp_trt.models import load_model

        torch.set_num_threads(threads)
        self.torch = torch
        self.model, _ = load_model(resolved, dtype="float32", attn_implementation="sdpa")

    def prefill(self, ids: np.ndarray):
        t = self.torch
        x = t.from_numpy(ids)
        with t.inference_mode():
            return self.model(input_ids=x, attention_mask=t.ones_like(x), use_cache=True)

    def decode(self, ids: np.ndarray, steps: int) -> list[float]:
        t = self.torch
        x = t.from_numpy(ids)
        mask = t.ones_like(x)
        times = []
        with t.inference_mode():
            out = self.model(input_ids=x, attention_mask=mask, use_cache=True)
            cache = out.cache
            for _ in range(steps):
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                mask = t.cat([mask, t.ones_like(tok)], 1)
                t0 = time.perf_counter()
                out = self.model(input_ids=tok, attention_mask=mask, cache=cache, use_cache=True)
                times.append(time.perf_counter() - t0)
                cache = out.cache
        return times
