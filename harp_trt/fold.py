"""HARP's folds on checkpoint tensors, shared by every writer that streams a Hugging Face folder
(``builders/trtllm``, ``builders/gguf``): tensors by role read one at a time (``RoleReader``, a plan's
fitted maps read in place of their layers' V/O) and
the one fold that turns a pruned layer's value and output projections into a single matrix
(``fold_vo``, HARP Eq. 4-5), built on the GQA fold of o_proj over the query heads that share a KV
head (``fold_o_proj``), which the rewrite stage's rules apply to the graph's initializers too."""
from __future__ import annotations

import numpy as np
import torch

from .dims import ModelDims
from .families import FamilySpec
from .weights import WeightReader

__all__ = ["RoleReader", "fold_o_proj", "fold_vo"]


class RoleReader:
    """HF tensors by role (``"q"``, ``"embed"``...): read from disk, or shape-only (``meta``) for a
    dry run that plans an output file before any tensor is read."""

    def __init__(self, reader: WeightReader, family: FamilySpec, meta: bool, overlay: dict | None = None):
        self.reader, self.family, self.meta = reader, family, meta
        self.overlay = overlay or {}  # checkpoint name -> tensor read instead: a plan's fitted maps (Plan.fitted_tensors)

    def has(self, role: str, layer: int | None = None) -> bool:
        if role not in self.family.weight_names:
            return False
        name = self.family.weight_name(role, layer)
        return name in self.overlay or name in self.reader

    def tied(self) -> bool:
        """The model has no lm_head tensor of its own (it reads the embedding)."""
        return self.family.weight_name("lm_head") not in self.reader

    def get(self, role: str, layer: int | None = None) -> torch.Tensor:
        name = self.family.weight_name(role, layer)
        if name in self.overlay:
            t = self.overlay[name]
            return torch.empty(t.shape, dtype=t.dtype, device="meta") if self.meta else t
        if role == "lm_head" and name not in self.reader:  # tied embeddings
            name = self.family.weight_name("embed")
        return self.reader.meta(name) if self.meta else self.reader.get(name)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device="meta" if self.meta else "cpu")


def fold_o_proj(w_o, num_heads: int, num_kv_heads: int, head_dim: int, heads_axis: int = 0):
    """Sum ``w_o``'s blocks over each KV group: ``W_O repeat_kv(V) = fold(W_O) V``.

    Query head h reads KV head ``g(h) = h // n_rep`` (repeat_kv), so grouping W_O's per-head blocks
    by KV head gives, exactly, ``W_O_fold[j*d:(j+1)*d, :] = sum_{h: g(h)=j} W_O[h*d:(h+1)*d, :]``.

    ``heads_axis`` is the axis of ``w_o`` that runs over the query heads: 0 for the MatMul layout
    ``[num_heads * head_dim, hidden]`` (ONNX initializers), 1 for the checkpoint's ``nn.Linear``
    layout ``[hidden, num_heads * head_dim]``; that axis becomes ``num_kv_heads * head_dim`` long.
    ``w_o`` itself comes back where no KV head is shared. A numpy array (the rewrite's initializers,
    at any width) is summed in float64 and returned in ``w_o.dtype``; a torch tensor (``fold_vo``:
    fp32, or ``meta`` for a dry run) is summed in its own dtype."""
    if w_o.ndim != 2:
        raise ValueError(f"o_proj weight must be 2-D, got shape {tuple(w_o.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if w_o.shape[heads_axis] != num_heads * head_dim:
        raise ValueError(f"o_proj weight has {w_o.shape[heads_axis]} input rows, expected "
                         f"{num_heads} heads x {head_dim} = {num_heads * head_dim}")
    n_rep = num_heads // num_kv_heads
    if n_rep == 1:
        return w_o
    other, groups = w_o.shape[1 - heads_axis], (num_kv_heads, n_rep, head_dim)
    blocks = w_o.reshape((*groups, other) if heads_axis == 0 else (other, *groups))
    if isinstance(blocks, np.ndarray):
        folded = blocks.sum(axis=1 + heads_axis, dtype=np.float64).astype(w_o.dtype)
    else:
        folded = blocks.sum(1 + heads_axis)
    kv_dim = num_kv_heads * head_dim
    return folded.reshape((kv_dim, other) if heads_axis == 0 else (other, kv_dim))


def fold_vo(v: torch.Tensor, o: torch.Tensor, dims: ModelDims, alpha: float) -> torch.Tensor:
    """``alpha * W_O . repeat_kv(W_V)`` as one ``hidden x hidden`` matrix (HARP Eq. 4-5), in fp32:
    ``fold_o_proj`` of the checkpoint's o_proj (the columns of the n_rep heads sharing a KV head
    summed: ``W_O repeat(W_V) = (sum over the group of W_O[:, h]) W_V[g]``) times W_V."""
    return alpha * (fold_o_proj(o.float(), dims.heads, dims.kv_heads, dims.head_dim, heads_axis=1) @ v.float())
