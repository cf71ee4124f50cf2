"""What a decode loop over an ORT engine holds besides the session: the ``StaticCache`` KV buffers a
GroupQueryAttention engine appends to in place, and ``sample_next`` (greedy or sampled next tokens).
``harp_trt.ort_session.OrtCausalLM`` drives both."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .extras import require
from .onnx_io import past_name, present_name

if TYPE_CHECKING:
    from .ort_session import OrtCausalLM

__all__ = ["StaticCache", "sample_next", "Past"]

Past = dict[int, tuple[np.ndarray, np.ndarray]]


class StaticCache:
    """KV buffers ``[B, kv_heads, capacity, head_dim]`` per kept layer, bound once as both
    ``past_key_values.*`` and ``present.*`` of one IO binding; ``length`` tokens are filled.
    GroupQueryAttention sees the same buffer as past and present and appends at ``seqlens_k``
    (onnxruntime ``contrib_ops/cpu/bert/group_query_attention.cc``: past_present_share_buffer);
    the graph takes the sequence length from ``attention_mask``, never from the buffer's size.
    ``reserve`` grows the buffers (one copy) when a step would not fit."""

    def __init__(self, lm: OrtCausalLM, past: Past, capacity: int):
        first = next(iter(past.values()))[0]
        self.lm, self.batch, self.length = lm, first.shape[0], int(first.shape[2])
        self.capacity = 0
        self.buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._fill(past, max(capacity, self.length + 1))

    def _fill(self, past: Past, capacity: int) -> None:
        ort = require("onnxruntime", "ONNX Runtime sessions need it")

        shape = (self.batch, self.lm.kv_heads, capacity, self.lm.head_dim)
        self.buffers = {}
        for i, (k, v) in past.items():
            kb, vb = np.zeros(shape, self.lm.kv_dtype), np.zeros(shape, self.lm.kv_dtype)
            kb[:, :, :self.length], vb[:, :, :self.length] = k[:, :, :self.length], v[:, :, :self.length]
            self.buffers[i] = (kb, vb)
        self.capacity = capacity
        self.binding = self.lm.session.io_binding()
        for i, (kb, vb) in self.buffers.items():  # numpy owns the memory; the OrtValues view it
            for kind, buf in (("key", kb), ("value", vb)):
                val = ort.OrtValue.ortvalue_from_numpy(buf)
                self.binding.bind_ortvalue_input(past_name(i, kind), val)
                self.binding.bind_ortvalue_output(present_name(i, kind), val)

    def reserve(self, tokens: int) -> None:
        if tokens > self.capacity:
            self._fill(self.buffers, max(tokens, 2 * self.capacity))

    def nbytes(self) -> int:
        """Bytes of the filled part (what a growing cache of ``length`` tokens would hold)."""
        return self.length * self.batch * self.lm.kv_bytes_per_token()

    def past(self) -> Past:
        """The filled part as a ``forward``-style past (views)."""
        return {i: (k[:, :, :self.length], v[:, :, :self.length]) for i, (k, v) in self.buffers.items()}


def sample_next(logits: np.ndarray, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """Next token per row from [B, V] logits: argmax, or a sample after temperature, top-k and
    top-p (nucleus: the smallest set of tokens whose probability reaches ``top_p``)."""
    if not do_sample:
        return logits.argmax(-1).astype(np.int64)
    rng = rng or np.random.default_rng()
    x = logits.astype(np.float64) / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[:, -top_k][:, None]
        x = np.where(x < kth, -np.inf, x)
    x = x - x.max(-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1)
        sorted_p = np.take_along_axis(probs, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p      # mass of the tokens ranked above
        keep_sorted = before < top_p                      # always keeps the top token
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(-1, keepdims=True)
    cum = probs.cumsum(-1)
    u = rng.random((probs.shape[0], 1))
    return np.minimum((cum < u * cum[:, -1:]).sum(-1), probs.shape[-1] - 1).astype(np.int64)


# ---- helpers ------------------------------------------------------------------------------------
