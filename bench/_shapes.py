"""Model shapes, one table for every benchmark script: the Hugging Face config fields of published
models (weights are random: shapes alone decide time and memory), plus the tiny shapes the tests
and ``--dry-run`` use. ``bench/scale_probe.py`` and ``bench/long_context.py --shape`` write a
random-weight folder of one; the GPU scripts (``gpu_check.py``, ``gpu_prefill.py``,
``_gpu_engines.py``) build one on the device. Light: no imports, so ``--help`` stays fast."""
from __future__ import annotations

__all__ = ["SHAPES", "GPU_MODELS", "DRY_RUN", "head_dim"]

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_QWEN2_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                 max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6)
_TINY = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
             vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048, rope_theta=10000.0,
             rms_norm_eps=1e-6)

SHAPES: dict[str, dict] = {
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                        tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
    # Qwen/Qwen2-7B, the base model the qwen2-7b preset names (its -Instruct says 32768 positions;
    # nothing we export or measure depends on the field: RoPE is computed from positions)
    "qwen2-7b": dict(model_type="qwen2", **_QWEN2_7B),
    # Qwen2-7B's dimensions in the llama family (no q/k/v bias: 0.01 % of the weights): llama.cpp's
    # deci graph has no attention bias, so a Qwen2 plan has no deci GGUF (harp_trt/families/qwen2.py);
    # the long-context bench times llama.cpp at 7B on this one, ORT on both
    "qwen2-7b-llama": dict(model_type="llama", **_QWEN2_7B),
    # Qwen2-7B with 4 of its 28 layers: every layer, the embedding and the LM head at 7B size, small enough
    # for an fp32 engine and PyTorch fp32 side by side in 24 GB (bench/prefill_profile.py --shape);
    # a prefill that returns the last position's logits spends its time per layer, so per-layer ratios hold
    "qwen2-7b-4layers": dict(model_type="qwen2", **{**_QWEN2_7B, "num_hidden_layers": 4}),
    # Qwen/Qwen2-1.5B
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # the long-context shapes of bench/long_context.py --shape: small enough for a 24 GB
    # CPU machine, positions past 8192. Qwen/Qwen2.5-0.5B and meta-llama/Llama-3.2-1B
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
                        tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=500000.0,
                        rms_norm_eps=1e-5, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}),
    # tiny shapes for tests: SmolLM2's vocabulary (scale_probe borrows its tokenizer)
    "tiny": dict(model_type="qwen2", **_TINY),
    "tiny-llama": dict(model_type="llama", **_TINY),
    # the GPU scripts' --dry-run: their code path at toy size on any device (no tokenizer needed)
    "tiny-gpu": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False),
}

GPU_MODELS = ("llama3.1-8b", "qwen2-7b")  # the shapes the GPU scripts' --model offers
DRY_RUN = "tiny-gpu"


def head_dim(shape: dict) -> int:
    """The shape's head dimension: its ``head_dim``, else hidden / heads (as the configs default it)."""
    return int(shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"])
