"""The ONNX Runtime engine: ``harp_trt.ort_session.OrtCausalLM`` on a dense engine folder and on
the HARP (rewritten) one, in one process. A folder is a ``harp_trt.builders.ort`` engine (``engine.json``
+ ``model.onnx``) or any folder with a ``model.onnx`` following the export I/O contract, plus the
tokenizer and ``config.json``."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harp_trt.engine_spec import is_engine, read_engine_spec
from harp_trt.errors import PreconditionError
from harp_trt.ort_session import StaticCache
from harp_trt.store import Artifact

from .engines import Engine, EnginePair
from harp_trt.dims import ModelDims

__all__ = ["OrtEngine", "load_ort_pair", "engine_folder"]

log = logging.getLogger(__name__)


class OrtEngine(Engine):
    """The exported graph returns logits for every position, so a prefill computes all of them."""

    backend = "ort"
    prefill_logits = "all"

    def __init__(self, session, variant: str, max_positions: int):
        self.session = session
        self.variant = variant
        self._max = max_positions

    @property
    def max_positions(self) -> int:
        return self._max

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        x = ids.numpy().astype(np.int64)
        b, s = x.shape
        pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
        logits, present = self.session.forward(x, np.ones((b, s), np.int64), pos, None)
        return torch.from_numpy(np.ascontiguousarray(logits[:, -1], dtype=np.float32)), (present, s)

    def written_state(self, batch: int, length: int, seed: int = 0) -> tuple[Any, int]:
        """A state as if ``length`` tokens of ``batch`` sequences had been prefilled, its KV cache
        written directly with N(0, 1) values: a decode step's cost depends on the cache's length, not
        on what it holds, and a 7B prefill of 8192 tokens takes most of an hour on 2 cores.
        On a GroupQueryAttention engine the values are written straight into the ``StaticCache`` the
        decode steps append to (room for 256 more), so a 7B batch of 8192-token caches is held once,
        not once as arrays and again as the cache; else the first ``decode`` moves them there."""
        lm, rng = self.session, np.random.default_rng(seed)
        shape = (batch, lm.kv_heads, length, lm.head_dim)
        if not lm.shares_kv_buffer:
            return {i: (rng.standard_normal(shape, np.float32).astype(lm.kv_dtype, copy=False),
                        rng.standard_normal(shape, np.float32).astype(lm.kv_dtype, copy=False))
                    for i in lm.kv_layers}, length
        empty = np.zeros((batch, lm.kv_heads, 0, lm.head_dim), lm.kv_dtype)
        cache = lm.static_cache({i: (empty, empty) for i in lm.kv_layers}, min(self._max, length + 257))
        for k, v in cache.buffers.values():
            k[:, :, :length] = rng.standard_normal(shape, np.float32)
            v[:, :, :length] = rng.standard_normal(shape, np.float32)
        cache.length = length
        return cache, length

    def replicate(self, state: Any, batch: int) -> tuple[Any, int]:
        """A batch-1 prefill's state as ``batch`` rows holding copies of its KV cache (the long-context
        bench's decode set-up: one row's prefill instead of ``batch``)."""
        past, p = state
        if isinstance(past, StaticCache) or next(iter(past.values()))[0].shape[0] != 1:
            raise ValueError("replicate takes the state of a batch-1 prefill")
        return {i: (np.repeat(k, batch, 0), np.repeat(v, batch, 0)) for i, (k, v) in past.items()}, p

    def decode(self, token: torch.Tensor, state: Any) -> tuple[torch.Tensor, Any]:
        """One step; on a GroupQueryAttention engine the first decode moves the prefill's cache
        into a ``StaticCache`` (in-place appends, as ``OrtCausalLM.generate`` decodes)."""
        past, p = state
        x = token.numpy().astype(np.int64)
        b = x.shape[0]
        mask, pos = np.ones((b, p + 1), np.int64), np.full((b, 1), p, np.int64)
        if isinstance(past, StaticCache) or self.session.shares_kv_buffer:
            cache = past if isinstance(past, StaticCache) else self.session.static_cache(past, min(self._max, p + 257))
            logits = self.session.decode_step(cache, x, mask, pos)
            return torch.from_numpy(np.ascontiguousarray(logits[:, -1], dtype=np.float32)), (cache, p + 1)
        logits, present = self.session.forward(x, mask, pos, past)
        return torch.from_numpy(np.ascontiguousarray(logits[:, -1], dtype=np.float32)), (present, p + 1)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids.numpy().astype(np.int64)
        b, s = x.shape
        pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s))
        logits, _ = self.session.forward(x, np.ones((b, s), np.int64), pos, None)
        return torch.from_numpy(np.asarray(logits, dtype=np.float32))

    def cache_bytes(self, state: Any) -> int:
        past, _ = state
        if isinstance(past, StaticCache):
            return past.nbytes()
        return int(sum(k.nbytes + v.nbytes for k, v in past.values()))

    def close(self) -> None:
        self.session = None


def engine_folder(s: Any) -> Path:
    """The folder of a bench source: an artifact's path, or a path."""
    return s.path if isinstance(s, Artifact) else Path(s)


def load_ort_pair(plan, source, config) -> EnginePair:
    """``source``: ``{"dense": folder|Artifact, "harp": folder|Artifact}``."""
    from transformers import AutoConfig

    from harp_trt.models import load_tokenizer
    from harp_trt.ort_session import OrtCausalLM

    folders = {v: engine_folder(source[v]) for v in ("dense", "harp")}
    for v, f in folders.items():
        if not (f / "config.json").is_file():
            raise PreconditionError("bench", f"{v} engine folder {f} has no config.json",
                                    "engine folders carry the model's config and tokenizer files")
    cfg = AutoConfig.from_pretrained(folders["dense"], trust_remote_code=False)
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
    threads = config.threads or None
    engines = {}
    for v, f in folders.items():
        if is_engine(f):
            sess = OrtCausalLM.from_engine(f, intra_op_threads=threads)
        else:
            sess = OrtCausalLM(f / "model.onnx", intra_op_threads=threads)
        engines[v] = OrtEngine(sess, v, max_pos)
    kept = set(engines["harp"].session.kv_layers)
    want = set(range(cfg.num_hidden_layers)) - set(plan.layers)
    if kept != want:
        raise PreconditionError("bench", f"HARP engine {folders['harp']} keeps KV for layers {sorted(kept)}; the "
                                f"plan keeps {sorted(want)}", "rebuild the HARP engine from this plan")
    tok = load_tokenizer(folders["dense"])
    info = {v: {"folder": str(f), "threads": engines[v].session.intra_op_threads,
                "providers": engines[v].session.providers,
                "engine": read_engine_spec(f) if is_engine(f) else None}
            for v, f in folders.items()}
    log.info("ort engines: dense %s, harp %s", folders["dense"], folders["harp"])
    return EnginePair("ort", engines["dense"], engines["harp"], tok, ModelDims.from_config(cfg),
                      plan.alpha_map, info)
