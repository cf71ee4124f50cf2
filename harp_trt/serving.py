"""Serving an ORT engine to many clients at once: requests, sampling parameters, admission by a KV
budget and a continuously batched generator. The Triton Python-backend model (``builders/triton/
assets/ort_llm_model.py``) is a thin shell around ``BatchedGenerator``; so is anything else that serves.

Requests arrive at any time and wait in a FIFO queue until they are admitted: at most
``max_active`` sequences, and, under a KV budget, only while the batch's KV fits in it: the batch is
left-padded, so that is rows x the longest admitted sequence at its longest (prompt + ``max_tokens``
tokens, kept layers only; for requests of one length, the sum of their KV). The in-place buffers
never grow past the budget (``BatchKV(max_bytes=)``); beside them lives only the cache of the one
prompt being prefilled, until it is copied into its row. A HARP engine,
whose pruned layers hold no KV, admits about L/(L-P) times as many sequences as the dense one at
the same budget. A request that could never fit is refused at once; one that merely has to wait
waits (never refused for lack of room).

Each scheduling step runs one prefill chunk of the oldest admitted request still prefilling
(``OrtCausalLM.prefill_chunks``: chunked prefill, so a long prompt stalls the others one chunk at a
time, not its whole prefill) and then decodes one token for every prefilled request in a single
batched graph call. On a GroupQueryAttention engine on the CPU the requests are rows of one
in-place KV buffer (``harp_trt.decoding.BatchKV``: left-padded rows, each step appends in place and
copies no KV); on other engines each request keeps a growing past, left-padded into a batch each
step (while the batch keeps its members the previous call's present is the next call's past).
Either way a request's greedy tokens are those of ``harp-trt generate`` (tests/test_serving.py).

Sampling parameters follow the names of Triton's vLLM backend (``sampling_parameters`` JSON:
``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_token_ids``,
``ignore_eos``); unlike vLLM, the default is greedy (``temperature`` 0)."""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from .errors import ConfigError
from .memory import sequences_admitted
from .decoding import BatchKV
from .ort_session import OrtCausalLM, StaticCache, sample_next
from .sampling import SAMPLING_KEYS, SamplingParams

__all__ = ["SamplingParams", "GenerationRequest", "BatchedGenerator", "SAMPLING_KEYS"]

log = logging.getLogger(__name__)

# emit(new_token_ids, finished, finish_reason) ; cancelled() -> bool
Emit = Callable[[list[int], bool, "str | None"], None]


@dataclass
class GenerationRequest:
    prompt_ids: np.ndarray
    params: SamplingParams
    emit: Emit
    cancelled: Callable[[], bool] = lambda: False
    # state, filled by the generator
    past: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    length: int = 0                   # tokens in the KV cache
    last: int = -1                    # the token to feed next (-1: still prefilling, -2: finished)
    generated: int = 0
    rng: Any = None
    kv_bytes: int = 0                 # KV reserved for it while admitted (prompt + max_tokens tokens)
    chunks: Iterator | None = None    # its prefill, one graph call per item

    @property
    def tokens_at_most(self) -> int:
        return int(np.asarray(self.prompt_ids).size) + self.params.max_tokens


class BatchedGenerator:
    """Continuous batching over one ``OrtCausalLM`` (one thread calls ``step``; any thread submits)."""

    def __init__(self, lm: OrtCausalLM, eos_token_ids: tuple[int, ...] = (), max_active: int | None = 8,
                 max_seq_len: int | None = None, on_decode: Callable[[int], None] | None = None,
                 kv_budget: int | None = None):
        """``max_active``: most sequences admitted at once (None: no fixed cap, the KV budget
        decides); ``kv_budget``: bytes of KV the admitted sequences may hold at their longest.
        ``on_decode(batch_size)`` is called after every batched decode call: how a server reports
        how many sequences it decoded together (Triton's own statistics count one execution per
        request, since this model batches inside itself)."""
        if max_active is not None and max_active < 1:
            raise ConfigError(f"max_active must be >= 1, got {max_active}")
        if kv_budget is not None and kv_budget <= 0:
            raise ConfigError(f"kv_budget must be a positive byte count, got {kv_budget}")
        self.lm = lm
        self.eos = tuple(int(t) for t in eos_token_ids)
        self.max_active = max_active
        self.max_seq_len = max_seq_len
        self.kv_budget = kv_budget
        self.kv_per_token = lm.kv_bytes_per_token()
        self.kv_reserved = 0
        self._queue: collections.deque[GenerationRequest] = collections.deque()
        self._arrived = threading.Condition()
        self.active: list[GenerationRequest] = []
        # in-place KV rows where the engine appends in place (GroupQueryAttention on the CPU), else a
        # growing past per request, left-padded into a batch each step
        self.kv = BatchKV(lm, kv_budget) if lm.shares_kv_buffer else None
        self.rows: list[GenerationRequest] = []  # the requests of self.kv's rows, in row order
        self._carry: tuple[tuple[int, ...], dict] | None = None  # (batch members, its present KV)
        self.steps = 0
        self.max_batch_seen = 0
        self.max_admitted_seen = 0
        self.on_decode = on_decode

    # ---- admission -------------------------------------------------------------------------------
    def admits(self, tokens: int) -> int | None:
        """How many sequences of ``tokens`` tokens each (prompt + max_tokens) are admitted at once;
        None when nothing but the clients bounds it."""
        return sequences_admitted(tokens, self.kv_per_token, self.kv_budget, self.max_active)

    def submit(self, req: GenerationRequest) -> None:
        """Queue a request; ConfigError when it could never be served."""
        n = int(np.asarray(req.prompt_ids).size)
        if n == 0:
            raise ConfigError("empty prompt: nothing to condition on")
        if self.max_seq_len is not None and n + req.params.max_tokens > self.max_seq_len:
            raise ConfigError(f"prompt of {n} tokens + max_tokens {req.params.max_tokens} exceeds the "
                              f"limit of {self.max_seq_len} tokens")
        req.kv_bytes = req.tokens_at_most * self.kv_per_token
        if self.kv_budget is not None and req.kv_bytes > self.kv_budget:
            raise ConfigError(f"prompt of {n} tokens + max_tokens {req.params.max_tokens} needs "
                              f"{req.kv_bytes / 2**20:.1f} MiB of KV, more than the whole KV budget of "
                              f"{self.kv_budget / 2**20:.1f} MiB", "ask for fewer tokens")
        with self._arrived:
            self._queue.append(req)
            self._arrived.notify()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _admit(self, wait: float | None) -> None:
        """Move queued requests into ``active`` in arrival order while they fit (the first that
        does not fit waits, and so do those behind it)."""
        with self._arrived:
            if not self.active and not self._queue and wait:
                self._arrived.wait(wait)
            while self._queue:
                req = self._queue[0]
                if self.max_active is not None and len(self.active) >= self.max_active:
                    break
                if not self._fits(req):
                    break
                self._queue.popleft()
                self.kv_reserved += req.kv_bytes
                self.active.append(req)
        self.max_admitted_seen = max(self.max_admitted_seen, len(self.active))

    def _fits(self, req: GenerationRequest) -> bool:
        """Whether ``req`` joins within the KV budget. The batch is left-padded to its longest row,
        so what it holds is rows x the longest sequence, not the sum of the sequences: for requests
        of one length the two agree (``sequences_admitted``)."""
        if self.kv_budget is None:
            return True
        longest = max([r.tokens_at_most for r in self.active] + [req.tokens_at_most])
        return (len(self.active) + 1) * longest * self.kv_per_token <= self.kv_budget

    # ---- one scheduling step ---------------------------------------------------------------------
    def step(self, wait: float | None = None) -> bool:
        """Admit, run one prefill chunk and one batched decode. False when there was nothing to do."""
        self._admit(wait)
        if not self.active:
            return False
        filling = next((r for r in self.active if r.last == -1), None)
        if filling is not None:
            self._prefill_chunk(filling)
        ready = [r for r in self.active if r.last >= 0]
        if ready and self.kv is not None:
            self._decode_rows()
        elif ready:
            self._decode(ready)
        self._release()
        self.steps += 1
        return True

    def _release(self) -> None:
        done = [r for r in self.active if r.last == -2]
        if done:
            self.active = [r for r in self.active if r.last != -2]
            self.kv_reserved -= sum(r.kv_bytes for r in done)

    def _done(self, r: GenerationRequest, tokens: list[int], reason: str) -> None:
        r.past, r.chunks = {}, None
        r.last = -2
        r.emit(tokens, True, reason)

    def _sample(self, r: GenerationRequest, logits: np.ndarray) -> int:
        p = r.params
        if r.rng is None:
            r.rng = np.random.default_rng(p.seed)
        return int(sample_next(logits[None], p.temperature > 0, max(p.temperature, 1e-6), p.top_k, p.top_p, r.rng)[0])

    def _accept(self, r: GenerationRequest, tok: int) -> None:
        """Record a new token and emit it (finishing the request where a limit is reached)."""
        r.generated += 1
        stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(self.eos))
        if tok in stops:
            self._done(r, [tok], "stop")
        elif r.generated >= r.params.max_tokens:
            self._done(r, [tok], "length")
        elif r.cancelled():
            self._done(r, [], "cancelled")
        else:
            r.last = tok
            r.emit([tok], False, None)

    def _prefill_chunk(self, r: GenerationRequest) -> None:
        """One graph call of ``r``'s prefill (generate's: chunked into a static cache at batch 1,
        the last position's logits only); the last one samples its first token."""
        if r.cancelled():
            self._done(r, [], "cancelled")
            return
        if r.chunks is None:
            ids = np.asarray(r.prompt_ids, dtype=np.int64).reshape(1, -1)
            n = ids.shape[1]
            r.chunks = self.lm.prefill_chunks(ids, np.ones_like(ids), np.arange(n, dtype=np.int64)[None], n + 1)
        out = next(r.chunks)
        if out is None:
            return
        logits, cache = out
        r.chunks = None
        r.past = cache.past() if isinstance(cache, StaticCache) else cache
        r.length = int(np.asarray(r.prompt_ids).size)
        self._accept(r, self._sample(r, logits[0, -1]))
        if self.kv is not None and r.last >= 0:
            self.kv.add(r.past)  # copied into its row; the request's own cache goes
            self.rows.append(r)
            r.past = {}

    def _decode_rows(self) -> None:
        """One token for every row of ``self.kv``, in place; finished rows leave."""
        rows, b = self.rows, len(self.rows)
        self.max_batch_seen = max(self.max_batch_seen, b)
        logits = self.kv.step(np.array([[r.last] for r in rows], dtype=np.int64),
                              np.array([[r.length] for r in rows], dtype=np.int64))
        for j, r in enumerate(rows):
            r.length += 1
            self._accept(r, self._sample(r, logits[j, -1]))
        for j in reversed(range(len(rows))):
            if rows[j].last == -2:   # BatchKV.remove moves its last row into j: so does this list
                self.kv.remove(j)
                rows[j] = rows[-1]
                rows.pop()
        if self.on_decode is not None:
            self.on_decode(b)

    def _batch_past(self, batch: list[GenerationRequest], T: int) -> dict:
        """The batch's KV, left-padded to ``T`` tokens: the last call's present when the batch kept
        its members (no copy), else assembled from each request's own."""
        members = tuple(id(r) for r in batch)
        if self._carry is not None and self._carry[0] == members:
            return self._carry[1]
        if len(batch) == 1:
            return batch[0].past
        past = {}
        for i in self.lm.kv_layers:
            k0 = batch[0].past[i][0]
            shape = (len(batch), k0.shape[1], T, k0.shape[3])
            k, v = np.zeros(shape, k0.dtype), np.zeros(shape, k0.dtype)
            for j, r in enumerate(batch):
                k[j, :, T - r.length:] = r.past[i][0][0]
                v[j, :, T - r.length:] = r.past[i][1][0]
            past[i] = (k, v)
        return past

    def _decode(self, batch: list[GenerationRequest]) -> None:
        b = len(batch)
        self.max_batch_seen = max(self.max_batch_seen, b)
        T = max(r.length for r in batch)
        ids = np.array([[r.last] for r in batch], dtype=np.int64)
        pos = np.array([[r.length] for r in batch], dtype=np.int64)
        mask = np.zeros((b, T + 1), dtype=np.int64)
        for j, r in enumerate(batch):
            mask[j, T - r.length:] = 1
        logits, present = self.lm.forward(ids, mask, pos, self._batch_past(batch, T))
        self._carry = (tuple(id(r) for r in batch), present)
        for j, r in enumerate(batch):
            start = T - r.length
            r.past = {i: (k[j:j + 1, :, start:], v[j:j + 1, :, start:]) for i, (k, v) in present.items()}
            r.length += 1
            self._accept(r, self._sample(r, logits[j, -1]))
        if any(r.last == -2 for r in batch):
            self._carry = None  # a member left: the next batch is assembled afresh
        if self.on_decode is not None:
            self.on_decode(b)

    # ---- a serving loop --------------------------------------------------------------------------
    def serve(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Run ``step`` until ``stop`` is set; a failing step fails the requests it held."""
        while not stop.is_set():
            try:
                self.step(wait=idle_wait)
            except Exception as e:  # noqa: BLE001 - report to every client, keep serving
                log.exception("generation step failed")
                for r in self.active:
                    r.past, r.chunks, r.last = {}, None, -2
                    r.emit([], True, f"error: {type(e).__name__}: {e}")
                self._release()
                self._carry = None
                self.kv, self.rows = (BatchKV(self.lm, self.kv_budget) if self.kv is not None else None), []
