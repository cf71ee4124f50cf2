"""Serving an ORT engine to many clients at once: requests, sampling parameters and a
continuously batched generator. The Triton Python-backend model (``builders/triton/assets/
ort_llm_model.py``) is a thin shell around ``BatchedGenerator``; so is anything else that serves.

Requests arrive at any time. Each scheduling step prefills the newly admitted requests (one graph
call each, batch 1) and then decodes one token for every active request in a single batched graph
call: their KV caches (kept layers only: a HARP engine has no KV for pruned layers) are
left-padded to a common length and the padding is masked, as a left-padded batch is. A request
served alone runs exactly the calls ``OrtCausalLM.generate`` makes, so its greedy tokens are those
of ``harp-trt generate``.

Sampling parameters follow the names of Triton's vLLM backend (``sampling_parameters`` JSON:
``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_token_ids``,
``ignore_eos``); unlike vLLM, the default is greedy (``temperature`` 0)."""
from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import ConfigError
from .ort_session import OrtCausalLM, StaticCache, sample_next

__all__ = ["SamplingParams", "GenerationRequest", "BatchedGenerator", "SAMPLING_KEYS"]

log = logging.getLogger(__name__)

SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @classmethod
    def from_json(cls, text: str | None) -> "SamplingParams":
        """Parse a ``sampling_parameters`` string; ConfigError names the bad or unknown key."""
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"sampling_parameters is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("sampling_parameters must be a JSON object")
        unknown = sorted(set(raw) - set(SAMPLING_KEYS))
        if unknown:
            raise ConfigError(f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                              f"valid: {', '.join(SAMPLING_KEYS)}")
        try:
            p = cls(max_tokens=int(raw.get("max_tokens", 16)), temperature=float(raw.get("temperature", 0.0)),
                    top_k=int(raw.get("top_k", 0)), top_p=float(raw.get("top_p", 1.0)),
                    seed=None if raw.get("seed") is None else int(raw["seed"]),
                    stop_token_ids=tuple(int(t) for t in raw.get("stop_token_ids", ())),
                    ignore_eos=bool(raw.get("ignore_eos", False)))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sampling_parameters: {e}") from None
        if p.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if p.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ConfigError(f"top_p must lie in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {p.top_k}")
        return p


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
    last: int = -1                    # the token to feed next
    generated: int = 0
    rng: Any = None


class BatchedGenerator:
    """Continuous batching over one ``OrtCausalLM`` (one thread calls ``step``)."""

    def __init__(self, lm: OrtCausalLM, eos_token_ids: tuple[int, ...] = (), max_active: int = 8,
                 max_seq_len: int | None = None, on_decode: Callable[[int], None] | None = None):
        """``on_decode(batch_size)`` is called after every batched decode call: how a server reports
        how many sequences it decoded together (Triton's own statistics count one execution per
        request, since this model batches inside itself)."""
        if max_active < 1:
            raise ConfigError(f"max_active must be >= 1, got {max_active}")
        self.lm = lm
        self.eos = tuple(int(t) for t in eos_token_ids)
        self.max_active = max_active
        self.max_seq_len = max_seq_len
        self.pending: "queue.Queue[GenerationRequest]" = queue.Queue()
        self.active: list[GenerationRequest] = []
        self.steps = 0
        self.max_batch_seen = 0
        self.on_decode = on_decode

    def submit(self, req: GenerationRequest) -> None:
        n = int(np.asarray(req.prompt_ids).size)
        if n == 0:
            raise ConfigError("empty prompt: nothing to condition on")
        if self.max_seq_len is not None and n + req.params.max_tokens > self.max_seq_len:
            raise ConfigError(f"prompt of {n} tokens + max_tokens {req.params.max_tokens} exceeds the "
                              f"limit of {self.max_seq_len} tokens")
        self.pending.put(req)

    # ---- one scheduling step ---------------------------------------------------------------------
    def step(self, wait: float | None = None) -> bool:
        """Admit, prefill and decode once. Returns False when there was nothing to do."""
        if not self.active:
            try:
                self.active.append(self.pending.get(timeout=wait) if wait else self.pending.get_nowait())
                self._prefill(self.active[-1])
            except queue.Empty:
                return False
        while len(self.active) < self.max_active:
            try:
                req = self.pending.get_nowait()
            except queue.Empty:
                break
            self.active.append(req)
            self._prefill(req)
        self.active = [r for r in self.active if not self._finished(r)]
        if self.active:
            self._decode(self.active)
            self.active = [r for r in self.active if not self._finished(r)]
        self.steps += 1
        return True

    def _finished(self, r: GenerationRequest) -> bool:
        return r.last == -2

    def _done(self, r: GenerationRequest, tokens: list[int], reason: str) -> None:
        r.past = {}
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

    def _prefill(self, r: GenerationRequest) -> None:
        if r.cancelled():
            self._done(r, [], "cancelled")
            return
        ids = np.asarray(r.prompt_ids, dtype=np.int64).reshape(1, -1)
        n = ids.shape[1]
        # generate's prefill: chunked into a static cache (batch 1), the last position's logits only
        logits, cache = self.lm.prefill(ids, np.ones_like(ids), np.arange(n, dtype=np.int64)[None], n + 1)
        r.past, r.length = (cache.past() if isinstance(cache, StaticCache) else cache), n
        self._accept(r, self._sample(r, logits[0, -1]))

    def _decode(self, batch: list[GenerationRequest]) -> None:
        b = len(batch)
        self.max_batch_seen = max(self.max_batch_seen, b)
        T = max(r.length for r in batch)
        ids = np.array([[r.last] for r in batch], dtype=np.int64)
        pos = np.array([[r.length] for r in batch], dtype=np.int64)
        mask = np.zeros((b, T + 1), dtype=np.int64)
        for j, r in enumerate(batch):
            mask[j, T - r.length:] = 1
        if b == 1:
            past = batch[0].past
        else:
            past = {}
            for i in self.lm.kv_layers:
                k0 = batch[0].past[i][0]
                shape = (b, k0.shape[1], T, k0.shape[3])
                k, v = np.zeros(shape, k0.dtype), np.zeros(shape, k0.dtype)
                for j, r in enumerate(batch):
                    k[j, :, T - r.length:] = r.past[i][0][0]
                    v[j, :, T - r.length:] = r.past[i][1][0]
                past[i] = (k, v)
        logits, present = self.lm.forward(ids, mask, pos, past)
        for j, r in enumerate(batch):
            start = T - r.length
            r.past = {i: (k[j:j + 1, :, start:], v[j:j + 1, :, start:]) for i, (k, v) in present.items()}
            r.length += 1
            self._accept(r, self._sample(r, logits[j, -1]))
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
                    r.past = {}
                    r.emit([], True, f"error: {type(e).__name__}: {e}")
                self.active = []
