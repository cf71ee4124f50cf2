"""llama.cpp at run time, through llama-cpp-python's low-level bindings (``llama_cpp``): logits of a
token sequence, greedy tokens, tokenization, the KV cache llama.cpp allocates, quantization with
llama.cpp's own quantizer, and the version. Everything here runs the real library on a GGUF file.

KV bytes are llama.cpp's own accounting: the ``llama_kv_cache`` constructor
(``src/llama-kv-cache.cpp``) logs ``size = X MiB (N cells, L layers, ...), K (type): a MiB, V (type): b MiB``
for the buffers it allocated; ``kv_cache`` captures that line through ``llama_log_set``. The log
prints MiB to two decimals (an error of up to 5243 bytes on the total), so with ``cells = 16384``
the bytes per cell are exact after rounding (error <= 0.32 byte)."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["llama_cpp_version", "LlamaRun", "open_gguf", "logits", "greedy", "tokenize", "kv_cache",
           "quantize", "KV_TYPES"]

log = logging.getLogger(__name__)
KV_TYPES = {"f32": 0, "f16": 1}  # enum ggml_type: GGML_TYPE_F32, GGML_TYPE_F16
KV_CELLS = 16384  # see the module docstring: exact bytes per cell from a two-decimal MiB figure
_KV_LINE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers.*?"
                      r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB")


def _lib():
    from harp_trt.extras import require

    return require("llama_cpp", "llama.cpp writes, checks and quantizes the GGUF")


def llama_cpp_version() -> str:
    return _lib().__version__


def _threads(threads: int | None) -> int:
    """llama.cpp threads: ``threads``, default 1. The checks here are correctness checks, not timings;
    on a shared machine llama.cpp's spinning worker threads make a 2-thread decode up to 10x slower
    than a 1-thread one (SmolLM2 f32, 2 cores at load 8: 0.1 s vs 0.5-10 s per token)."""
    return max(1, int(threads or 1))


_sink: list[str] | None = None  # where llama.cpp's log lines go while a capture is open
_callback = None


def _route_log(level: int, text: bytes, user_data) -> None:  # noqa: ARG001
    line = text.decode("utf-8", "replace")
    if _sink is not None:
        _sink.append(line)
    if level >= 3 and level != 5 and line.strip():  # WARN, ERROR (ggml/include/ggml.h enum ggml_log_level)
        # llama.cpp warns about what this package does on purpose (V cache padding without flash
        # attention, dummy tokens of a vocab-less file, contexts past the trained one): debug level
        (log.warning if level == 4 else log.debug)("llama.cpp: %s", line.rstrip())


def _install_log() -> None:
    """Route llama.cpp's log (``llama_log_set``) to Python logging and the open capture, once per
    process (llama-cpp-python's default callback prints every line to stderr)."""
    global _callback
    if _callback is None:
        lib = _lib()
        _callback = lib.llama_log_callback(_route_log)
        lib.llama_log_set(_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    """Every line llama.cpp logs inside the block."""
    global _sink
    _install_log()
    lines: list[str] = []
    _sink = lines
    try:
        yield lines
    finally:
        _sink = None


class LlamaRun:
    """A loaded GGUF and one context (``open_gguf``); ``close`` frees both."""

    def __init__(self, model, ctx, n_ctx: int, log: str):
        self.model, self.ctx, self.n_ctx, self.log = model, ctx, n_ctx, log
        lib = _lib()
        self.vocab = lib.llama_model_get_vocab(model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(self.vocab))

    def decode(self, tokens: Sequence[int], start: int = 0, all_logits: bool = True) -> np.ndarray:
        """Run ``tokens`` at positions ``start...``; logits of every position (or the last) as
        ``[n, vocab]`` float32."""
        lib = _lib()
        n = len(tokens)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = bool(all_logits or i == n - 1)
            batch.n_tokens = n
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            rows = range(n) if all_logits else [n - 1]
            return np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
                             for i in rows])
        finally:
            lib.llama_batch_free(batch)

    def close(self) -> None:
        lib = _lib()
        if self.ctx is not None:
            lib.llama_free(self.ctx)
        if self.model is not None:
            lib.llama_model_free(self.model)
        self.ctx = self.model = None

    def __enter__(self) -> "LlamaRun":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_gguf(path: str | Path, *, n_ctx: int = 512, flash_attn: bool = False, kv_type: str = "f32",
              n_batch: int = 512, vocab_only: bool = False, threads: int | None = None) -> LlamaRun:
    """Load a GGUF with llama.cpp (CPU) and create a context (none with ``vocab_only``)."""
    lib = _lib()
    lib.llama_backend_init()
    with _captured_log() as lines:
        mp = lib.llama_model_default_params()
        mp.vocab_only = vocab_only
        mp.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise RuntimeError(f"llama.cpp cannot load {path}: {''.join(lines)[-600:]}")
        ctx = None
        if not vocab_only:
            cp = lib.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, 1
            cp.n_threads = cp.n_threads_batch = _threads(threads)
            cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
            cp.type_k = cp.type_v = KV_TYPES[kv_type]
            ctx = lib.llama_init_from_model(model, cp)
            if not ctx:
                lib.llama_model_free(model)
                raise RuntimeError(f"llama.cpp cannot create a context for {path}: {''.join(lines)[-600:]}")
    return LlamaRun(model, ctx, n_ctx, "".join(lines))


def logits(path: str | Path, tokens: Sequence[int], *, kv_type: str = "f32", flash_attn: bool = False,
           threads: int | None = None) -> np.ndarray:
    """``[len(tokens), vocab]`` logits of one forward pass over ``tokens`` (positions 0...)."""
    n = max(32, len(tokens))
    with open_gguf(path, n_ctx=max(256, n), n_batch=n, kv_type=kv_type, flash_attn=flash_attn,
                   threads=threads) as run:
        return run.decode(tokens)


def greedy(path: str | Path, prompt: Sequence[int], n_new: int, *, kv_type: str = "f32",
           flash_attn: bool = False, threads: int | None = None) -> list[int]:
    """``n_new`` greedy tokens after ``prompt``: one prefill, then one token per decode (KV cache)."""
    n = len(prompt) + n_new
    with open_gguf(path, n_ctx=max(256, n), n_batch=max(32, len(prompt)), kv_type=kv_type,
                   flash_attn=flash_attn, threads=threads) as run:
        out: list[int] = []
        last = run.decode(prompt, all_logits=False)[-1]
        for step in range(n_new):
            out.append(int(np.argmax(last)))
            if step + 1 < n_new:
                last = run.decode([out[-1]], start=len(prompt) + step, all_logits=False)[-1]
        return out


def tokenize(path: str | Path, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
    """llama.cpp's tokenization of ``text`` with the GGUF's own vocabulary (a vocab-only load);
    ``parse_special``: special-token text (``<|im_end|>``) becomes its token, as Hugging Face
    tokenizers do by default."""
    lib = _lib()
    with open_gguf(path, vocab_only=True) as run:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (lib.llama_token * cap)()
        n = lib.llama_tokenize(run.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize needs {-n} tokens")
        return [int(buf[i]) for i in range(n)]


def kv_cache(path: str | Path, *, flash_attn: bool, kv_type: str = "f16", cells: int = KV_CELLS) -> dict[str, Any]:
    """The KV cache llama.cpp allocates for ``cells`` tokens of one sequence, from its own log line;
    ``bytes_per_token``: K + V bytes per cell (exact, see the module docstring)."""
    with open_gguf(path, n_ctx=cells, n_batch=32, kv_type=kv_type, flash_attn=flash_attn) as run:
        m = _KV_LINE.search(run.log)
    if not m:
        raise RuntimeError(f"llama.cpp logged no KV cache size for {path}")
    total, n_cells, n_layers = float(m.group(1)), int(m.group(2)), int(m.group(3))
    k_mib, v_mib = float(m.group(5)), float(m.group(7))
    return {"cells": n_cells, "layers": n_layers, "k_type": m.group(4), "v_type": m.group(6),
            "k_mib": k_mib, "v_mib": v_mib, "total_mib": total, "flash_attn": flash_attn,
            "bytes_per_token": int(round(total * 2 ** 20 / n_cells)), "log_line": m.group(0)}


def quantize(src: str | Path, dst: str | Path, gguf_type: str) -> None:
    """``llama_model_quantize`` (llama.cpp's quantizer, ``src/llama-quant.cpp``) to ``gguf_type``
    (``LLAMA_FTYPE_MOSTLY_<TYPE>``)."""
    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{gguf_type.upper()}")
    params.nthread = os.cpu_count() or 1
    with _captured_log() as lines:
        rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({gguf_type}) returned {rc}: {''.join(lines)[-600:]}")
