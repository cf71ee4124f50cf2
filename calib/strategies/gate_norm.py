"""Gate-Norm (arXiv 2512.20636): data-free query-key coupling from W_q and W_k only.

``gate-norm`` is the paper's score. With the paper's row-vector convention (q = x W_q,
k = x W_k, W in R^{D x H d}) the attention logits of a layer are the bilinear form
x_i W_q W_k^T x_j^T, and the layer's score is its Frobenius norm

    m_l = || W_q W_k^T ||_F            (one D x D product per layer, no norm gain, no 1/sqrt(d))

and the N layers with the smallest m_l lose their attention. Under GQA, W_k has fewer columns
than W_q; each query head reads its KV head, so W_k's heads are repeated to the query heads
(``repeat_kv``) before the product, which keeps m_l the norm of exactly that bilinear form.
In HF's [out, in] layout the product is ``Wq^T @ repeat_kv(Wk)``.

``gate-norm-folded`` is an earlier variant kept for comparison: it folds the input-norm gain g
into both matrices and averages per-head norms, mean_h ||(W_q^h diag g)^T (W_k^k(h) diag g)||_F
/ sqrt(d). The gain makes it rank layers by their norm scale: on SmolLM2-135M layer 0's tiny
gain alone makes it pick layers 0 and 1, which the paper's score does not (docs/results-accuracy.md,
"Reproduction on SmolLM2-135M").

RoPE and q/k biases are left out by both (rotations are orthogonal per position; biases do not
couple tokens). Weights are streamed one tensor at a time from the safetensors files.

QK-norm families (Qwen3, Gemma3: ``FamilySpec.qk_norm``) put a per-head RMSNorm between the
projection and the product: head h's logit is (g_q * q_h / rms(q_h)) . (g_k * k_h / rms(k_h)) with
q_h = W_q^h x. The norm divides W_q^h's scale out, so the raw ||W_q W_k^T|| would rank layers by a
scale the model never sees. ``gate-norm`` there uses each head's matrix as the norm leaves it: the
gain in, the head's own scale out (for isotropic unit-variance x, rms(W^h x) = ||W^h||_F / sqrt(d)):

    W_q^h <- diag(g_q) W_q^h sqrt(d) / ||W_q^h||_F,   the same for W_k^h,

then the same Frobenius norm. Without a QK-norm the score is the paper's, unchanged."""
from __future__ import annotations

from pathlib import Path

import torch

from harp_trt.dims import ModelDims

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


def _heads(cfg) -> tuple[int, int, int]:
    d = ModelDims.from_config(cfg)
    return d.heads, d.kv_heads, d.head_dim


def _as_normed(w: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """Per head [n, d, D]: diag(gain) W^h sqrt(d) / ||W^h||_F, the head as a QK-norm leaves it."""
    scale = w.shape[1] ** 0.5 / torch.linalg.matrix_norm(w).clamp_min(1e-12)      # [n]
    return w * scale[:, None, None] * gain[None, :, None]


def gate_norm_scores(ctx: ScoreContext) -> list[float]:
    """m_l = ||W_q W_k^T||_F per layer (the paper's Gate-Norm)."""
    heads, kv, d = _heads(ctx.config)
    src, fam = _TensorSource(ctx), ctx.family
    scores = []
    for layer in range(ctx.config.num_hidden_layers):
        wq = src.get(fam.weight_name("q", layer)).view(heads, d, -1)                # [H, d, D]
        wk = src.get(fam.weight_name("k", layer)).view(kv, d, -1)
        if fam.qk_norm:   # as the per-head RMSNorm leaves them (module docstring)
            wq, wk = (_as_normed(w, src.get(fam.weight_name(role, layer)) + fam.norm_weight_offset)
                      for w, role in ((wq, "q_norm"), (wk, "k_norm")))
        wq = wq.reshape(heads * d, -1)
        wk = wk.repeat_interleave(heads // kv, dim=0).reshape(heads * d, -1)         # repeat_kv
        scores.append(float(torch.linalg.matrix_norm((wq.T @ wk).double())))       # ||D x D||_F
    return scores


def gate_norm_folded_scores(ctx: ScoreContext) -> list[float]:
    """mean_h ||(W_q^h diag g)^T (W_k^k(h) diag g)||_F / sqrt(d), via trace((A A^T)(B B^T))."""
    heads, kv, d = _heads(ctx.config)
    src, fam = _TensorSource(ctx), ctx.family
    scores = []
    for layer in range(ctx.config.num_hidden_layers):
        gain = src.get(fam.weight_name("input_ln", layer)) + fam.norm_weight_offset
        wq = src.get(fam.weight_name("q", layer)) * gain      # [heads*d, D]
        wk = src.get(fam.weight_name("k", layer)) * gain      # [kv*d, D]
        gq = torch.einsum("hid,hjd->hij", wq.view(heads, d, -1), wq.view(heads, d, -1))  # A A^T
        gk = torch.einsum("kid,kjd->kij", wk.view(kv, d, -1), wk.view(kv, d, -1))        # B B^T
        gk = gk.repeat_interleave(heads // kv, dim=0)                # KV head of each query head
        fro2 = torch.einsum("hij,hji->h", gq.double(), gk.double()).clamp_min(0)
        scores.append(float((fro2.sqrt() / d ** 0.5).mean()))
    return scores


class GateNormStrategy(Strategy):
    name, needs_data, prune_high = "gate-norm", False, False
    scorer = staticmethod(gate_norm_scores)


class GateNormFoldedStrategy(GateNormStrategy):
    name = "gate-norm-folded"
    scorer = staticmethod(gate_norm_folded_scores)
