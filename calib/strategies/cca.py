"""``cca`` and ``cca-attn``: rank attention blocks by how well a linear map of their input stands in
for their output, from canonical correlations.

``cca`` is Neural Block Linearization's quantity (arXiv 2505.21077): the canonical correlations
rho_i of the block's un-normed input X (the residual stream entering layer l) and its residual
output X + Y (the stream after the attention sublayer; after Gemma2's post-attention norm). They
are the singular values of ``C_oo^-1/2 C_ox C_xx^-1/2`` (centred covariances), and NBL's bound on
the linearisation error is built on ``sum_i (1 - rho_i^2)``; the score is that sum over the h
directions divided by h (0 = the block is exactly linear in its input, 1 = no linear relation),
which ranks as the sum does. ``cca-attn`` is the same bound between the attention sublayer's normed
input and its output Y alone: the error of the map ``--replacement`` fits (calib/fit.py), a harder
quantity than NBL's because the identity path is left out. The P lowest scores are pruned.

Sample canonical correlations of n tokens in h dimensions are biased upwards by about h / n: pure
noise reads 1 - h/n instead of 1. A score from fewer than ``MIN_TOKENS_PER_DIM`` tokens per
dimension would rank noise, so it is refused with the count it needs (``--score-tokens``).
Covariances get a ridge of 1e-6 of their mean eigenvalue; one dense pass, one layer's moments held."""
from __future__ import annotations

import torch

from harp_trt.errors import ConfigError

from .base import ScoreContext, Strategy

__all__ = ["CcaStrategy", "CcaAttnStrategy", "cca_bound", "MIN_TOKENS_PER_DIM", "check_tokens"]

MIN_TOKENS_PER_DIM = 10  # the noise floor h/n stays at or below 0.1 of the score's range


def _inv_sqrt(c: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    c = (c + c.T) / 2
    c = c + ridge * float(torch.diagonal(c).mean()) * torch.eye(c.shape[0], dtype=c.dtype, device=c.device)
    vals, vecs = torch.linalg.eigh(c)
    return vecs @ torch.diag(vals.clamp(min=1e-30).rsqrt()) @ vecs.T


def cca_bound(m) -> float:
    """The mean of ``1 - rho_i^2`` over the canonical correlations of a layer's ``Moments``
    (accumulated with ``full_yy``)."""
    cxx, cyx = m.centred()
    my = m.sy / m.n
    cyy = m.yyt - m.n * torch.outer(my, my)
    rho = torch.linalg.svdvals(_inv_sqrt(cyy) @ cyx @ _inv_sqrt(cxx)).clamp(max=1.0)
    return float((1 - rho ** 2).mean())


def check_tokens(n: int, hidden: int, name: str) -> None:
    """ConfigError unless ``n`` scored tokens give at least ``MIN_TOKENS_PER_DIM`` per dimension."""
    need = MIN_TOKENS_PER_DIM * hidden
    if n < need:
        raise ConfigError(f"--strategy {name} needs >= {need} tokens at hidden size {hidden} "
                          f"({MIN_TOKENS_PER_DIM} per dimension), got {n}: with fewer its canonical correlations "
                          f"rank noise (pure noise reads ~{max(0.0, 1 - hidden / max(n, 1)):.2f} instead of 1)",
                          f"pass --score-tokens {need} or more to calibrate and build (--tokens {need} to score)")


def _scores(ctx: ScoreContext, pairs: str, name: str) -> list[float]:
    from harp_trt.dims import ModelDims
    from harp_trt.ppl import PAD

    from ..fit import layer_moments

    check_tokens(int((ctx.windows != PAD).sum()), ModelDims.from_config(ctx.config).hidden, name)
    n = int(ctx.windows.shape[0])
    layers = range(ctx.stack.num_layers)
    return [cca_bound(stats.fit) for _, stats in layer_moments(ctx.stack, ctx.windows, layers, n, full_yy=True,
                                                              pairs=pairs)]


@torch.inference_mode()
def cca_scores(ctx: ScoreContext) -> list[float]:
    return _scores(ctx, "residual", "cca")


@torch.inference_mode()
def cca_attn_scores(ctx: ScoreContext) -> list[float]:
    return _scores(ctx, "attention", "cca-attn")


class CcaStrategy(Strategy):
    name, prune_high = "cca", False
    scorer = staticmethod(cca_scores)


class CcaAttnStrategy(CcaStrategy):
    name = "cca-attn"
    scorer = staticmethod(cca_attn_scores)
