"""Graph-rewrite rules: one class per kind of attention core, each with ``pattern`` (candidate
cores for a layer), ``check`` (a structural match, or the reason it failed) and ``rewrite``
(the protocol of ``harp_trt/graph_rules.py``). This module is the one place that orders them.

Every rule replaces a pruned layer's attention block, from the input-norm output ``x`` to the
tensor added into the residual stream, with HARP's per-token linear map (arXiv 2507.01900,
Eq. 4-5; ``fold.py`` for the exact GQA fold)::

    h <- h + MatMul(MatMul(x, W_V) + b_V, alpha * W_O_fold) (+ alpha * b_O)
    h <- h + post_norm_{alpha * g}(MatMul(MatMul(x, W_V) + b_V, W_O_fold))   (post-attn norm, Gemma2)

and ``alpha = 0`` removes the block (the residual add becomes the identity). Q, K, rotary, the
attention core and the layer's KV-cache inputs/outputs are left dead and removed by the pass.

Names (``layers.{i}`` in node names, torch's ``pkg.torch.onnx.name_scopes``) are only used to
*locate* a layer's core when the KV-cache inputs do not; everything used to rewrite is checked
structurally: the V path is pure data movement from one constant-weight MatMul, o_proj is a
constant-weight MatMul fed only by the core, and the residual add's other input feeds ``x``.

Files: ``base.py`` (the match, the edit record and ``AttentionRule``: the shared V/o_proj/residual
tracing and the rewrite), ``tracing.py`` (the traces), ``edit.py`` (graph edits), and one file per
attention form: ``onnx_attention.py``, ``group_query_attention.py``, ``softmax_attention.py``."""
from __future__ import annotations

from .base import AttentionMatch, AttentionRule, LayerEdit, MatchResult, describe
from .group_query_attention import GroupQueryAttentionRule
from .onnx_attention import OnnxAttentionRule
from .softmax_attention import SoftmaxAttentionRule

__all__ = ["AttentionMatch", "MatchResult", "AttentionRule", "OnnxAttentionRule",
           "SoftmaxAttentionRule", "GroupQueryAttentionRule", "DEFAULT_RULES", "LayerEdit", "describe"]

# the order the pass tries them in for every layer (the first whose check matches rewrites it) and
# the order ``count_attention_layers`` looks for a kind of core in
DEFAULT_RULES: tuple[AttentionRule, ...] = (OnnxAttentionRule(), GroupQueryAttentionRule(), SoftmaxAttentionRule())
