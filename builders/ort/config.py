"""``OrtBuildConfig``: the ONNX Runtime build stage's settings. Light on purpose (no onnxruntime):
the CLI builds its flags from the fields' ``option`` declarations."""
from __future__ import annotations

from dataclasses import dataclass

from harp_trt.config import StageConfig, option
from harp_trt.stage_spec import StageSpec
from harp_trt.errors import ConfigError

__all__ = ["OrtBuildConfig", "QuantSpec", "LEVELS", "QUANT_MODES", "ACCURACY_LEVELS", "weight_bytes"]

LEVELS = ("disable", "basic", "extended", "all")  # ORT graph optimization levels, by name
QUANT_MODES = {"none": 0, "int4": 4, "int8": 8, "w8a8": 8}   # mode -> weight bits
ACCURACY_LEVELS = (0, 1, 2, 3, 4)


def weight_bytes(mode: str) -> float:
    """Bytes per quantized weight element of an engine built with ``--quant mode``: its bits / 8,
    and an unquantized engine's fp32 4 ("none"). Scales and the matrices left unquantized are not
    counted."""
    bits = QUANT_MODES[mode]
    return bits / 8 if bits else 4.0


@dataclass(frozen=True)
class QuantSpec:
    """``mode``: none | int4 | int8 (weight-only MatMulNBits) | w8a8 (int8 weights per channel and
    activations per token, ``quant_w8a8.py``). ``block_size``: weights per scale along K (a power of
    two >= 16, MatMulNBits' rule) that must divide every quantized K; w8a8 has no blocks."""

    mode: str = "none"
    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4

    def validate(self) -> None:
        if self.mode not in QUANT_MODES:
            raise ConfigError(f"--quant must be one of {', '.join(QUANT_MODES)}, got {self.mode!r}")
        b = self.block_size
        if b < 16 or b & (b - 1):
            raise ConfigError(f"--quant-block-size must be a power of two >= 16 (MatMulNBits), got {b}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ConfigError(f"--quant-accuracy-level must be one of {ACCURACY_LEVELS}, got {self.accuracy_level}")

    @property
    def bits(self) -> int:
        return QUANT_MODES[self.mode]


@dataclass(frozen=True)
class OrtBuildConfig(StageConfig):
    """``attention``: ``gqa`` converts opset-23 Attention to com.microsoft GroupQueryAttention
    (fastest on CPU), ``onnx`` keeps it. ``optimization_level``: ORT graph optimizations baked into
    the saved model. ``intra_op_threads``: recorded in engine.json for every session of the engine (0 = ORT's
    default; ``harp_trt.engine_spec.engine_threads``).
    ``providers``: () = CUDA when onnxruntime-gpu is installed, else CPU. ``fuse_matmuls``: MatMuls
    of one activation (q/k/v, gate/up) become one MatMul and a Split (``fuse_matmuls.py``, exact:
    onnxruntime-genai's fused QKV). ``logits_to_keep``: a ``logits_to_keep`` input (default 0 = every
    position) that a generator sets to 1 so the LM head runs over the last position only
    (``logits_to_keep.py``). ``verify_rtol``: logits
    tolerance vs the source graph, relative to max(1, max|logits|). ``quant``: none (exact fp32) |
    int4 | int8 weight-only MatMulNBits (``builders/ort/quant.py``) | w8a8 (``quant_w8a8.py``), with ``quant_block_size``,
    ``quant_symmetric``, ``quant_accuracy_level`` and ``quant_embedding`` (the embedding table too,
    ``quant_embedding.py``); a quantized engine is verified against its
    quantized graph before ORT's optimizations, and its gap to the fp32 source is recorded."""

    VERSION = 4     # 4: the logits_to_keep input
    attention: str = "gqa"
    optimization_level: str = "all"
    intra_op_threads: int = 0
    providers: tuple[str, ...] = ()
    verify_rtol: float = 1e-4
    fuse_matmuls: bool = True
    logits_to_keep: bool = True
    quant: str = option("none", help="none (exact fp32) | int4 | int8 (weight-only) | w8a8 (int8 weights and "
                                     "activations: the int8 matrix units, fastest prefill) (default %(default)s)")
    quant_block_size: int = option(32, help="weights per scale along K (default %(default)s)")
    quant_symmetric: bool = option(True, flag="--quant-asymmetric", negate=True,
                                   help="zero points per block (default: symmetric)")
    quant_accuracy_level: int = option(4, help="MatMulNBits compute: 0 = fp32 activations, 4 = int8 "
                                               "(default %(default)s, fastest on CPU)")
    quant_embedding: bool = option(False, flag="--quant-embedding",
                                   help="with --quant: the embedding table too (GatherBlockQuantized, "
                                        "onnxruntime-genai's int4 embedding; less memory, not faster)")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.attention not in ("gqa", "onnx"):
            raise ConfigError(f"OrtBuildConfig.attention must be 'gqa' or 'onnx', got {self.attention!r}")
        if self.optimization_level not in LEVELS:
            raise ConfigError(f"OrtBuildConfig.optimization_level must be one of {', '.join(LEVELS)}, "
                              f"got {self.optimization_level!r}")
        if self.intra_op_threads < 0:
            raise ConfigError(f"OrtBuildConfig.intra_op_threads must be >= 0, got {self.intra_op_threads}")
        if not 0 < self.verify_rtol < 1:
            raise ConfigError(f"OrtBuildConfig.verify_rtol must lie in (0, 1), got {self.verify_rtol}")
        self.quant_spec().validate()

    def quant_spec(self) -> QuantSpec:
        return QuantSpec(self.quant, self.quant_block_size, self.quant_symmetric, self.quant_accuracy_level)


STAGE = StageSpec("build-ort", "harp_trt.builders.ort.builder:OrtBuildStage", "harp_trt.builders.ort.config:OrtBuildConfig", "build",
                  "ONNX Runtime engine folder")
