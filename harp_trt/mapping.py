"""Tensor / pipeline parallel rank arithmetic, defined once (the idea of TensorRT-LLM's
``tensorrt_llm/mapping.py``: one object owns which rank holds what).

* rank ``N`` of a ``tp_size x pp_size`` layout is tensor-parallel shard ``N % tp_size`` of pipeline
  stage ``N // tp_size``, i.e. ``N = tp_rank + pp_rank * tp_size``; a checkpoint has one
  ``rank{N}.safetensors`` per rank and ``world_size = tp_size * pp_size`` of them;
* pipeline stage ``p`` owns ``torch.tensor_split(range(L), pp_size)[p]``: consecutive layers, the
  first ``L % pp_size`` stages one more than the others (TensorRT-LLM ``Mapping.pp_layers``).

Both the TensorRT-LLM checkpoint writer and its reader use this module. That does not weaken the
reader as an oracle: its independence matters for *model facts* (what an architecture computes,
``builders/trtllm/trtllm_models.py``), where writer and reader each follow their own table so a
wrong row fails the golden test. The layout here is a convention both sides must share by
construction (a reader with a different split could not even find the writer's tensors); what
guards it against TensorRT-LLM's own split is a test with literal layer lists
(``tests/test_trtllm_checkpoint.py::test_pp_layer_assignment_gives_first_stages_the_extra_layer``).
Pure integer arithmetic: no torch, no I/O."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ParallelMapping"]


@dataclass(frozen=True)
class ParallelMapping:
    """A ``tp_size x pp_size`` layout of ranks."""

    tp_size: int = 1
    pp_size: int = 1

    @classmethod
    def from_config(cls, mapping: Mapping[str, Any] | None) -> "ParallelMapping":
        """From a checkpoint's ``mapping`` (or any dict with ``tp_size`` / ``pp_size``; absent = 1)."""
        m = mapping or {}
        return cls(int(m.get("tp_size", 1)), int(m.get("pp_size", 1)))

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        """The rank (and rank file index) of tensor shard ``tp_rank`` in pipeline stage ``pp_rank``."""
        return tp_rank + pp_rank * self.tp_size

    def pp_layers(self, num_layers: int, pp_rank: int) -> list[int]:
        """Global indices of the layers pipeline stage ``pp_rank`` owns, in order."""
        base, extra = divmod(num_layers, self.pp_size)
        start = pp_rank * base + min(pp_rank, extra)
        return list(range(start, start + base + (1 if pp_rank < extra else 0)))

    def to_config(self) -> dict[str, int]:
        """The checkpoint ``config.json`` ``mapping`` entry."""
        return {"world_size": self.world_size, "tp_size": self.tp_size, "pp_size": self.pp_size}
