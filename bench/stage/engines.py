"""Engines the bench compares: one backend, a dense and a HARP instance of the same model.

An ``Engine`` is the minimum the bench needs from a backend: a prefill that returns the last
token's logits and a cache, a one-token decode step, teacher-forced logits for perplexity and
lm-eval, and the size of its cache. Backends register a loader in ``harp_trt.bench.stage.config.ENGINES`` (lazy: ``"torch"``
imports only PyTorch/transformers, ``"ort"`` only ONNX Runtime); a loader returns an
``EnginePair`` so both engines share one tokenizer, one set of dimensions and one process."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch


from harp_trt.dims import ModelDims

__all__ = ["Engine", "EnginePair"]


class Engine(abc.ABC):
    """One model in one backend. ``variant`` is ``"dense"`` or ``"harp"``. Token ids and logits
    are torch tensors on the CPU whatever the backend; logits are float32."""

    backend: str = "?"
    variant: str = "?"
    prefill_logits: str = "last"   # which positions a prefill computes logits for ("last" | "all")
    kv_dtype_bytes: int | None = None  # bytes per cached K/V element where the runtime fixes it (None: the
                                       # bench dtype's); the counted KV bytes and decode-bytes ideal use it

    @property
    @abc.abstractmethod
    def max_positions(self) -> int:
        """Longest sequence the model was built for (``max_position_embeddings``)."""

    @abc.abstractmethod
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``ids [B, S]`` -> (logits of the last position ``[B, V]``, cache state)."""

    @abc.abstractmethod
    def decode(self, token: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One step: ``token [B, 1]`` after ``state`` -> (logits ``[B, V]``, new state)."""

    @abc.abstractmethod
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits ``[B, S, V]`` of ``ids [B, S]`` (no cache kept)."""

    @abc.abstractmethod
    def cache_bytes(self, state: Any) -> int:
        """Bytes the KV cache in ``state`` occupies (measured on the tensors, not computed)."""

    def cache_tokens(self, state: Any) -> int | None:
        """Token positions per sequence that ``cache_bytes(state)`` covers, where the runtime
        allocates ahead of the tokens held (a buffer sized for the whole generation); None: exactly
        the tokens the cache holds. The bench divides the bytes by this for KV bytes per token."""
        return None

    def close(self) -> None:
        """Free the backend's resources (models, sessions)."""


@dataclass
class EnginePair:
    """Dense and HARP engines of one backend, with what both share."""

    backend: str
    dense: Engine
    harp: Engine
    tokenizer: Any
    dims: ModelDims
    pruned: dict[int, float]
    info: dict[str, Any] = field(default_factory=dict)   # what was loaded (paths, digests, threads)

    def engines(self) -> dict[str, Engine]:
        return {"dense": self.dense, "harp": self.harp}

    @property
    def max_positions(self) -> int:
        return min(self.dense.max_positions, self.harp.max_positions)

    def close(self) -> None:
        self.dense.close()
        self.harp.close()


# name -> loader(plan, source, config) -> EnginePair; ``source`` is a ResolvedModel (torch) or a
# mapping {"dense": folder, "harp": folder} of built engines (ort).

