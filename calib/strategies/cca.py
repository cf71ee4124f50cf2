"""``cca``: Neural Block Linearization's layer choice (arXiv 2505.21077): rank attention blocks by
how well a linear map of their input can stand in for their output.

With X the normed inputs of layer l's attention block and Y its outputs on the calibration
windows, the canonical correlations rho_i of (X, Y) are the singular values of
``C_yy^-1/2 C_yx C_xx^-1/2`` (centred covariances). The error of the best linear predictor of the
whitened output is ``sum_i (1 - rho_i^2)``: our score is its mean over the h canonical directions
(0 = the block is exactly linear in its input, 1 = unpredictable by any linear map). The P lowest
are pruned: the layers a fitted map (``--replacement lmmse`` / ``rrr``, calib/fit.py) replaces best.
Covariances get a ridge of 1e-6 of their mean eigenvalue; one dense pass, one layer's moments held."""
from __future__ import annotations

import torch

from .base import ScoreContext, Strategy

__all__ = ["CcaStrategy", "cca_bound"]


def _inv_sqrt(c: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    c = (c + c.T) / 2
    c = c + ridge * float(torch.diagonal(c).mean()) * torch.eye(c.shape[0], dtype=c.dtype)
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


@torch.inference_mode()
def cca_scores(ctx: ScoreContext) -> list[float]:
    from ..fit import layer_moments

    n = int(ctx.windows.shape[0])
    layers = range(ctx.stack.num_layers)
    return [cca_bound(stats.fit) for _, stats in layer_moments(ctx.stack, ctx.windows, layers, n, full_yy=True)]


class CcaStrategy(Strategy):
    name, prune_high = "cca", False
    scorer = staticmethod(cca_scores)
