"""``GgufConfig``: how the llama.cpp GGUF of a HARP plan is written. Light on purpose (no torch, no
gguf, no llama_cpp): the CLI builds its flags from the fields' ``option`` declarations."""
from __future__ import annotations

import dataclasses
import difflib
from typing import ClassVar

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import DeployTarget, StageCli, StageSpec
from harp_trt.errors import ConfigError

__all__ = ["GgufConfig", "DTYPES", "GGUF_TYPES", "CLI"]

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
    dtype: str = option("f16", help="f32 | f16 | bf16 (default %(default)s)")
    gguf_type: str = option("none", help=(
        "also quantize with llama.cpp's quantizer: none | q8_0 | q4_k_m | ... (default %(default)s)"))
    verify: bool = option(True, flag="--no-verify", negate=True, help=(
        "skip the check that llama.cpp's logits and greedy tokens equal the PyTorch HARP model's"))
    verify_tokens: int = 24
    context: int = option(0, help="context length written, 0 = the model's max_position_embeddings "
                                  "(default %(default)s)")

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


CLI = StageCli(
    build_flags=((("gguf_type",), ""), (("dtype",), "gguf-")),
    own_quant="for llama.cpp quantization use --gguf-type",
    refuses_fitted=(("lmmse", "llama.cpp's deci linear attention holds one hidden x hidden matrix without a "
                              "bias (folded from rrr's V/O): lmmse's bias has no place there"),),
    deploy=DeployTarget(
        help="llama.cpp deci GGUF for a HARP plan (verified in llama.cpp)",
        description="write a llama.cpp GGUF (deci architecture: pruned layers as one folded linear attention, no KV "
                    "cache) for a HARP plan, verified in llama.cpp",
        source="plan", deploy="deploy_gguf", summary="deploy_summary",
        out_help="folder to write (new or empty); default: the cached gguf-<key> artifact in --workdir"))

STAGE = StageSpec("gguf", "harp_trt.builders.gguf.stage:GgufStage", "harp_trt.builders.gguf.config:GgufConfig", "build",
                  "llama.cpp deci GGUF (HARP layers as linear attention), verified in llama.cpp", CLI)
