"""Gate-Norm (arXiv 2512.20636): data-free query-key coupling from W_q and W_k only.

For layer l with input-norm gain g (Gemma: 1 + w) and query head h reading KV head k(h):

    A_h = W_q^(h) diag(g)   (d x D),   B_k = W_k^(k) diag(g)   (d x D)
    c_h = || A_h^T B_k ||_F / sqrt(d)          (the bilinear form x^T A^T B y of q.k / sqrt(d))
    score_l = mean_h c_h

computed as ||A^T B||_F^2 = trace((A A^T)(B B^T)), d x d products only. RoPE rotations and q/k
biases are left out (rotations are orthogonal per position; biases do not couple tokens).
Weights are streamed one tensor at a time from the safetensors files: no forward pass, no data.
Prune the P *least* coupled layers."""
from __future__ import annotations

from pathlib import Path

import torch

from .base import ScoreContext, Strategy


class _TensorSource:
    """Single tensors by checkpoint name, from the safetensors folder (read one at a time) or,
    without one, from a loaded model's parameters."""

    def __init__(self, ctx: ScoreContext):
        self.model_state = None
        self.reader = None
        if ctx.folder is not None and any(Path(ctx.folder).glob("*.safetensors")):
            from harp_trt.weights import WeightReader

            self.reader = WeightReader(ctx.folder)
        elif ctx.stack is not None:
            self.model_state = dict(ctx.stack.model.named_parameters())
        else:
            raise ValueError("gate-norm needs a weights folder or a model")

    def get(self, name: str) -> torch.Tensor:
        if self.model_state is not None:
            return self.model_state[name].detach().float()
        return self.reader.get(name, torch.float32)


def gate_norm_scores(ctx: ScoreContext) -> list[float]:
    cfg = ctx.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rep = heads // kv
    src = _TensorSource(ctx)
    scores = []
    for layer in range(cfg.num_hidden_layers):
        fam = ctx.family
        gain = src.get(fam.weight_name("input_ln", layer)) + fam.norm_weight_offset
        wq = src.get(fam.weight_name("q", layer)) * gain      # [heads*d, D]
        wk = src.get(fam.weight_name("k", layer)) * gain      # [kv*d, D]
        gq = torch.einsum("hid,hjd->hij", wq.view(heads, d, -1), wq.view(heads, d, -1))  # A A^T
        gk = torch.einsum("kid,kjd->kij", wk.view(kv, d, -1), wk.view(kv, d, -1))        # B B^T
        gk = gk.repeat_interleave(rep, dim=0)                        # KV head of each query head
        fro2 = torch.einsum("hij,hji->h", gq.double(), gk.double()).clamp_min(0)
        scores.append(float((fro2.sqrt() / d ** 0.5).mean()))
    return scores


class GateNormStrategy(Strategy):
    name = "gate-norm"
    needs_data = False
    prune_high = False

    def score(self, ctx: ScoreContext) -> list[float]:
        return gate_norm_scores(ctx)
