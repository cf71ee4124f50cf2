"""HARP's folds on checkpoint tensors, shared by every writer that streams a Hugging Face folder
(``builders/trtllm``, ``builders/gguf``): tensors by role read one at a time (``RoleReader``, a plan's
fitted maps read in place of their layers' V/O) and
the one fold that turns a pruned layer's value and output projections into a single matrix
(``fold_vo``, HARP Eq. 4-5)."""
from __future__ import annotations

import torch

from .dims import ModelDims
from .families import FamilySpec
from .weights import WeightReader

__all__ = ["RoleReader", "fold_vo"]


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


def fold_vo(v: torch.Tensor, o: torch.Tensor, dims: ModelDims, alpha: float) -> torch.Tensor:
    """``alpha * W_O . repeat_kv(W_V)`` as one ``hidden x hidden`` matrix (HARP Eq. 4-5), in fp32.

    Query head h reads KV head ``h // n_rep``, so the o_proj columns of the n_rep heads sharing a KV
    head are summed first: ``W_O repeat(W_V) = (sum over the group of W_O[:, h]) W_V[g]``."""
    n_rep = dims.heads // dims.kv_heads
    o_fold = o.float().view(dims.hidden, dims.kv_heads, n_rep, dims.head_dim).sum(2)
    return alpha * (o_fold.reshape(dims.hidden, dims.kv_heads * dims.head_dim) @ v.float())
