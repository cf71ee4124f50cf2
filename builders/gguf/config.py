"""``GgufConfig``: how the llama.cpp GGUF of a HARP plan is written. Light on purpose (no torch, no
gguf, no llama_cpp): the CLI builds its parser from these fields."""
from __future__ import annotations

import dataclasses
import difflib
from typing import ClassVar

from harp_trt.config import StageConfig
from harp_trt.errors import ConfigError

__all__ = ["GgufConfig", "DTYPES", "GGUF_TYPES"]

DTYPES = ("f32", "f16", "bf16")  # tensor types the writer stores (norms and other 1-D tensors stay f32)
# llama.cpp quantization types (``enum llama_ftype`` in vendor/llama.cpp include/llama.h,
# ``LLAMA_FTYPE_MOSTLY_<NAME>``) that need no importance matrix; run by llama.cpp's own quantizer
GGUF_TYPES = ("none", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l",
              "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")


@dataclasses.dataclass(frozen=True)
class GgufConfig(StageConfig):
    """``dtype``: the written file's matrices (f32 | f16 | bf16). ``gguf_type``: also quantize it with
    ``llama_model_quantize`` to this llama.cpp type (none: do not). ``verify``: run the written
    (unquantized) file in llama.cpp and compare its logits over ``verify_tokens`` positions with the
    PyTorch HARP reference (and its greedy tokens). ``context``: the context length written
    (0 = the model's ``max_position_embeddings``)."""

    VERSION: ClassVar[int] = 1
    dtype: str = "f16"
    gguf_type: str = "none"
    verify: bool = True
    verify_tokens: int = 24
    context: int = 0

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported GGUF dtype {self.dtype!r}; valid: {', '.join(DTYPES)}", _hint(self.dtype, DTYPES))
        if self.gguf_type not in GGUF_TYPES:
            raise ConfigError(f"unknown GGUF type {self.gguf_type!r}; valid: {', '.join(GGUF_TYPES)}",
                              _hint(self.gguf_type, GGUF_TYPES))
        self.check_ints(("verify_tokens",), 2)
        self.check_ints(("context",), 0)


def _hint(value: object, valid: tuple[str, ...]) -> str | None:
    close = difflib.get_close_matches(str(value).lower(), valid, n=1)
    return f"did you mean {close[0]!r}?" if close else None
