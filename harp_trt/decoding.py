"""What a decode loop over an ORT engine holds besides the session: the ``StaticCache`` KV buffers a
GroupQueryAttention engine appends to in place, the ``BatchKV`` rows a continuously batched server
decodes in place, and ``sample_next`` (greedy or sampled next tokens). ``harp_trt.ort_session.
OrtCausalLM`` and ``harp_trt.serving.BatchedGenerator`` drive them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .extras import require
from .onnx_io import past_name, present_name

if TYPE_CHECKING:
    from .ort_session import OrtCausalLM

__all__ = ["StaticCache", "BatchKV", "sample_next", "Past"]

Past = dict[int, tuple[np.ndarray, np.ndarray]]


def bind_in_place(lm: OrtCausalLM, buffers: dict[int, tuple[np.ndarray, np.ndarray]], rows: int | None = None):
    """An IO binding of ``lm``'s session with each KV buffer (its first ``rows`` rows: still one
    contiguous block) bound as both ``past_key_values.*`` and ``present.*``, and the OrtValues that
    view the numpy memory (kept alive beside the binding)."""
    ort = require("onnxruntime", "ONNX Runtime sessions need it")

    binding, views = lm.session.io_binding(), []
    for i, (kb, vb) in buffers.items():
        for kind, buf in (("key", kb), ("value", vb)):
            val = ort.OrtValue.ortvalue_from_numpy(buf if rows is None else buf[:rows])
            views.append(val)
            binding.bind_ortvalue_input(past_name(i, kind), val)
            binding.bind_ortvalue_output(present_name(i, kind), val)
    return binding, views


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
        shape = (self.batch, self.lm.kv_heads, capacity, self.lm.head_dim)
        self.buffers = {}
        for i, (k, v) in past.items():
            kb, vb = np.zeros(shape, self.lm.kv_dtype), np.zeros(shape, self.lm.kv_dtype)
            kb[:, :, :self.length], vb[:, :, :self.length] = k[:, :, :self.length], v[:, :, :self.length]
            self.buffers[i] = (kb, vb)
        self.capacity = capacity
        self.binding, self._views = bind_in_place(self.lm, self.buffers)

    def reserve(self, tokens: int) -> None:
        if tokens > self.capacity:
            self._fill(self.buffers, max(tokens, 2 * self.capacity))

    def nbytes(self) -> int:
        """Bytes of the filled part (what a growing cache of ``length`` tokens would hold)."""
        return self.length * self.batch * self.lm.kv_bytes_per_token()

    def past(self) -> Past:
        """The filled part as a ``forward``-style past (views)."""
        return {i: (k[:, :, :self.length], v[:, :, :self.length]) for i, (k, v) in self.buffers.items()}


class BatchKV:
    """In-place KV rows for continuous batching on a GroupQueryAttention engine: buffers
    ``[slots, kv_heads, capacity, head_dim]`` per kept layer, the first ``rows`` rows decoding
    together. Every row ends at the common ``length`` T (left padding, as a left-padded batch: GQA
    appends each row's new token at T, ``seqlens_k``), row j's sequence of ``lens[j]`` tokens
    filling ``[T - lens[j], T)``; the mask hides the rest. A step writes one token per row in place,
    so a decode reads the cache once and copies none of it (a growing past, ``forward``, has ORT
    copy every row's whole KV into a new present each step). Joining copies the new sequence's KV
    in once; leaving moves the last row into the freed one; the padding all rows share is trimmed
    when it grows (one move of the live KV); buffers grow by doubling.

    Under ``max_bytes`` (a server's KV budget) doubling stops at the budget and the shared padding
    is trimmed whenever a row leaves, so the buffers hold at most ``max_bytes`` as long as
    rows x the longest row (the padded footprint ``BatchedGenerator`` admits by) fits in it."""

    TRIM = 64  # shared padding (tokens) that triggers a trim (0 under max_bytes)

    def __init__(self, lm: OrtCausalLM, max_bytes: int | None = None):
        self.lm, self.rows, self.length, self.lens = lm, 0, 0, []
        self.slots, self.capacity = 0, 0
        self.max_bytes = max_bytes
        self.buffers: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._bound = -1

    @property
    def allocated_bytes(self) -> int:
        """Bytes the KV buffers hold (every slot, the whole capacity)."""
        return sum(k.nbytes + v.nbytes for k, v in self.buffers.values())

    def _grow(self, slots: int, capacity: int) -> None:
        if slots <= self.slots and capacity <= self.capacity:
            return
        if self.max_bytes is None:
            slots, capacity = max(slots, 2 * self.slots, 1), max(capacity, 2 * self.capacity, 64)
        else:   # double only as far as the budget (past it, what is needed); the other side may shrink to the live KV
            per = self.lm.kv_bytes_per_token()
            need_s, need_c = max(slots, self.rows, 1), max(capacity, self.length)
            slots = max(need_s, min(max(2 * self.slots, 1), self.max_bytes // (per * need_c)))
            capacity = max(need_c, min(max(2 * self.capacity, 64), self.max_bytes // (per * slots)))
        shape = (slots, self.lm.kv_heads, capacity, self.lm.head_dim)
        new = {}
        for i in self.lm.kv_layers:
            kb, vb = np.zeros(shape, self.lm.kv_dtype), np.zeros(shape, self.lm.kv_dtype)
            if self.buffers:
                k, v = self.buffers[i]
                kb[:self.rows, :, :self.length], vb[:self.rows, :, :self.length] = \
                    k[:self.rows, :, :self.length], v[:self.rows, :, :self.length]
            new[i] = (kb, vb)
        self.buffers, self.slots, self.capacity, self._bound = new, slots, capacity, -1

    def _shift(self, by: int) -> None:
        """Move every row's live KV ``by`` tokens right (positive) or left (negative)."""
        T, b = self.length, self.rows
        for k, v in self.buffers.values():
            for buf in (k, v):
                if by > 0:
                    buf[:b, :, by:T + by] = buf[:b, :, :T].copy()
                else:
                    buf[:b, :, :T + by] = buf[:b, :, -by:T].copy()
        self.length += by

    def add(self, past: Past) -> int:
        """Append one sequence (a batch-1 past of n tokens) as the last row; returns its row."""
        n = int(next(iter(past.values()))[0].shape[2])
        if n > self.length:
            self._grow(self.rows + 1, n + 1)
            self._shift(n - self.length)
        self._grow(self.rows + 1, self.length + 1)
        T, j = self.length, self.rows
        for i, (k, v) in past.items():
            kb, vb = self.buffers[i]
            kb[j, :, T - n:T], vb[j, :, T - n:T] = k[0], v[0]
        self.rows += 1
        self.lens.append(n)
        return j

    def remove(self, j: int) -> None:
        """Drop row ``j``; the last row moves into it (the caller's row order changes the same way)."""
        last = self.rows - 1
        if j != last:
            for k, v in self.buffers.values():
                k[j, :, :self.length], v[j, :, :self.length] = k[last, :, :self.length], v[last, :, :self.length]
            self.lens[j] = self.lens[last]
        self.lens.pop()
        self.rows -= 1
        if not self.rows:
            self.length = 0
        elif self.length - max(self.lens) >= (self.TRIM if self.max_bytes is None else 1):
            self._shift(-(self.length - max(self.lens)))

    def step(self, input_ids: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """One token for every row, appended in place; returns logits [rows, 1, V]."""
        b, T = self.rows, self.length
        self._grow(b, T + 1)
        if self._bound != b:  # views of the first b rows: contiguous, so ORT reads and writes them in place
            self.binding, self._views = bind_in_place(self.lm, self.buffers, b)
            self._bound = b
        mask = np.zeros((b, T + 1), np.int64)
        for j, n in enumerate(self.lens):
            mask[j, T - n:] = 1
        logits = self.lm.bind_step(self.binding, input_ids, mask, position_ids)
        self.length += 1
        self.lens = [n + 1 for n in self.lens]
        return logits


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
