"""The llama.cpp engine: a dense and a HARP GGUF (``builders/gguf``: llama.cpp's ``deci``
architecture, whose layers may have no KV heads) run through llama.cpp's C API
(``llama_cpp``, the llama-cpp-python bindings: ``llama_decode`` on a ``llama_batch``), with flash
attention on, in one process.

* Each engine keeps one ``llama_context`` per batch size (``n_seq_max`` = B, one KV stream per
  sequence); a prefill clears its memory (``llama_memory_clear``) and decodes the prompts as one
  batch, asking for the last position's logits (``prefill_logits = "last"``); a decode step is one
  token per sequence; ``logits`` decodes each row with every position's logits on.
* The batch-1 context has room for ``max_position_embeddings`` tokens (at most
  ``CONTEXT_CAP``) so lm-eval's long contexts fit; other batch sizes get what their prompts need
  plus ``headroom``. Past the room a context is rebuilt twice as large from the tokens so far.
* ``cache_bytes`` is llama.cpp's own account of the KV cache it allocated for the context: the line
  ``llama_kv_cache: size = X MiB (N cells, L layers, S/M seqs), K (t): .., V (t): ..`` that
  ``llama_kv_cache::llama_kv_cache`` logs (vendor/llama.cpp/src/llama-kv-cache.cpp, from
  ``size_k_bytes() + size_v_bytes()``, the ``ggml_nbytes`` of every layer's K and V tensors), read
  through a ``llama_log_set`` callback while the context is created. It has 0.01 MiB resolution.
  ``cache_tokens`` is the cells it covers (N per stream x streams), so the bench's KV bytes per
  token are bytes per allocated cell. With flash attention a layer without KV heads adds nothing;
  without it llama.cpp pads such a layer's V to full width ([TAG_V_CACHE_VARIABLE] there), which is
  why flash attention is on.
* ``kv_dtype_bytes`` comes from the same line (f16 by default: llama.cpp's ``type_k``/``type_v``;
  ``kv_type="q8_0"`` sets both to q8_0, 34 bytes per 32 elements)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from harp_trt.errors import PreconditionError
from harp_trt.store import Artifact

from .engines import Engine, EnginePair

__all__ = ["LlamaCppEngine", "load_llamacpp_pair", "gguf_path", "CONTEXT_CAP", "KV_TYPES"]

log = logging.getLogger(__name__)

STAGE = "bench"
GGUF_FILE = "model.gguf"
REPORT = "harp_gguf.json"   # builders/gguf's report (not imported: stages meet through artifacts)
CONTEXT_CAP = 8192   # tokens the batch-1 context holds at most (its KV is allocated up front)
_KV_LINE = re.compile(r"llama_kv_cache: size = *([\d.]+) MiB \( *(\d+) cells, *(\d+) layers, *(\d+)/(\d+) seqs\), "
                      r"K \((\w+)\): *[\d.]+ MiB, V \((\w+)\)")
# bytes per cached element of llama.cpp's KV types (q8_0: blocks of 32 int8 values + one f16 scale,
# 34 bytes per 32 elements: vendor/llama.cpp/ggml/src/ggml-common.h, block_q8_0)
_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}
KV_TYPES = ("f16", "q8_0")
_CAPTURE: list[str] | None = None


def _lc():
    try:
        import llama_cpp
    except ImportError as exc:
        raise PreconditionError(STAGE, f"llama_cpp does not import: {exc}", "pip install -e '.[test]' "
                                "(llama-cpp-python, built from its sdist where no wheel serves)") from exc
    return llama_cpp


_CALLBACK = None


def _callback(lc):
    """One ctypes callback for llama.cpp's log (it must outlive every call into llama.cpp): lines
    are kept while ``_CAPTURE`` is a list, errors go to this module's logger as warnings."""
    global _CALLBACK
    if _CALLBACK is None:
        @lc.llama_log_callback
        def callback(level, text, user_data):
            line = text.decode("utf-8", "replace")
            if _CAPTURE is not None:
                _CAPTURE.append(line)
            if level == 4:  # GGML_LOG_LEVEL_ERROR (vendor/llama.cpp/ggml/include/ggml.h: enum ggml_log_level)
                log.warning("llama.cpp: %s", line.rstrip())

        _CALLBACK = callback
    return _CALLBACK


@contextlib.contextmanager
def _captured_log(lc) -> Iterator[list[str]]:
    """The lines llama.cpp logs inside the block, through this module's callback; the callback that
    was set before (``llama_log_get``: llama-cpp-python's, or another module's capture) is restored
    after, so neither takes the other's log away."""
    global _CAPTURE
    prev, data = lc.llama_log_callback(), ctypes.c_void_p()
    lc.llama_log_get(ctypes.byref(prev), ctypes.byref(data))
    lines: list[str] = []
    _CAPTURE = lines
    lc.llama_log_set(_callback(lc), ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        _CAPTURE = None
        lc.llama_log_set(prev, data)


@dataclass
class _Context:
    ctx: Any
    n_seq: int
    cells: int           # KV cells per stream (per sequence)
    kv_bytes: int        # llama.cpp's KV size (all streams)
    kv_cells: int        # cells those bytes cover (all streams)
    kv_type: str


@dataclass
class _State:
    context: _Context
    tokens: np.ndarray   # [B, T] every token decoded so far (a rebuilt context replays them)


class LlamaCppEngine(Engine):
    backend = "llamacpp"
    prefill_logits = "last"

    def __init__(self, path: Path, variant: str, threads: int, headroom: int, max_positions: int,
                 kv_type: str = "f16", n_gpu_layers: int | None = None):
        self.lc = lc = _lc()
        if kv_type not in KV_TYPES:
            raise PreconditionError(STAGE, f"KV cache type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
        self.kv_type = kv_type
        lc.llama_backend_init()
        self.path, self.variant, self.headroom = Path(path), variant, int(headroom)
        self.threads = int(threads or os.cpu_count() or 1)  # 0: every core, as ONNX Runtime's default
        params = lc.llama_model_default_params()
        if n_gpu_layers is not None:  # layers offloaded to a GPU backend, -1: all (bench/gpu_*.py); None
            params.n_gpu_layers = int(n_gpu_layers)  # keeps llama_model_default_params' (llama-model.cpp)
        with _captured_log(lc):  # the loader's metadata dump, not printed
            self.model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.model:
            raise PreconditionError(STAGE, f"llama.cpp cannot load {self.path}", "pass a GGUF written by "
                                    "`harp-trt deploy gguf` or build --backend gguf")
        self.vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)))
        self._max = int(max_positions)
        self._contexts: dict[int, _Context] = {}
        self.kv_dtype_bytes = _TYPE_BYTES.get(self._context(1, 1).kv_type)

    @property
    def max_positions(self) -> int:
        return self._max

    # ---- contexts ------------------------------------------------------------------------------
    def _context(self, n_seq: int, need: int) -> _Context:
        """The context for ``n_seq`` sequences with room for ``need`` tokens each (built or rebuilt)."""
        c = self._contexts.get(n_seq)
        if c is not None and c.cells >= need:
            return c
        if c is not None:
            self.lc.llama_free(c.ctx)
        room = max(need, min(self._max, CONTEXT_CAP) if n_seq == 1 else need + self.headroom)
        if c is not None:
            room = max(room, 2 * c.cells)
        c = self._create(n_seq, room)
        self._contexts[n_seq] = c
        return c

    def _create(self, n_seq: int, room: int) -> _Context:
        """A new context of ``n_seq`` streams of ``room`` cells, with llama.cpp's logged KV size."""
        p = self.lc.llama_context_default_params()
        p.n_ctx = p.n_batch = n_seq * room
        p.n_ubatch = min(512, p.n_ctx)
        p.n_seq_max = n_seq
        p.n_threads = p.n_threads_batch = self.threads
        p.flash_attn_type = self.lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if self.kv_type != "f16":  # llama.cpp's default is f16 (llama_context_default_params)
            p.type_k = p.type_v = getattr(self.lc, f"GGML_TYPE_{self.kv_type.upper()}")
        with _captured_log(self.lc) as lines:
            ctx = self.lc.llama_init_from_model(self.model, p)
        if not ctx:
            raise PreconditionError(STAGE, f"llama.cpp could not create a context of {n_seq} x {room} tokens for "
                                    f"{self.path.name}")
        m = next((_KV_LINE.search(line) for line in lines if _KV_LINE.search(line)), None)
        if m is None:
            self.lc.llama_free(ctx)
            raise PreconditionError(STAGE, f"llama.cpp logged no KV cache size for {self.path.name}",
                                    "this llama.cpp's log format differs from the one bench/stage/engine_llamacpp.py reads")
        cells, streams = int(m.group(2)), int(m.group(5))
        return _Context(ctx, n_seq, int(self.lc.llama_n_ctx(ctx)) // n_seq, round(float(m.group(1)) * 2**20),
                        cells * streams, m.group(6))

    def kv_allocation(self, tokens: int) -> tuple[int, int]:
        """(KV bytes, cells) llama.cpp allocates for a one-sequence context of ``tokens`` positions,
        read from its log as the context is created; the context is freed again."""
        c = self._create(1, tokens)
        self.lc.llama_free(c.ctx)
        return c.kv_bytes, c.kv_cells

    def _decode(self, c: _Context, tokens: np.ndarray, start: int, all_logits: bool) -> np.ndarray:
        """Decode ``tokens [B, n]`` at positions ``start..`` (row b is sequence b) as one batch;
        logits ``[B, n or 1, V]``."""
        lc = self.lc
        b, n = tokens.shape
        tok = np.ascontiguousarray(tokens.reshape(-1), dtype=np.int32)
        pos = np.tile(np.arange(start, start + n, dtype=np.int32), b)
        n_seq = np.ones(b * n, dtype=np.int32)
        seq = np.arange(b, dtype=np.int32)
        seq_ptr = (seq.ctypes.data + seq.itemsize * np.repeat(np.arange(b), n)).astype(np.uintp)
        want = np.ones(b * n, dtype=np.int8) if all_logits else np.tile((np.arange(n) == n - 1).astype(np.int8), b)
        batch = lc.llama_batch()
        batch.n_tokens = b * n
        batch.token = tok.ctypes.data_as(ctypes.POINTER(lc.llama_token))
        batch.pos = pos.ctypes.data_as(ctypes.POINTER(lc.llama_pos))
        batch.n_seq_id = n_seq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        batch.seq_id = seq_ptr.ctypes.data_as(ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id)))
        batch.logits = want.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        rc = lc.llama_decode(c.ctx, batch)
        if rc != 0:
            raise PreconditionError(STAGE, f"llama_decode returned {rc} on {self.path.name} ({b} x {n} tokens at {start})")
        out = int(want.sum())
        logits = np.ctypeslib.as_array(lc.llama_get_logits(c.ctx), shape=(out, self.vocab))
        return np.array(logits, dtype=np.float32).reshape(b, out // b, self.vocab)

    def _fresh(self, tokens: np.ndarray, all_logits: bool) -> tuple[np.ndarray, _State]:
        b, s = tokens.shape
        c = self._context(b, s + (0 if all_logits else 1))
        self.lc.llama_memory_clear(self.lc.llama_get_memory(c.ctx), True)
        return self._decode(c, tokens, 0, all_logits), _State(c, tokens)

    # ---- the Engine protocol -------------------------------------------------------------------
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logits, state = self._fresh(ids.numpy().astype(np.int32), False)
        return torch.from_numpy(logits[:, -1]), state

    def decode(self, token: torch.Tensor, state: _State) -> tuple[torch.Tensor, Any]:
        tok = token.numpy().astype(np.int32).reshape(-1, 1)
        c, done = state.context, state.tokens.shape[1]
        if done + 1 > c.cells:  # rebuild larger and replay the sequence so far
            self._context(c.n_seq, done + 1)
            _, state = self._fresh(state.tokens, False)
            c = state.context
        logits = self._decode(c, tok, done, False)
        return torch.from_numpy(logits[:, -1]), _State(c, np.concatenate([state.tokens, tok], axis=1))

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids.numpy().astype(np.int32)
        return torch.from_numpy(np.concatenate([self._fresh(x[i: i + 1], True)[0] for i in range(x.shape[0])]))

    def cache_bytes(self, state: _State) -> int:
        return state.context.kv_bytes

    def cache_tokens(self, state: _State) -> int | None:
        return state.context.kv_cells

    def close(self) -> None:
        for c in self._contexts.values():
            self.lc.llama_free(c.ctx)
        self._contexts.clear()
        if self.model:
            self.lc.llama_model_free(self.model)
            self.model = None


def gguf_path(source: Any) -> Path:
    """The GGUF of a bench source: a ``.gguf`` file, or a folder (a gguf artifact) holding
    ``model.gguf``: its llama.cpp-quantized file where ``harp_gguf.json`` names one (what a
    ``--gguf-type`` build deploys)."""
    p = source.path if isinstance(source, Artifact) else Path(source)
    if not p.is_dir():
        return p
    report = _report(p)
    return p / (report.get("quantized_file") or report.get("file") or GGUF_FILE)


def _report(folder: Path) -> dict[str, Any]:
    f = folder / REPORT
    try:
        return json.loads(f.read_text()) if f.is_file() else {}
    except ValueError:
        return {}


def load_llamacpp_pair(plan, source, config, kv_type: str = "f16") -> EnginePair:
    """``source``: ``{"dense": ..., "harp": ...}`` GGUF files or folders holding ``model.gguf``. The
    HARP file's layers without KV heads must be the plan's pruned layers. ``kv_type``: the KV
    cache's element type (``KV_TYPES``)."""
    from .gguf_meta import gguf_dims, gguf_tokenizer

    paths = {v: gguf_path(source[v]) for v in ("dense", "harp")}
    for v, p in paths.items():
        if not p.is_file():
            raise PreconditionError(STAGE, f"{v} GGUF {p} does not exist",
                                    "pass GGUF files (or folders with model.gguf) written by harp-trt deploy gguf")
    dims, ctx_len, _ = gguf_dims(paths["dense"])
    _, _, no_kv = gguf_dims(paths["harp"])
    if sorted(no_kv) != sorted(plan.layers):
        raise PreconditionError(STAGE, f"HARP GGUF {paths['harp']} has no KV heads in layers {sorted(no_kv)}; the "
                                f"plan prunes {list(plan.layers)}", "write the HARP GGUF from this plan")
    headroom = max(config.decode_tokens, config.greedy_tokens) + 1
    engines = {v: LlamaCppEngine(p, v, config.threads, headroom, ctx_len, kv_type) for v, p in paths.items()}
    import llama_cpp

    info = {v: {"gguf": str(p), "threads": engines[v].threads, "flash_attention": True,
                "llama_cpp_python": llama_cpp.__version__, "kv_type": engines[v]._contexts[1].kv_type}
            for v, p in paths.items()}
    log.info("llama.cpp engines: dense %s, harp %s", paths["dense"], paths["harp"])
    model = (_report(paths["dense"].parent).get("model") or {}).get("folder")
    return EnginePair("llamacpp", engines["dense"], engines["harp"], gguf_tokenizer(paths["dense"], model), dims,
                      plan.alpha_map, info)
