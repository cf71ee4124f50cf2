"""How each model family lands in stock TensorRT-LLM (1.x, TensorRT backend). The facts are plain
data in the family tables (``FamilySpec.trtllm``, a ``harp_trt.families.TrtllmTarget``: one file per
family, nothing to register here); this module looks them up for the writer (``checkpoint.py``), which
never branches on family or architecture names. The reader (``reader.py``) does not read them: it has
its own table of what TensorRT-LLM computes per architecture (``trtllm_models.py``), so that a wrong
fact here fails the golden test instead of passing both sides.

Two routes exist for a HARP-pruned layer (arXiv 2507.01900, Eq. 4-5: the layer computes the per-token
linear map ``alpha * V.O``):

``linear``  (Llama, Mistral) -> ``DeciLMForCausalLM``, the heterogeneous-layer architecture of
    Nemotron-NAS. A pruned layer's attention has ``impl: "linear"``: one ``hidden x hidden`` matrix
    ``alpha * W_O . repeat_kv(W_V)`` (folded in fp32, then cast), no KV cache, no softmax. An
    ``alpha = 0`` layer becomes ``impl: "no_op"`` (no weights at all). Cost per pruned layer and
    token: one d x d GEMM (less than the unfolded V then O GEMMs), zero KV bytes.

``window1`` (Qwen2, Gemma2) -> the family's own architecture (``Qwen2ForCausalLM``,
    ``Gemma2ForCausalLM``). DeciLM has no attention biases (Qwen2's q/k biases change the scores of
    the *kept* layers), no Gemma2 pre/post feed-forward norms, no soft-capping and no query scale, so
    it cannot carry these families. A pruned layer stays a standard attention layer with Q and K
    weights (and biases) zeroed and a per-layer attention window of **one token**
    (``runtime_defaults.max_attention_window``): softmax over a single key is exactly 1, so the
    layer outputs ``o_proj(repeat_kv(v + b_v))`` per token, i.e. HARP exactly, v bias included.
    alpha goes into ``attention.dense`` (Qwen2) or into the post-attention norm gain (Gemma2, whose
    alpha sits after that norm). Cost per pruned layer: the KV cache holds one block
    (``tokens_per_block`` tokens) per sequence instead of the whole sequence (O(1), not O(L)); the
    QKV and dense GEMMs still run (Q/K on zero weights), plus an attention over one key.
"""
from __future__ import annotations

from harp_trt.errors import UnsupportedArchitectureError
from harp_trt.families import FAMILIES, ROUTE_LINEAR, ROUTE_WINDOW1, TrtllmTarget

from .config import TRTLLM_VERSION  # the TensorRT-LLM version every target is written for

__all__ = ["TrtllmTarget", "TARGETS", "target_for", "ROUTE_LINEAR", "ROUTE_WINDOW1", "TRTLLM_VERSION",
           "QK_LAYERNORM_EPS"]

# The eps of TensorRT-LLM's QK-norm RmsNorms: Attention.__init__'s default (layers/attention.py, eps=1e-05),
# which QWenDecoderLayer and GemmaDecoderLayer do not override, whatever the model's rms_norm_eps
# (1e-6 for Qwen3 and Gemma3). The stage's check runs its reference with it; docs/trtllm-contract.md
# row qk-norm-eps (the reader keeps its own copy of the fact, trtllm_models.QK_NORM_EPS).
QK_LAYERNORM_EPS = 1e-5


def _targets() -> dict[str, TrtllmTarget]:
    return {name: FAMILIES.get(name).trtllm for name in FAMILIES if FAMILIES.get(name).trtllm is not None}


TARGETS: dict[str, TrtllmTarget] = _targets()  # family name -> target, read from the family tables


def target_for(family: str) -> TrtllmTarget:
    spec = FAMILIES.get(family)
    target = spec.trtllm
    if target is None:
        why = f": {spec.trtllm_refusal}" if spec.trtllm_refusal else ""
        raise UnsupportedArchitectureError(
            f"no TensorRT-LLM mapping for family {family!r}{why}; supported: {', '.join(sorted(TARGETS))}; "
            "the ORT, genai and Triton targets take it",
            "set `trtllm = TrtllmTarget(...)` on the family's FamilySpec (harp_trt/families/)")
    return target
