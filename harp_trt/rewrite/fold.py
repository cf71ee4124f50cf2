"""Weight folds that turn a pruned layer's attention block into two matrix products.

With Q and K removed (HARP, arXiv 2507.01900, Eq. 4-5) the block is a per-token linear map:

    out = concat_h(x W_V[:, g(h)]) W_O = x W_V W_O_fold,   g(h) = h // n_rep   (repeat_kv)

where query head h reads KV head g(h). Grouping the rows of W_O by KV head gives

    W_O_fold[j*d:(j+1)*d, :] = sum_{h: g(h)=j} W_O[h*d:(h+1)*d, :]     (exact, kv_dim x hidden)

so the folded block costs (hidden x kv_dim) + (kv_dim x hidden) instead of hidden x hidden. That
fold is ``harp_trt.fold.fold_o_proj``, the one the checkpoint writers' ``fold_vo`` uses too; this
module holds the rewrite's own: alpha into a norm's gain, a plan's fitted maps by layer."""
from __future__ import annotations

import numpy as np

__all__ = ["scale_norm_gain", "fitted_weights"]


def scale_norm_gain(gain: np.ndarray, alpha: float) -> np.ndarray:
    """Fold alpha into the *effective* gain of a norm (``alpha * norm(x) = norm_{alpha*g}(x)``).

    The exported graphs store the effective gain (for Gemma2's ``(1 + w)`` RMSNorm the exporter
    constant-folds ``1 + w`` into the initializer), so the fold is a plain product; a graph that
    stores ``w`` and adds the offset at run time is handled by the rule, not here."""
    return (np.asarray(gain, dtype=np.float64) * alpha).astype(gain.dtype)


def fitted_weights(tensors, family_name: str) -> dict[int, dict[str, np.ndarray]]:
    """A plan's fitted maps (``Plan.fitted_tensors``: checkpoint names -> tensors) by layer, as the
    rewrite rules take them, float32 numpy, checkpoint layout: ``rrr``'s ``v`` [kv_dim, hidden],
    ``o`` [hidden, heads * head_dim] and a zero ``vb`` where the family has a v bias; ``lmmse``'s
    ``w`` [hidden, hidden] and ``b`` [hidden] (``self_attn.harp_linear.*``, ``calib.fit.hf_tensors``)."""
    from ..families import FAMILIES
    from ..plan import FITTED_LINEAR

    fam = FAMILIES.get(family_name)()
    head, _, _ = fam.layer_prefix.partition("{i}")
    out: dict[int, dict[str, np.ndarray]] = {}
    names = {**{r: fam.weight_names[r] for r in ("v", "o", "vb")},
             "w": f"{FITTED_LINEAR}.weight", "b": f"{FITTED_LINEAR}.bias"}
    for role, tail in names.items():
        suffix = "." + tail
        for name, t in tensors.items():
            if name.startswith(head) and name.endswith(suffix):
                layer = int(name[len(head):].split(".", 1)[0])
                out.setdefault(layer, {})[role] = t.float().numpy()
    return out
